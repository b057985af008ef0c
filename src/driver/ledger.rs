//! Bookkeeping shared by the CPU backends: reservations, handles, mappings and access, with
//! every CUDA VMM rule checked. The backends call `check_*` before doing anything real and
//! `commit_*` once it is done, so a rule violation or an OS failure leaves the ledger as it was.
#![forbid(unsafe_code)]

use super::streams::StreamModel;
use super::{code, CallCounts, DevAddr, DriverError, DriverOp, DriverResult, PhysHandle};
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};

/// What a backend still holds: anything non-zero after the allocator is gone is a leak.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct LeakReport {
    /// Physical handles not released.
    pub handles: usize,
    /// Bytes in those handles.
    pub handle_bytes: u64,
    /// Mappings not unmapped.
    pub mappings: usize,
    /// Address reservations not freed.
    pub reservations: usize,
    /// Events not destroyed.
    pub events: usize,
}

impl LeakReport {
    /// True when nothing is held.
    pub fn is_clean(&self) -> bool {
        *self == LeakReport::default()
    }
}

#[derive(Debug)]
pub(crate) struct HandleInfo {
    pub(crate) size: u64,
    /// Number of live mappings of this handle (CUDA allows aliases).
    pub(crate) maps: u32,
    /// Imported from another process: its bytes are the exporter's, not in `used`.
    pub(crate) imported: bool,
}

#[derive(Debug)]
pub(crate) struct Mapping {
    pub(crate) size: u64,
    pub(crate) handle: PhysHandle,
    pub(crate) access: bool,
}

/// The state of one simulated device.
#[derive(Debug)]
pub(crate) struct Ledger {
    pub(crate) granularity: u64,
    /// Physical bytes that can be created; `used <= capacity`.
    pub(crate) capacity: u64,
    /// Sum of the sizes of all live handles.
    pub(crate) used: u64,
    /// base -> size; reservations never overlap.
    pub(crate) reservations: BTreeMap<DevAddr, u64>,
    pub(crate) handles: HashMap<u64, HandleInfo>,
    /// start -> mapping; mappings never overlap and each lies inside one reservation.
    pub(crate) mappings: BTreeMap<DevAddr, Mapping>,
    next_handle: u64,
    pub(crate) streams: StreamModel,
    pub(crate) calls: CallCounts,
}

/// Highest address + 1 a reservation may reach (the 47-bit user address space).
pub(crate) const VA_LIMIT: u64 = 1 << 47;
/// Lowest address the simulator hands out.
const VA_BASE: u64 = 1 << 40;

fn err(op: DriverOp, code: i64, msg: String) -> DriverError {
    DriverError::new(op, code, msg)
}

impl Ledger {
    pub(crate) fn new(granularity: u64, capacity: u64) -> Self {
        assert!(
            granularity.is_power_of_two(),
            "granularity must be a power of two"
        );
        Ledger {
            granularity,
            capacity: capacity / granularity * granularity,
            used: 0,
            reservations: BTreeMap::new(),
            handles: HashMap::new(),
            mappings: BTreeMap::new(),
            next_handle: 0,
            streams: StreamModel::default(),
            calls: CallCounts::default(),
        }
    }

    fn check_size(&self, op: DriverOp, size: u64) -> DriverResult<()> {
        if size == 0 || size % self.granularity != 0 {
            return Err(err(
                op,
                code::INVALID_VALUE,
                format!(
                    "size {size} is not a non-zero multiple of the granularity {}",
                    self.granularity
                ),
            ));
        }
        Ok(())
    }

    /// Find a free address range of `size` for a reservation (first fit above `VA_BASE`).
    pub(crate) fn find_va(&self, size: u64) -> DriverResult<DevAddr> {
        self.check_size(DriverOp::Reserve, size)?;
        let mut cursor = VA_BASE;
        for (&b, &s) in &self.reservations {
            if b >= cursor && b - cursor >= size {
                break;
            }
            cursor = cursor.max(b + s);
        }
        match cursor.checked_add(size) {
            Some(end) if end <= VA_LIMIT => Ok(cursor),
            _ => Err(err(
                DriverOp::Reserve,
                code::OUT_OF_MEMORY,
                format!("no {size}-byte range left in the 128 TiB virtual address space"),
            )),
        }
    }

