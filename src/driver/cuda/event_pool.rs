//! The bookkeeping of `CudaDriver`'s events: which events are handed out, and which
//! destroyed ones are kept for reuse (creating a CUDA event costs a driver call; the
//! allocator records one per fenced free).
//!
//! Pure: the pool holds raw `CUevent` values and decides; `CudaDriver` makes the CUDA calls.
#![forbid(unsafe_code)]

use rustc_hash::FxHashSet;

/// What to do with an event given back by `destroy_event`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) enum Retired {
    /// Kept for reuse: no CUDA call.
    Pooled,
    /// The pool is full: destroy it (`cuEventDestroy`).
    Destroy,
}

/// Events handed out and events kept for reuse.
#[derive(Debug, Default)]
pub(super) struct EventPool {
    /// Events returned by `record_event` and not yet given to `destroy_event`. Disjoint from
    /// `spare`.
    live: FxHashSet<u64>,
    /// Destroyed events kept for reuse: each is a live CUDA event of the driver's context,
    /// appears once, and is not in `live`. At most `max` of them.
    spare: Vec<u64>,
    /// The most spare events kept.
    max: usize,
}

impl EventPool {
    /// A pool keeping at most `max` spare events.
    pub(super) fn new(max: usize) -> Self {
        EventPool {
            max,
            ..Default::default()
        }
    }

    /// A spare event to reuse, if any (the caller then records it and calls
    /// [`EventPool::hand_out`]).
    pub(super) fn take_spare(&mut self) -> Option<u64> {
        self.spare.pop()
    }

    /// Note that `ev` is handed out to a caller.
    pub(super) fn hand_out(&mut self, ev: u64) {
        debug_assert!(!self.spare.contains(&ev), "a spare event handed out twice");
        self.live.insert(ev);
    }

    /// Whether `ev` is handed out and not yet destroyed.
    pub(super) fn is_live(&self, ev: u64) -> bool {
        self.live.contains(&ev)
    }

    /// Events handed out and not yet destroyed.
    pub(super) fn live_count(&self) -> usize {
        self.live.len()
    }

    /// Take back `ev` from `destroy_event`: `None` when it is not handed out (never was, or
    /// already destroyed: the caller must then make no CUDA call with it).
    pub(super) fn retire(&mut self, ev: u64) -> Option<Retired> {
        if !self.live.remove(&ev) {
            return None;
        }
        if self.spare.len() < self.max {
            self.spare.push(ev);
            Some(Retired::Pooled)
        } else {
            Some(Retired::Destroy)
        }
    }

    /// Every spare event, leaving none (to destroy them at drop).
    pub(super) fn drain_spare(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.spare)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_double_destroy_is_refused_and_never_pools_an_event_twice() {
        let mut p = EventPool::new(4);
        p.hand_out(7);
        assert_eq!(p.retire(7), Some(Retired::Pooled));
        // The second destroy of the same event: refused, the pool unchanged.
        assert_eq!(p.retire(7), None);
        assert!(!p.is_live(7));
        assert_eq!(p.take_spare(), Some(7));
        assert_eq!(p.take_spare(), None, "the event was pooled once");
        p.hand_out(7);
        assert!(p.is_live(7));
        assert_eq!(p.live_count(), 1);
    }

    #[test]
    fn unknown_events_are_refused_and_a_full_pool_destroys() {
        let mut p = EventPool::new(1);
        assert_eq!(p.retire(9), None, "never handed out");
        p.hand_out(1);
        p.hand_out(2);
        assert_eq!(p.retire(1), Some(Retired::Pooled));
        assert_eq!(p.retire(2), Some(Retired::Destroy));
        assert_eq!(p.retire(2), None, "destroyed: refused");
        assert_eq!(p.live_count(), 0);
        assert_eq!(p.drain_spare(), vec![1]);
        assert_eq!(p.take_spare(), None);
    }
}
