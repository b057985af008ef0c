//! CUDA graph capture (issue #12): this library has no private graph pools yet, so it
//! refuses to take part in a capture instead of corrupting memory.
//!
//! Work queued on a capturing stream is recorded into a graph and runs again on every
//! replay. An allocation on such a stream is refused (`stitch_malloc` returns NULL with
//! [`CAPTURE_UNSUPPORTED`]): handing out memory the pool may give to another tensor would
//! let a replay overwrite that tensor, and the slow path would record and query events on
//! the capturing stream. A free on a capturing stream does not return the block to the
//! pool: the graph may use it on every replay, so it stays allocated, counted in
//! [`GraphHeld`], until the process ends.
#![forbid(unsafe_code)]

use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use std::sync::atomic::{AtomicU64, Ordering};

/// The reason an allocation on a capturing stream is refused (the last error).
pub(super) const CAPTURE_UNSUPPORTED: &str =
    "CUDA graph capture is not supported by stitch-alloc yet (no private graph pools)";

/// The blocks of one device freed during a graph capture and kept out of the pool for the
/// life of the process (they stay live allocations of the allocator).
#[derive(Default)]
pub(super) struct GraphHeld {
    /// How many blocks `blocks` holds; read without the lock, so that a free with no held
    /// block (the common case) takes no lock here.
    count: AtomicU64,
    /// The sum of the usable sizes in `blocks`.
    bytes: AtomicU64,
    /// Held block address -> its usable bytes. Only grows.
    blocks: Mutex<FxHashMap<u64, u64>>,
}

impl GraphHeld {
    /// Whether the block at `addr` is held (freed during a capture already).
    pub fn holds(&self, addr: u64) -> bool {
        self.count.load(Ordering::Acquire) != 0 && self.blocks.lock().contains_key(&addr)
    }

    /// Hold the block at `addr` of `bytes` usable bytes; false if it was held already.
    pub fn hold(&self, addr: u64, bytes: u64) -> bool {
        let mut b = self.blocks.lock();
        if b.insert(addr, bytes).is_some() {
            return false;
        }
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Release);
        true
    }

    /// The bytes held.
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn held_blocks_are_counted_once() {
        let h = GraphHeld::default();
        assert!(!h.holds(0x1000));
        assert!(h.hold(0x1000, 4096));
        assert!(!h.hold(0x1000, 4096), "held once");
        assert!(h.holds(0x1000) && !h.holds(0x2000));
        assert!(h.hold(0x2000, 100));
        assert_eq!(h.bytes(), 4196);
    }
}