    pub(crate) fn check_reserve_at(&self, base: DevAddr, size: u64) -> DriverResult<()> {
        self.check_size(DriverOp::Reserve, size)?;
        if base % self.granularity != 0 {
            return Err(err(
                DriverOp::Reserve,
                code::INVALID_VALUE,
                format!("base {base:#x} is not aligned"),
            ));
        }
        if let Some((&b, &s)) = self.reservations.range(..base + size).next_back() {
            if b + s > base {
                return Err(err(
                    DriverOp::Reserve,
                    code::INVALID_VALUE,
                    format!("range {base:#x}+{size} overlaps reservation {b:#x}+{s}"),
                ));
            }
        }
        Ok(())
    }

    pub(crate) fn commit_reserve(&mut self, base: DevAddr, size: u64) {
        self.reservations.insert(base, size);
    }

    pub(crate) fn check_free_reservation(&self, base: DevAddr, size: u64) -> DriverResult<()> {
        let op = DriverOp::FreeReservation;
        match self.reservations.get(&base) {
            Some(&s) if s == size => {}
            Some(&s) => {
                return Err(err(
                    op,
                    code::INVALID_VALUE,
                    format!("reservation {base:#x} has size {s}, not {size}"),
                ))
            }
            None => {
                return Err(err(
                    op,
                    code::INVALID_VALUE,
                    format!("no reservation starts at {base:#x}"),
                ))
            }
        }
        if let Some((&a, _)) = self.mappings.range(base..base + size).next() {
            return Err(err(
                op,
                code::INVALID_VALUE,
                format!("reservation {base:#x} still holds the mapping at {a:#x}"),
            ));
        }
        Ok(())
    }

    pub(crate) fn commit_free_reservation(&mut self, base: DevAddr) {
        self.reservations.remove(&base);
    }

    pub(crate) fn check_create(&self, size: u64) -> DriverResult<()> {
        self.check_size(DriverOp::Create, size)?;
        if self.used + size > self.capacity {
            return Err(err(
                DriverOp::Create,
                code::OUT_OF_MEMORY,
                format!(
                    "cannot create {size} bytes: {} of {} in use",
                    self.used, self.capacity
                ),
            ));
        }
        Ok(())
    }

    pub(crate) fn commit_create(&mut self, size: u64) -> PhysHandle {
        self.next_handle += 1;
        self.handles.insert(
            self.next_handle,
            HandleInfo {
                size,
                maps: 0,
                imported: false,
            },
        );
        self.used += size;
        PhysHandle::new(self.next_handle)
    }

    /// Like `commit_create` but with a handle id the backend chose (the host uses fds).
    pub(crate) fn commit_create_as(&mut self, id: u64, size: u64) -> PhysHandle {
        self.handles.insert(
            id,
            HandleInfo {
                size,
                maps: 0,
                imported: false,
            },
        );
        self.used += size;
        PhysHandle::new(id)
    }

    /// Record a handle imported from another process under the id the backend chose; it
    /// takes nothing from the capacity (the exporter's device holds its memory).
    pub(crate) fn commit_import_as(&mut self, id: u64, size: u64) -> PhysHandle {
        self.handles.insert(
            id,
            HandleInfo {
                size,
                maps: 0,
                imported: true,
            },
        );
        PhysHandle::new(id)
    }

    pub(crate) fn check_release(&self, h: PhysHandle) -> DriverResult<u64> {
        match self.handles.get(&h.0) {
            None => Err(err(
                DriverOp::Release,
                code::INVALID_HANDLE,
                format!("unknown handle {}", h.0),
            )),
            Some(i) if i.maps > 0 => Err(err(
                DriverOp::Release,
                code::INVALID_VALUE,
                format!("handle {} is still mapped {} time(s)", h.0, i.maps),
            )),
            Some(i) => Ok(i.size),
        }
    }

    pub(crate) fn commit_release(&mut self, h: PhysHandle) {
        if let Some(i) = self.handles.remove(&h.0) {
            if !i.imported {
                self.used -= i.size;
            }
        }
    }

