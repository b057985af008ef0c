//! Giving memory back: `empty_cache` (every free handle) and `teardown` (everything).
#![forbid(unsafe_code)]

use super::arena::State;
use super::policy::stitch_candidates;
use super::Engine;
use crate::driver::{Driver, DriverOp, Stream};
use crate::error::{AllocError, Result};

impl Engine {
    /// Release every free handle (and retry quarantined ones). Returns bytes released.
    pub(crate) fn empty_cache<D: Driver + ?Sized>(&mut self, d: &D) -> Result<u64> {
        if self.shut_down {
            return Err(AllocError::ShutDown);
        }
        self.poll(d, false)?;
        self.retry_quarantine(d);
        // Every free handle goes back, the loop region's too: the mode ends.
        self.leave_region(super::region::Fit::Elsewhere);
        let cands = stitch_candidates(&self.arena, &self.handles, None, false);
        let released = self.release_candidates(d, cands)?;
        tracing::debug!(released, "empty_cache");
        Ok(released)
    }

    /// Wait for the work queued on live allocations (on the stream each was allocated on
    /// and on those `record_stream` added) before teardown unmaps them. A stream that cannot
    /// be fenced is logged; its memory is unmapped anyway (the allocator is going away).
    fn wait_for_live_work<D: Driver + ?Sized>(&mut self, d: &D) {
        let mut streams: Vec<Stream> = self
            .arena
            .live
            .values()
            .filter_map(|&i| match self.arena.blocks[i as usize].state {
                State::Live { stream, .. } => Some(stream),
                _ => None,
            })
            .collect();
        streams.extend(self.fences.extra_streams.values().flatten().copied());
        streams.sort();
        streams.dedup();
        for s in streams {
            match self.record_event(d, s) {
                Ok(e) => {
                    match self.driver_call(DriverOp::WaitEvent, || d.wait_event(e)) {
                        Ok(()) => self.stats.event_waits += 1,
                        Err(err) => tracing::error!(
                            %err,
                            stream = s.raw(),
                            "waiting for work on live memory failed during teardown"
                        ),
                    }
                    self.destroy_event(d, e);
                }
                Err(err) => tracing::error!(
                    %err,
                    stream = s.raw(),
                    "cannot wait for work on live memory during teardown"
                ),
            }
        }
    }

    /// Give everything back to the driver. Returns (leaked allocations, their bytes).
    pub(crate) fn teardown<D: Driver + ?Sized>(&mut self, d: &D) -> (u64, u64) {
        let leaked = (self.arena.live.len() as u64, self.stats.requested.current);
        if let Err(e) = self.poll(d, true) {
            tracing::error!(%e, "waiting for outstanding frees failed during teardown");
        }
        self.wait_for_live_work(d);
        let unfenced = self
            .arena
            .unfenced_bytes(self.fences.pending.iter().map(|p| p.block));
        if unfenced > 0 {
            tracing::error!(
                bytes = unfenced,
                "teardown unmaps memory freed on streams that could not be fenced"
            );
        }
        for k in 1..self.fences.owners.len() {
            if let Some((e, _)) = self.fences.owners[k].fence.take() {
                self.destroy_event(d, e);
            }
        }
        for p in std::mem::take(&mut self.fences.pending) {
            for e in p.events {
                self.destroy_event(d, e);
            }
        }
        self.retry_undestroyed_events(d);
        self.retry_quarantine(d);
        if !self.ghosts.is_empty() {
            // Unmaps that failed in the poll above: one more try, then give up on them.
            if let Err(e) = self.poll_ghosts(d, true, usize::MAX) {
                tracing::error!(%e, "unmapping old mappings failed during teardown");
            }
            for e in self.ghosts.events() {
                self.destroy_event(d, e);
            }
        }
        for (addr, id) in std::mem::take(&mut self.handles.mapped) {
            let size = self.handles.size(id);
            match self.driver_call(DriverOp::Unmap, || d.unmap(addr, size)) {
                Ok(()) => {
                    self.handles.record_mut(id).at = None;
                    self.stats.mapped.sub(size);
                    self.handles.unmapped.push(id);
                }
                Err(e) => tracing::error!(%e, addr, "unmap failed during teardown"),
            }
        }
        for id in std::mem::take(&mut self.handles.unmapped) {
            if let Err(e) = self.release_handle(d, id) {
                tracing::error!(%e, "release failed during teardown");
            }
        }
        for (base, size) in self.va.take_reservations() {
            if let Err(e) =
                self.driver_call(DriverOp::FreeReservation, || d.free_reservation(base, size))
            {
                tracing::error!(%e, base, "freeing a reservation failed during teardown");
            }
        }
        self.arena.clear();
        self.fences.clear_owners();
        self.fences.extra_streams.clear();
        // Leaked allocations are gone with their memory.
        let s = &mut self.stats;
        s.requested.current = 0;
        s.allocated.current = 0;
        s.live_allocations.current = 0;
        s.pending_free = 0;
        self.shut_down = true;
        leaked
    }
}
