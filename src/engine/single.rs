//! Allocations backed by one physical handle (issue #14): for buffers that NCCL user-buffer
//! registration (`ncclCommRegister`, `register_mem_pool`) or RDMA pinning (`ibv_reg_mr`)
//! will see, which need one physical allocation behind the whole range; a stitched span,
//! or any span of several handles, is not (anchors.md section 8).
//!
//! The request gets a handle of its own, created for it (its size rounded up to the
//! granularity, any size up to the capacity, `max_handle` does not apply) and mapped alone
//! in fresh address space. Live allocations never move, so the buffer stays on that one
//! handle for its whole life. When the capacity leaves no room for the new handle, clean
//! free handles are released first (as a plain caching allocator does on a miss). Once
//! freed, the handle is an ordinary free handle of the pool (reused, stitched or released
//! like any other).
#![forbid(unsafe_code)]

use super::arena::{round_up, Pool, State};
use super::fences::OwnerId;
use super::policy::{choose, stitch_candidates};
use super::Engine;
use crate::driver::{code, Driver, DriverOp, Stream};
use crate::error::{AllocError, Result};

impl Engine {
    /// Allocate `size` bytes for use on `stream` inside one physical handle created for them
    /// (see the module docs). Counts as a slow-path allocation.
    pub(crate) fn alloc_one_handle<D: Driver + ?Sized>(
        &mut self,
        d: &D,
        size: u64,
        stream: Stream,
    ) -> Result<u64> {
        let (rsize, _) = self.admit(size)?;
        self.stats.slow_allocs += 1;
        let bytes = round_up(size, self.cfg.granularity);
        if bytes > self.headroom() {
            // Room under the capacity: fenced frees may have become clean; then give back
            // clean free handles, the tightest cover of the shortfall first.
            self.poll(d, false)?;
            let short = bytes - self.headroom();
            let cands = stitch_candidates(&self.arena, &self.handles, None, false);
            let free: u64 = cands.iter().map(|c| c.size).sum();
            if free >= short {
                self.release_candidates(d, choose(cands, short))?;
            }
        }
        if bytes > self.headroom() {
            return Err(self.one_handle_oom(size, rsize, false));
        }
        let id = match self.driver_call(DriverOp::Create, || d.create(bytes)) {
            Ok(h) => self.add_handle(h, bytes),
            Err(e) if e.code == code::OUT_OF_MEMORY => {
                return Err(self.one_handle_oom(size, rsize, true));
            }
            Err(e) => return Err(e.into()),
        };
        let base = match self.va_alloc(d, bytes) {
            Ok(b) => b,
            Err(e) => {
                let _ = self.release_handle(d, id);
                return Err(e);
            }
        };
        let h = self.handles.record(id).handle;
        let mapped = self
            .driver_call(DriverOp::Map, || d.map(base, bytes, h))
            .map_err(|e| (e, false))
            .and_then(|()| {
                self.driver_call(DriverOp::SetAccess, || d.set_access(base, bytes))
                    .map_err(|e| (e, true))
            });
        if let Err((e, was_mapped)) = mapped {
            self.undo_one(d, id, base, bytes, was_mapped);
            return Err(e.into());
        }
        self.handles.mapped.insert(base, id);
        self.handles.record_mut(id).at = Some(base);
        self.stats.mapped.add(bytes);
        let i = self.arena.new_run(
            base,
            bytes,
            Pool::Large,
            State::Free {
                owner: OwnerId::CLEAN,
                seq: 0,
            },
        );
        Ok(self.take(i, rsize, size, stream))
    }

    /// Undo a one-handle build that failed after the create: unmap it if mapped (a failed
    /// unmap quarantines the handle, retried later) and give back the address space, then
    /// release the handle (a failed release keeps it as an unmapped free handle). Nothing
    /// leaks.
    fn undo_one<D: Driver + ?Sized>(
        &mut self,
        d: &D,
        id: u32,
        base: u64,
        bytes: u64,
        mapped: bool,
    ) {
        if mapped {
            self.rollback_span(d, base, bytes, &[(base, id)], &[]);
            if self.handles.quarantined.contains(&id) {
                return;
            }
        } else {
            self.va.free(base, bytes);
        }
        let _ = self.release_handle(d, id);
    }

    /// The out-of-memory error of a one-handle request.
    #[cold]
    fn one_handle_oom(&mut self, size: u64, rsize: u64, driver_oom: bool) -> AllocError {
        self.stats.ooms += 1;
        let report = self.oom_report(size, rsize, driver_oom);
        tracing::warn!(%report, "one-handle allocation failed: out of memory");
        AllocError::OutOfMemory(Box::new(report))
    }
}