    pub(crate) fn check_map(&self, addr: DevAddr, size: u64, h: PhysHandle) -> DriverResult<()> {
        let op = DriverOp::Map;
        match self.handles.get(&h.0) {
            None => {
                return Err(err(
                    op,
                    code::INVALID_HANDLE,
                    format!("unknown handle {}", h.0),
                ))
            }
            Some(i) if i.size != size => {
                return Err(err(
                    op,
                    code::INVALID_VALUE,
                    format!(
                        "handle {} has {} bytes: a handle is mapped whole, not {size}",
                        h.0, i.size
                    ),
                ))
            }
            Some(_) => {}
        }
        if addr % self.granularity != 0 {
            return Err(err(
                op,
                code::INVALID_VALUE,
                format!("address {addr:#x} is not aligned"),
            ));
        }
        let inside = self
            .reservations
            .range(..=addr)
            .next_back()
            .is_some_and(|(&b, &s)| addr + size <= b + s);
        if !inside {
            return Err(err(
                op,
                code::INVALID_VALUE,
                format!("{addr:#x}+{size} is not inside one reservation"),
            ));
        }
        if let Some((&a, m)) = self.mappings.range(..addr + size).next_back() {
            if a + m.size > addr {
                return Err(err(
                    op,
                    code::INVALID_VALUE,
                    format!("{addr:#x}+{size} overlaps the mapping at {a:#x}"),
                ));
            }
        }
        Ok(())
    }

    pub(crate) fn commit_map(&mut self, addr: DevAddr, size: u64, h: PhysHandle) {
        self.mappings.insert(
            addr,
            Mapping {
                size,
                handle: h,
                access: false,
            },
        );
        if let Some(i) = self.handles.get_mut(&h.0) {
            i.maps += 1;
        }
    }

    pub(crate) fn check_unmap(&self, addr: DevAddr, size: u64) -> DriverResult<()> {
        let op = DriverOp::Unmap;
        match self.mappings.get(&addr) {
            None => {
                return Err(err(
                    op,
                    code::INVALID_VALUE,
                    format!("no mapping starts at {addr:#x}"),
                ))
            }
            Some(m) if m.size != size => {
                return Err(err(
                    op,
                    code::INVALID_VALUE,
                    format!(
                        "partial unmap: the mapping at {addr:#x} has {} bytes, not {size}",
                        m.size
                    ),
                ))
            }
            Some(_) => {}
        }
        if let Some((stream, work)) = self.streams.in_flight(addr, size) {
            return Err(err(
                op,
                code::ILLEGAL_ADDRESS,
                format!(
                    "use-after-free: work {} on stream {:#x} still uses {addr:#x}+{size}",
                    work.0, stream.0
                ),
            ));
        }
        Ok(())
    }

    pub(crate) fn commit_unmap(&mut self, addr: DevAddr) {
        if let Some(m) = self.mappings.remove(&addr) {
            if let Some(i) = self.handles.get_mut(&m.handle.0) {
                i.maps -= 1;
            }
        }
    }

    /// Check that `[addr, addr+size)` is covered by mappings with no gap.
    fn check_covered(
        &self,
        op: DriverOp,
        addr: DevAddr,
        size: u64,
        need_access: bool,
    ) -> DriverResult<()> {
        let mut cursor = addr;
        let end = addr + size;
        if let Some((&a, m)) = self.mappings.range(..=addr).next_back() {
            if a + m.size > addr {
                if need_access && !m.access {
                    return Err(err(
                        op,
                        code::INVALID_VALUE,
                        format!("{a:#x} is mapped but has no access set"),
                    ));
                }
                cursor = a + m.size;
            }
        }
        while cursor < end {
            match self.mappings.get(&cursor) {
                Some(m) => {
                    if need_access && !m.access {
                        return Err(err(
                            op,
                            code::INVALID_VALUE,
                            format!("{cursor:#x} is mapped but has no access set"),
                        ));
                    }
                    cursor += m.size
                }
                None => {
                    return Err(err(
                        op,
                        code::INVALID_VALUE,
                        format!("{cursor:#x} inside {addr:#x}+{size} is not mapped"),
                    ))
                }
            }
        }
        Ok(())
    }

