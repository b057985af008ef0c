//! Ghosts: old mappings of handles that stitching moved while device work queued on the
//! freeing stream could still use them. The handle is mapped at its new address at once, and
//! its old mapping stays until an event recorded at the stitch completes, so the CPU never
//! waits for the device to stitch.
#![forbid(unsafe_code)]

use super::handles::Handles;
use super::va::VaSpace;
use super::Engine;
use crate::driver::{Driver, DriverOp, EventId, Stream};
use crate::error::Result;

/// An old mapping of a handle. Its address range stays taken (not free in the address space,
/// not in `mapped`) until it is unmapped.
#[derive(Debug)]
pub(crate) struct Ghost {
    pub(crate) addr: u64,
    /// The handle's size: a ghost maps its handle whole.
    pub(crate) size: u64,
    /// The handle; never its current address; counted in its record's `ghosts`.
    pub(crate) handle: u32,
    /// Unmapped once this completes; `None`: no work can touch it, unmap at the next chance.
    pub(crate) event: Option<EventId>,
    /// The stream the event was recorded on (events of one stream complete in order).
    pub(crate) stream: Stream,
}

/// Ghost unmaps one slow path makes at most when it does not wait (or a quarter of the
/// ghosts, if that is more, so that a backlog drains geometrically): the old mappings of one
/// large stitch are not all removed inside one later, unrelated request. Measured on the zoo
/// (design/zoo.md, 2026-12-01): a 1 MiB request on bert-encode unmapped 794 ghosts, 15.3 ms
/// of modeled driver time; with this bound the slowest request of each zoo workload fell
/// (bert-encode 15.3 -> 3.8 ms, lora 19.1 -> 11.9, llm-train-l 6.2 -> 4.0) while the
/// geometric mean of peak reserved / peak live moved from 1.0173 to 1.0177.
pub(crate) const UNMAPS_PER_POLL: usize = 64;

/// Every ghost, in the order they were made (`poll_ghosts` relies on it).
#[derive(Debug, Default)]
pub(crate) struct Ghosts {
    list: Vec<Ghost>,
}

impl Ghosts {
    pub(crate) fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// Bytes of address space the ghosts hold.
    pub(crate) fn bytes(&self) -> u64 {
        self.list.iter().map(|g| g.size).sum()
    }

    /// The distinct events still to complete, each once, sorted.
    pub(crate) fn events(&self) -> Vec<EventId> {
        let mut evs: Vec<EventId> = self.list.iter().filter_map(|g| g.event).collect();
        evs.sort_by_key(|e| e.raw());
        evs.dedup();
        evs
    }

    /// Check each ghost against its handle, the mappings and the address space; and each
    /// handle's ghost count. Returns the ghosts' bytes.
    pub(crate) fn validate(
        &self,
        handles: &Handles,
        va: &VaSpace,
    ) -> std::result::Result<u64, String> {
        let mut counts = vec![0u32; handles.slots()];
        for g in &self.list {
            let Some(h) = handles.get(g.handle) else {
                return Err(format!("ghost at {:#x} of a released handle", g.addr));
            };
            if h.size != g.size || h.at == Some(g.addr) {
                return Err(format!("ghost at {:#x} disagrees with its handle", g.addr));
            }
            if !va.is_reserved(g.addr, g.size) || va.overlaps_free(g.addr, g.size) {
                return Err(format!(
                    "ghost {:#x} is outside reserved, used address space",
                    g.addr
                ));
            }
            let next_map = handles.mapped.range(g.addr..).next().map(|(&a, _)| a);
            let prev_map = handles.mapped.range(..g.addr).next_back();
            if next_map.is_some_and(|a| a < g.addr + g.size)
                || prev_map.is_some_and(|(&a, &h)| a + handles.size(h) > g.addr)
            {
                return Err(format!("ghost {:#x} overlaps a mapping", g.addr));
            }
            counts[g.handle as usize] += 1;
        }
        for (id, h) in handles.iter() {
            if h.ghosts != counts[id as usize] {
                return Err(format!(
                    "handle {id} counts {} ghosts, has {}",
                    h.ghosts, counts[id as usize]
                ));
            }
        }
        Ok(self.bytes())
    }
}

impl Engine {
    /// Leave handle `handle`'s mapping at `addr` as a ghost, unmapped after `event`.
    pub(super) fn add_ghost(
        &mut self,
        addr: u64,
        handle: u32,
        event: Option<EventId>,
        stream: Stream,
    ) {
        let rec = self.handles.record_mut(handle);
        rec.ghosts += 1;
        let size = rec.size;
        self.ghosts.list.push(Ghost {
            addr,
            size,
            handle,
            event,
            stream,
        });
    }

    /// How many ghosts an allocation's slow path unmaps at most: [`UNMAPS_PER_POLL`] or a
    /// quarter of them, whichever is more.
    pub(super) fn ghost_unmap_budget(&self) -> usize {
        UNMAPS_PER_POLL.max(self.ghosts.list.len() / 4)
    }

    /// Unmap the ghosts whose work has completed (all of them, waiting, with `wait`), at
    /// most `budget` of them (in the order they were made).
    /// Events of one stream complete in the order they were recorded (the ghosts' order),
    /// so after the first one not done, that stream's later ones are not asked about.
    pub(super) fn poll_ghosts<D: Driver + ?Sized>(
        &mut self,
        d: &D,
        wait: bool,
        mut budget: usize,
    ) -> Result<()> {
        let mut events: Vec<(Option<EventId>, Stream)> = Vec::new();
        for g in &self.ghosts.list {
            if !events.iter().any(|&(e, _)| e == g.event) {
                events.push((g.event, g.stream));
            }
        }
        let mut behind: Vec<Stream> = Vec::new();
        for (ev, stream) in events {
            if budget == 0 {
                break;
            }
            if let Some(e) = ev {
                if behind.contains(&stream) {
                    continue;
                }
                match self.event_done(d, e, wait) {
                    Ok(true) => {}
                    Ok(false) => {
                        behind.push(stream);
                        continue;
                    }
                    Err(err) => {
                        // Contained to this stream: its old mappings stay until a later try.
                        tracing::warn!(%err, "querying the event of old mappings failed");
                        behind.push(stream);
                        continue;
                    }
                }
            }
            let mut j = 0;
            while j < self.ghosts.list.len() {
                if budget == 0 {
                    break;
                }
                if self.ghosts.list[j].event != ev {
                    j += 1;
                    continue;
                }
                let (addr, size, handle) = {
                    let g = &self.ghosts.list[j];
                    (g.addr, g.size, g.handle)
                };
                if self
                    .driver_call(DriverOp::Unmap, || d.unmap(addr, size))
                    .is_err()
                {
                    tracing::warn!(addr, size, "unmapping an old mapping failed; retried later");
                    j += 1;
                    continue;
                }
                budget -= 1;
                self.ghosts.list.remove(j); // keeps the record order this relies on
                self.handles.record_mut(handle).ghosts -= 1;
                self.va.free(addr, size);
            }
            // The event goes with its last old mapping (whether the budget ran out before,
            // on or after it; a failed unmap keeps its mapping listed, and so the event).
            let left = self.ghosts.list.iter().any(|g| g.event == ev);
            if let (Some(e), false) = (ev, left) {
                self.destroy_event(d, e);
            }
        }
        Ok(())
    }
}
