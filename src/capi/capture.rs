//! CUDA graph capture on the plain allocation path (issue #12). Graph memory proper comes
//! from `stitch_malloc_graph` (the torch extension's private pools); `stitch_malloc` on a
//! capturing stream is refused instead of corrupting memory.
//!
//! Work queued on a capturing stream is recorded into a graph and runs again on every
//! replay. An allocation on such a stream is refused (`stitch_malloc` returns NULL with
//! [`CAPTURE_UNSUPPORTED`]): handing out memory the pool may give to another tensor would
//! let a replay overwrite that tensor, and the slow path would record and query events on
//! the capturing stream. A free on a capturing stream (a tensor allocated before the
//! capture and dropped during it, by this thread or another) cannot be fenced (no event may
//! be recorded there), so the block is held, still allocated and counted in [`GraphHeld`],
//! until the capture has ended: the next call of that device finds the stream no longer
//! capturing and frees it then on its stream, stream-ordered after everything queued so far
//! (torch's own allocator defers such frees the same way). `stitch_retire_stream` releases
//! the blocks held for the stream it retires.
#![forbid(unsafe_code)]

use crate::Stream;
use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use std::sync::atomic::{AtomicU64, Ordering};

/// The reason an allocation on a capturing stream is refused (the last error).
pub(super) const CAPTURE_UNSUPPORTED: &str =
    "CUDA graph capture is not supported by stitch_malloc (no graph pools on this path: graph \
     memory comes from stitch_malloc_graph, which the torch extension's private pools use)";

/// The blocks of one device freed on a capturing stream, kept allocated until that stream's
/// capture has ended.
#[derive(Default)]
pub(super) struct GraphHeld {
    /// How many blocks `blocks` holds; read without the lock, so that a call with no held
    /// block (the common case) takes no lock here. Equals `blocks.len()` outside the lock.
    count: AtomicU64,
    /// The sum of the usable sizes in `blocks`.
    bytes: AtomicU64,
    /// Held block address -> (its usable bytes, the stream it was freed on).
    blocks: Mutex<FxHashMap<u64, (u64, Stream)>>,
}

impl GraphHeld {
    /// Whether the block at `addr` is held (freed during a capture already).
    pub fn holds(&self, addr: u64) -> bool {
        self.count.load(Ordering::Acquire) != 0 && self.blocks.lock().contains_key(&addr)
    }

    /// Hold the block at `addr` of `bytes` usable bytes, freed on `stream`; false if it was
    /// held already.
    pub fn hold(&self, addr: u64, bytes: u64, stream: Stream) -> bool {
        let mut b = self.blocks.lock();
        if b.insert(addr, (bytes, stream)).is_some() {
            return false;
        }
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Release);
        true
    }

    /// Take out the held blocks that may be freed now: those whose stream `retired` says
    /// yes to, or (unless `retired` alone decides) whose stream `capturing` says is no
    /// longer capturing. Returns (address, stream) of each; the caller frees them.
    pub fn take_ready(
        &self,
        capturing: impl Fn(Stream) -> bool,
        retired: impl Fn(Stream) -> bool,
    ) -> Vec<(u64, Stream)> {
        if self.count.load(Ordering::Acquire) == 0 {
            return Vec::new();
        }
        let mut b = self.blocks.lock();
        let mut ready = Vec::new();
        b.retain(|&addr, &mut (bytes, stream)| {
            if retired(stream) || !capturing(stream) {
                ready.push((addr, stream));
                self.bytes.fetch_sub(bytes, Ordering::Relaxed);
                self.count.fetch_sub(1, Ordering::Release);
                false
            } else {
                true
            }
        });
        ready
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
        let (s1, s2) = (Stream::sim(1), Stream::sim(2));
        assert!(!h.holds(0x1000));
        assert!(h.hold(0x1000, 4096, s1));
        assert!(!h.hold(0x1000, 4096, s1), "held once");
        assert!(h.holds(0x1000) && !h.holds(0x2000));
        assert!(h.hold(0x2000, 100, s2));
        assert_eq!(h.bytes(), 4196);
        // Both streams still capturing: nothing is ready.
        assert!(h.take_ready(|_| true, |_| false).is_empty());
        // Stream 2 retired: its block is ready although the query says capturing.
        assert_eq!(h.take_ready(|_| true, |s| s == s2), vec![(0x2000, s2)]);
        assert_eq!(h.bytes(), 4096);
        // Stream 1's capture ended.
        assert_eq!(h.take_ready(|_| false, |_| false), vec![(0x1000, s1)]);
        assert_eq!(h.bytes(), 0);
        assert!(!h.holds(0x1000));
        assert!(h.take_ready(|_| false, |_| false).is_empty());
    }
}
