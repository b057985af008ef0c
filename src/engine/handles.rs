//! Physical handles: each owned handle's record and which of the three places it is in
//! (mapped, unmapped, quarantined).
#![forbid(unsafe_code)]

use super::va::VaSpace;
use super::Engine;
use crate::driver::{Driver, DriverOp, DriverResult, PhysHandle};
use std::collections::BTreeMap;

/// One owned handle.
#[derive(Debug)]
pub(crate) struct HandleRecord {
    pub(crate) handle: PhysHandle,
    /// Size in bytes, a multiple of the granularity.
    pub(crate) size: u64,
    /// Where it is mapped with access (its key in `mapped`), or mapped without access
    /// (quarantined); `None` exactly when it is in `unmapped`.
    pub(crate) at: Option<u64>,
    /// Old mappings of it still among the ghosts; it may be released only at 0.
    pub(crate) ghosts: u32,
    /// Its descriptor once exported to other processes (`share.rs`); closed when the record
    /// goes, that is when the handle is released.
    pub(crate) exported: Option<std::os::fd::OwnedFd>,
}

/// Sums over the handles, for the engine's cross-checks.
#[derive(Debug, Default)]
pub(crate) struct HandleTotals {
    /// Bytes of every owned handle.
    pub(crate) reserved: u64,
    /// Number of owned handles.
    pub(crate) count: u64,
    /// Bytes of the mapped, accessible handles.
    pub(crate) mapped: u64,
    /// Bytes of the quarantined handles.
    pub(crate) quarantined: u64,
}

/// Every owned handle. Each is in exactly one of `mapped`, `unmapped`, `quarantined`.
#[derive(Debug, Default)]
pub(crate) struct Handles {
    /// Records by handle id; `None` for released ids (listed in `free_ids`).
    records: Vec<Option<HandleRecord>>,
    /// Ids of released records, reused first.
    free_ids: Vec<u32>,
    /// address -> handle id, for every mapped, accessible handle. Mappings do not overlap,
    /// lie in reserved, used address space, and are covered exactly by blocks.
    pub(crate) mapped: BTreeMap<u64, u32>,
    /// Owned handles that are not mapped (records with `at == None`).
    pub(crate) unmapped: Vec<u32>,
    /// Handles left mapped without access after a failed rollback (their `at` is set, they
    /// are not in `mapped`); unmapping them is retried on slow paths.
    pub(crate) quarantined: Vec<u32>,
}

impl Handles {
    /// Record a new handle, owned and unmapped but in no list yet; returns its id.
    pub(crate) fn add(&mut self, handle: PhysHandle, size: u64) -> u32 {
        let rec = Some(HandleRecord {
            handle,
            size,
            at: None,
            ghosts: 0,
            exported: None,
        });
        if let Some(h) = self.free_ids.pop() {
            self.records[h as usize] = rec;
            h
        } else {
            self.records.push(rec);
            (self.records.len() - 1) as u32
        }
    }

    /// Forget a released handle's record.
    pub(crate) fn remove(&mut self, id: u32) {
        self.records[id as usize] = None;
        self.free_ids.push(id);
    }

    /// The record of owned handle `id`.
    pub(crate) fn record(&self, id: u32) -> &HandleRecord {
        self.records[id as usize].as_ref().expect("owned handle")
    }

    /// The record of handle `id`, if it is owned.
    pub(crate) fn get(&self, id: u32) -> Option<&HandleRecord> {
        self.records.get(id as usize).and_then(Option::as_ref)
    }

    pub(crate) fn record_mut(&mut self, id: u32) -> &mut HandleRecord {
        self.records[id as usize].as_mut().expect("owned handle")
    }

    /// The size of owned handle `id`.
    pub(crate) fn size(&self, id: u32) -> u64 {
        self.record(id).size
    }

    /// Number of id slots (released ones included): the bound of every handle id.
    pub(crate) fn slots(&self) -> usize {
        self.records.len()
    }

