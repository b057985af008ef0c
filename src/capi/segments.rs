//! The segment log (issue #12 item 5): every mapping the driver made or removed for one
//! device, for torch's memory history (`segment_map` / `segment_unmap` trace entries, which
//! `memory_viz` draws and `stitch replay` reads as reserved memory). Off until a caller
//! turns it on (`stitch_segment_log`: the torch extension does when history recording
//! starts); then [`Logged`] appends one event per successful `cuMemMap` / `cuMemUnmap` and
//! the caller drains them (`stitch_segment_events`). Bounded: past [`CAP`] undrained events
//! the oldest are dropped and counted.
#![forbid(unsafe_code)]

use crate::driver::{Call, Done, DriverError, Forward};
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

/// Undrained events kept at most.
pub(super) const CAP: usize = 1 << 20;

/// One mapping made (`map`) or removed, at `addr`, of `size` bytes.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) struct SegmentEvent {
    /// True for a map, false for an unmap.
    pub map: bool,
    /// The mapping's address.
    pub addr: u64,
    /// Its size in bytes.
    pub size: u64,
}

/// The log of one device (see the module docs).
#[derive(Default)]
pub(super) struct SegmentLog {
    /// Whether events are recorded; read without the lock on every map and unmap.
    enabled: AtomicBool,
    /// Undrained events, oldest first; at most [`CAP`].
    events: Mutex<VecDeque<SegmentEvent>>,
    /// Events dropped because [`CAP`] were undrained.
    dropped: AtomicU64,
}

impl SegmentLog {
    /// Turn recording on or off; turning it off drops what was not drained.
    pub fn set_enabled(&self, on: bool) {
        self.enabled.store(on, Ordering::Release);
        if !on {
            self.events.lock().clear();
        }
    }

    /// Whether events are being recorded.
    pub fn enabled(&self) -> bool {
        self.enabled.load(Ordering::Acquire)
    }

    /// Append one event (when enabled).
    pub fn push(&self, e: SegmentEvent) {
        if !self.enabled() {
            return;
        }
        let mut q = self.events.lock();
        if q.len() == CAP {
            q.pop_front();
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
        q.push_back(e);
    }

    /// Move up to `max` of the oldest events out.
    pub fn drain(&self, max: usize) -> Vec<SegmentEvent> {
        let mut q = self.events.lock();
        let n = max.min(q.len());
        q.drain(..n).collect()
    }

    /// Events dropped so far because too many were undrained.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}

/// A driver layer that logs every successful map and unmap into a [`SegmentLog`].
pub(super) struct Logged<D> {
    inner: D,
    log: Arc<SegmentLog>,
}

impl<D> Logged<D> {
    /// Wrap `inner`, logging into `log`.
    pub fn new(inner: D, log: Arc<SegmentLog>) -> Self {
        Logged { inner, log }
    }
}

impl<D: crate::driver::Driver> Forward for Logged<D> {
    type Inner = D;
    fn inner(&self) -> &D {
        &self.inner
    }
    fn after(&self, call: &Call, result: Result<Done, &DriverError>, _ns: u64) {
        if result.is_err() || !self.log.enabled() {
            return;
        }
        match *call {
            Call::Map { addr, size, .. } => self.log.push(SegmentEvent {
                map: true,
                addr,
                size,
            }),
            Call::Unmap { addr, size } => self.log.push(SegmentEvent {
                map: false,
                addr,
                size,
            }),
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::SimDriver;
    use crate::{Allocator, Config, Stream};

    const MIB: u64 = 1 << 20;

    #[test]
    fn maps_and_unmaps_are_logged_only_while_enabled() {
        let log = Arc::new(SegmentLog::default());
        let a = Allocator::new(
            Logged::new(SimDriver::with_capacity(1 << 30), log.clone()),
            Config::default(),
        )
        .unwrap();
        let p = a.alloc(8 * MIB, Stream::DEFAULT).unwrap();
        a.free(p, Stream::DEFAULT).unwrap();
        assert!(log.drain(100).is_empty(), "off by default");
        let before = a.stats().mapped.current;
        assert!(before > 0);
        log.set_enabled(true);
        let p = a.alloc(64 * MIB, Stream::DEFAULT).unwrap();
        a.free(p, Stream::DEFAULT).unwrap();
        a.empty_cache().unwrap();
        let ev = log.drain(usize::MAX);
        let mapped: u64 = ev.iter().filter(|e| e.map).map(|e| e.size).sum();
        let unmapped: u64 = ev.iter().filter(|e| !e.map).map(|e| e.size).sum();
        assert!(mapped >= 56 * MIB, "{ev:?}");
        // empty_cache unmapped everything, also what was mapped before the log was on: the
        // log balances against the mapped bytes the allocator reports.
        assert_eq!(a.stats().mapped.current, 0);
        assert_eq!(unmapped, mapped + before, "{ev:?}");
        assert_eq!(a.stats().mapped.current, 0);
        log.set_enabled(false);
        let p = a.alloc(8 * MIB, Stream::DEFAULT).unwrap();
        a.free(p, Stream::DEFAULT).unwrap();
        assert!(log.drain(100).is_empty());
    }

    #[test]
    fn drain_takes_the_oldest_first_and_the_log_is_bounded() {
        let log = SegmentLog::default();
        log.set_enabled(true);
        for i in 0..(CAP as u64 + 5) {
            log.push(SegmentEvent {
                map: true,
                addr: i,
                size: 1,
            });
        }
        assert_eq!(log.dropped(), 5);
        let first = log.drain(2);
        assert_eq!((first[0].addr, first[1].addr), (5, 6));
        assert_eq!(log.drain(usize::MAX).len(), CAP - 2);
    }
}
