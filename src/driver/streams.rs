//! A model of streams, queued work and events for the CPU backends.
//!
//! Tests "launch" simulated kernels that touch an address range on a stream; the work stays
//! in flight until the test completes it (or someone waits on a later event). An event
//! recorded on a stream completes once every piece of work launched on that stream before it
//! has completed, exactly as with CUDA events. The backends refuse to unmap a range that
//! in-flight work touches: on a GPU that would be a use-after-free.
#![forbid(unsafe_code)]

use super::{EventId, Stream};
use std::collections::{HashMap, VecDeque};

/// Identifies one piece of simulated work launched with `launch`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct WorkId(pub u64);

#[derive(Debug)]
struct Work {
    /// Position in its stream: the stream's `enqueued` count right after the launch.
    seq: u64,
    id: u64,
    addr: u64,
    len: u64,
}

#[derive(Debug, Default)]
struct StreamState {
    /// Work items launched on this stream so far.
    enqueued: u64,
    /// Work items completed so far; always `<= enqueued`. Work completes in launch order.
    completed: u64,
    /// The in-flight work, oldest first; its `seq`s are `completed+1 ..= enqueued`.
    work: VecDeque<Work>,
}

/// Streams, their in-flight work and the outstanding events.
#[derive(Debug, Default)]
pub(crate) struct StreamModel {
    streams: HashMap<Stream, StreamState>,
    /// Live events: id -> (stream, the stream's `enqueued` when recorded).
    events: HashMap<u64, (Stream, u64)>,
    next_event: u64,
    next_work: u64,
}

impl StreamModel {
    /// Queue simulated work touching `[addr, addr+len)` on `stream`.
    pub(crate) fn launch(&mut self, stream: Stream, addr: u64, len: u64) -> WorkId {
        self.next_work += 1;
        let id = self.next_work;
        let s = self.streams.entry(stream).or_default();
        s.enqueued += 1;
        let seq = s.enqueued;
        s.work.push_back(Work { seq, id, addr, len });
        WorkId(id)
    }

    /// Record an event after the work queued on `stream` so far.
    pub(crate) fn record(&mut self, stream: Stream) -> EventId {
        self.next_event += 1;
        let seq = self.streams.get(&stream).map_or(0, |s| s.enqueued);
        self.events.insert(self.next_event, (stream, seq));
        EventId::new(self.next_event)
    }

    /// Whether `ev` has completed; `None` for an unknown event.
    pub(crate) fn query(&self, ev: EventId) -> Option<bool> {
        let &(stream, seq) = self.events.get(&ev.0)?;
        Some(self.streams.get(&stream).is_none_or(|s| s.completed >= seq))
    }

    /// Wait for `ev`: the simulated device runs the stream up to the event. `None` if unknown.
    pub(crate) fn wait(&mut self, ev: EventId) -> Option<()> {
        let &(stream, seq) = self.events.get(&ev.0)?;
        self.complete_until(stream, seq);
        Some(())
    }

    /// Forget an event; `None` if unknown.
    pub(crate) fn destroy(&mut self, ev: EventId) -> Option<()> {
        self.events.remove(&ev.0).map(|_| ())
    }

    /// Number of events recorded and not destroyed.
    pub(crate) fn live_events(&self) -> usize {
        self.events.len()
    }

    fn complete_until(&mut self, stream: Stream, seq: u64) {
        if let Some(s) = self.streams.get_mut(&stream) {
            while s.completed < seq {
                let w = s.work.pop_front().expect("work queue matches counters");
                debug_assert_eq!(w.seq, s.completed + 1);
                s.completed = w.seq;
            }
        }
    }

    /// Complete the work on `stream` up to and including `upto` (all of it when `None`).
    pub(crate) fn complete(&mut self, stream: Stream, upto: Option<WorkId>) {
        let Some(s) = self.streams.get(&stream) else {
            return;
        };
        let seq = match upto {
            None => s.enqueued,
            Some(w) => match s.work.iter().find(|x| x.id == w.0) {
                Some(x) => x.seq,
                None => return,
            },
        };
        self.complete_until(stream, seq);
    }

    /// Complete every stream's work.
    pub(crate) fn complete_all(&mut self) {
        for s in self.streams.values_mut() {
            s.work.clear();
            s.completed = s.enqueued;
        }
    }

    /// In-flight work overlapping `[addr, addr+len)`, if any.
    pub(crate) fn in_flight(&self, addr: u64, len: u64) -> Option<(Stream, WorkId)> {
        self.streams.iter().find_map(|(&st, s)| {
            s.work
                .iter()
                .find(|w| w.addr < addr + len && addr < w.addr + w.len)
                .map(|w| (st, WorkId(w.id)))
        })
    }

    /// Whether work `w` has completed (unknown ids count as completed).
    pub(crate) fn is_done(&self, w: WorkId) -> bool {
        !self
            .streams
            .values()
            .any(|s| s.work.iter().any(|x| x.id == w.0))
    }

    /// Number of work items still in flight on all streams.
    pub(crate) fn in_flight_count(&self) -> usize {
        self.streams.values().map(|s| s.work.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_completes_after_earlier_work_only() {
        let mut m = StreamModel::default();
        let s = Stream::sim(7);
        let w1 = m.launch(s, 0, 10);
        let e1 = m.record(s);
        let _w2 = m.launch(s, 100, 10);
        let e2 = m.record(s);
        assert_eq!(m.query(e1), Some(false));
        m.complete(s, Some(w1));
        assert_eq!(m.query(e1), Some(true));
        assert_eq!(m.query(e2), Some(false));
        assert!(m.in_flight(105, 1).is_some());
        assert!(m.in_flight(0, 10).is_none());
        m.wait(e2).unwrap();
        assert_eq!(m.query(e2), Some(true));
        assert_eq!(m.in_flight_count(), 0);
        m.destroy(e1).unwrap();
        assert!(m.query(e1).is_none());
        assert_eq!(m.live_events(), 1);
    }

    #[test]
    fn event_on_idle_stream_is_complete() {
        let mut m = StreamModel::default();
        let e = m.record(Stream::sim(3));
        assert_eq!(m.query(e), Some(true));
        let other = m.launch(Stream::sim(4), 0, 1);
        assert_eq!(
            m.query(e),
            Some(true),
            "work on another stream does not delay it"
        );
        m.complete_all();
        assert!(m.in_flight(0, 1).is_none());
        let _ = other;
    }
}