    /// Every owned handle as (id, record).
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u32, &HandleRecord)> {
        self.records
            .iter()
            .enumerate()
            .filter_map(|(id, h)| h.as_ref().map(|h| (id as u32, h)))
    }

    /// The mapped handle containing `addr`, as (start, id).
    pub(crate) fn containing(&self, addr: u64) -> Option<(u64, u32)> {
        let (&a, &id) = self.mapped.range(..=addr).next_back()?;
        (addr < a + self.size(id)).then_some((a, id))
    }

    /// The mapped handles from the one starting at or before `start` up to `end`, as
    /// `(start, end)` in address order.
    pub(crate) fn spans_from(&self, start: u64, end: u64) -> impl Iterator<Item = (u64, u64)> + '_ {
        let first = self
            .mapped
            .range(..=start)
            .next_back()
            .map_or(start, |(&h, _)| h);
        self.mapped
            .range(first..end)
            .map(|(&a, &id)| (a, a + self.size(id)))
    }

    /// Heap bytes of the records and lists (capacities).
    pub(crate) fn metadata_bytes(&self) -> u64 {
        let vec = |cap: usize, each: usize| (cap * each) as u64;
        vec(
            self.records.capacity(),
            std::mem::size_of::<Option<HandleRecord>>(),
        ) + vec(self.free_ids.capacity(), 4)
            // B-tree: about 1.5x the raw entry size
            + vec(self.mapped.len(), 12) * 3 / 2
            + vec(self.unmapped.capacity() + self.quarantined.capacity(), 4)
    }

    /// Check the records against the three lists and the address space.
    pub(crate) fn validate(&self, va: &VaSpace) -> Result<HandleTotals, String> {
        let mut t = HandleTotals::default();
        for (_, h) in self.iter() {
            t.reserved += h.size;
            t.count += 1;
        }
        let mut last_end = 0;
        for (&a, &id) in &self.mapped {
            let h = self.records[id as usize]
                .as_ref()
                .ok_or_else(|| format!("mapped handle {id} was released"))?;
            if h.at != Some(a) {
                return Err(format!("handle {id} mapped at {a:#x} records {:?}", h.at));
            }
            if a < last_end {
                return Err(format!("mappings overlap at {a:#x}"));
            }
            if !va.is_reserved(a, h.size) || va.overlaps_free(a, h.size) {
                return Err(format!(
                    "mapping {a:#x} is outside reserved, used address space"
                ));
            }
            last_end = a + h.size;
            t.mapped += h.size;
        }
        for &id in &self.unmapped {
            if self.record(id).at.is_some() {
                return Err(format!("unmapped handle {id} records an address"));
            }
        }
        for &id in &self.quarantined {
            if self.record(id).at.is_none() {
                return Err(format!("quarantined handle {id} records no address"));
            }
        }
        t.quarantined = self.quarantined.iter().map(|&h| self.size(h)).sum();
        if t.count != (self.mapped.len() + self.unmapped.len() + self.quarantined.len()) as u64 {
            return Err("a handle is neither mapped, unmapped nor quarantined".into());
        }
        Ok(t)
    }
}

impl Engine {
    /// Own a handle the driver just created (unmapped, in no list yet); returns its id.
    pub(super) fn add_handle(&mut self, handle: PhysHandle, size: u64) -> u32 {
        self.stats.reserved.add(size);
        self.stats.handles += 1;
        self.stats.handles_created += 1;
        self.handles.add(handle, size)
    }

    /// Release an unmapped handle to the driver. On failure it stays owned and unmapped.
    pub(super) fn release_handle<D: Driver + ?Sized>(
        &mut self,
        d: &D,
        id: u32,
    ) -> DriverResult<()> {
        let h = self.handles.record(id).handle;
        match self.driver_call(DriverOp::Release, || d.release(h)) {
            Ok(()) => {
                let size = self.handles.size(id);
                tracing::debug!(size, "released a handle");
                self.handles.remove(id);
                self.stats.reserved.sub(size);
                self.stats.handles -= 1;
                self.stats.handles_released += 1;
                Ok(())
            }
            Err(e) => {
                self.handles.unmapped.push(id);
                Err(e)
            }
        }
    }

    /// Retry unmapping quarantined handles; those that succeed become ordinary unmapped
    /// handles, usable by the next stitch (or released by `empty_cache`).
    pub(super) fn retry_quarantine<D: Driver + ?Sized>(&mut self, d: &D) {
        for id in std::mem::take(&mut self.handles.quarantined) {
            let rec = self.handles.record(id);
            let (addr, size) = (rec.at.expect("quarantined is mapped"), rec.size);
            if self
                .driver_call(DriverOp::Unmap, || d.unmap(addr, size))
                .is_err()
            {
                self.handles.quarantined.push(id);
                continue;
            }
            self.handles.record_mut(id).at = None;
            self.va.free(addr, size);
            self.handles.unmapped.push(id);
        }
    }
}