    pub(crate) fn check_set_access(&self, addr: DevAddr, size: u64) -> DriverResult<()> {
        if size == 0 {
            return Err(err(
                DriverOp::SetAccess,
                code::INVALID_VALUE,
                "empty range".to_string(),
            ));
        }
        self.check_covered(DriverOp::SetAccess, addr, size, false)
    }

    pub(crate) fn commit_set_access(&mut self, addr: DevAddr, size: u64) {
        let start = self
            .mappings
            .range(..=addr)
            .next_back()
            .map_or(addr, |(&a, _)| a);
        for (_, m) in self.mappings.range_mut(start..addr + size) {
            m.access = true;
        }
    }

    /// Check that host copies may touch `[addr, addr+len)`.
    pub(crate) fn check_data(&self, addr: DevAddr, len: u64) -> DriverResult<()> {
        if len == 0 {
            return Ok(());
        }
        self.check_covered(DriverOp::Copy, addr, len, true)
    }

    #[cfg(feature = "testing")]
    /// Every live handle as `(size, addresses it is mapped at)`, in handle order: the
    /// device's own view, read by the test harness's zero-fragmentation oracle.
    pub(crate) fn handle_mappings(&self) -> Vec<(u64, Vec<DevAddr>)> {
        let mut ids: Vec<u64> = self.handles.keys().copied().collect();
        ids.sort_unstable();
        let index: HashMap<u64, usize> = ids.iter().enumerate().map(|(i, &h)| (h, i)).collect();
        let mut out: Vec<(u64, Vec<DevAddr>)> = ids
            .iter()
            .map(|h| (self.handles[h].size, Vec::new()))
            .collect();
        for (&addr, m) in &self.mappings {
            out[index[&m.handle.0]].1.push(addr);
        }
        out
    }

    pub(crate) fn leak_report(&self) -> LeakReport {
        LeakReport {
            handles: self.handles.len(),
            handle_bytes: self.used,
            mappings: self.mappings.len(),
            reservations: self.reservations.len(),
            events: self.streams.live_events(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    const G: u64 = 2 << 20;

    #[test]
    fn rules_are_enforced() {
        let mut l = Ledger::new(G, 10 * G);
        let base = l.find_va(8 * G).unwrap();
        l.check_reserve_at(base, 8 * G).unwrap();
        l.commit_reserve(base, 8 * G);
        assert!(
            l.check_reserve_at(base + G, G).is_err(),
            "overlapping reservation"
        );
        assert!(l.check_create(11 * G).is_err(), "over capacity");
        assert!(l.check_create(G + 1).is_err(), "unaligned size");
        l.check_create(2 * G).unwrap();
        let h = l.commit_create(2 * G);
        assert!(l.check_map(base, G, h).is_err(), "partial handle");
        assert!(
            l.check_map(base + 7 * G, 2 * G, h).is_err(),
            "outside reservation"
        );
        l.check_map(base, 2 * G, h).unwrap();
        l.commit_map(base, 2 * G, h);
        assert!(
            l.check_map(base + G, 2 * G, h).is_err(),
            "overlapping mapping"
        );
        assert!(l.check_data(base, 16).is_err(), "no access yet");
        assert!(l.check_set_access(base, 3 * G).is_err(), "gap");
        l.check_set_access(base, 2 * G).unwrap();
        l.commit_set_access(base, 2 * G);
        l.check_data(base + 100, 16).unwrap();
        assert!(l.check_release(h).is_err(), "mapped handle");
        assert!(l.check_unmap(base, G).is_err(), "partial unmap");
        assert!(
            l.check_free_reservation(base, 8 * G).is_err(),
            "holds a mapping"
        );
        let w = l.streams.launch(crate::Stream::sim(1), base + G, 8);
        assert_eq!(
            l.check_unmap(base, 2 * G).unwrap_err().code,
            code::ILLEGAL_ADDRESS
        );
        l.streams.complete(crate::Stream::sim(1), Some(w));
        l.check_unmap(base, 2 * G).unwrap();
        l.commit_unmap(base);
        l.check_release(h).unwrap();
        l.commit_release(h);
        l.check_free_reservation(base, 8 * G).unwrap();
        l.commit_free_reservation(base);
        assert!(l.leak_report().is_clean());
    }
}
