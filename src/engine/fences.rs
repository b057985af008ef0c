//! Stream fences: who may use a free block, and when it becomes usable by everyone.
//!
//! A block freed on one stream is "dirty": work queued on that stream may still use it, so
//! only that stream may reuse it. Fences are recorded lazily: on a slow path, one event per
//! stream with dirty blocks covers every free made on it so far; once it completes those
//! blocks become clean (owner [`OwnerId::CLEAN`]). A block used on several streams
//! (`record_stream`) is fenced at its free with one event per stream and waits, pending,
//! until all have completed.
#![forbid(unsafe_code)]

use super::arena::{Block, State};
use super::Engine;
use crate::driver::{Driver, DriverOp, EventId, Stream};
use crate::error::Result;
use rustc_hash::FxHashMap;

/// The owner of a free block: an index into [`Fences::owners`] (and into the arena's bins).
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct OwnerId(pub(crate) u16);

impl OwnerId {
    /// The clean pool: usable by every stream and by stitching.
    pub(crate) const CLEAN: OwnerId = OwnerId(0);

    /// The index into the owners table and the arena's bins.
    #[inline]
    pub(crate) fn index(self) -> usize {
        self.0 as usize
    }

    /// Whether this is [`OwnerId::CLEAN`].
    #[inline]
    pub(crate) fn is_clean(self) -> bool {
        self == Self::CLEAN
    }
}

/// One stream that has freed memory, and its fence.
#[derive(Debug)]
pub(crate) struct Owner {
    /// The stream whose frees this owner holds (unused for the clean owner).
    pub(crate) stream: Stream,
    /// Frees counted on this stream so far; a free block records the count at its free
    /// (`State::Free::seq`).
    pub(crate) free_seq: u64,
    /// An event recorded on the stream, covering frees with `seq <= covered`; `covered <=
    /// free_seq`. Always `None` for the clean owner.
    pub(crate) fence: Option<(EventId, u64)>,
}

/// A free of a block used on several streams, waiting for one event per stream.
#[derive(Debug)]
pub(crate) struct PendingFree {
    /// The block, in state `Pending`; each pending block is in exactly one `PendingFree`.
    pub(crate) block: u32,
    /// Events not yet destroyed; the block is clean once all have completed.
    pub(crate) events: Vec<EventId>,
}

/// Stream owners, pending multi-stream frees and events whose destroy must be retried.
#[derive(Debug)]
pub(crate) struct Fences {
    /// `owners[0]` is the clean owner ([`OwnerId::CLEAN`]); the others are streams, one
    /// owner per stream, in order of first free. Never shrinks; as long as the arena's bins.
    pub(crate) owners: Vec<Owner>,
    /// Multi-stream frees, in no particular order.
    pub(crate) pending: Vec<PendingFree>,
    /// Completed events whose destroy failed; retried on later slow paths and at teardown,
    /// so no event leaks.
    pub(crate) undestroyed_events: Vec<EventId>,
    /// Streams other than the allocating one that used a live block (`record_stream`),
    /// by block id; only live blocks have an entry.
    pub(crate) extra_streams: FxHashMap<u32, Vec<Stream>>,
}

impl Fences {
    pub(crate) fn new() -> Self {
        Fences {
            owners: vec![Owner {
                stream: Stream::sim(u64::MAX),
                free_seq: 0,
                fence: None,
            }],
            pending: Vec::new(),
            undestroyed_events: Vec::new(),
            extra_streams: FxHashMap::default(),
        }
    }

    /// Whether any stream has ever freed memory (otherwise only the clean owner exists).
    #[inline]
    pub(crate) fn has_streams(&self) -> bool {
        self.owners.len() > 1
    }

    /// The owner holding `stream`'s frees, if it ever freed anything.
    pub(crate) fn owner_index(&self, stream: Stream) -> Option<OwnerId> {
        self.owners[1..]
            .iter()
            .position(|o| o.stream == stream)
            .map(|i| OwnerId(i as u16 + 1))
    }

    pub(crate) fn owner(&self, k: OwnerId) -> &Owner {
        &self.owners[k.index()]
    }

    pub(crate) fn owner_mut(&mut self, k: OwnerId) -> &mut Owner {
        &mut self.owners[k.index()]
    }

    /// Check the fences' own invariants against the arena's block states.
    pub(crate) fn validate(
        &self,
        blocks: &[Block],
        bins: usize,
    ) -> std::result::Result<(), String> {
        if bins != self.owners.len() {
            return Err(format!(
                "{} owners but {bins} sets of free lists",
                self.owners.len()
            ));
        }
        if self.owners[0].fence.is_some() {
            return Err("the clean owner has a fence".into());
        }
        for (k, o) in self.owners.iter().enumerate() {
            if let Some((_, covered)) = o.fence {
                if covered > o.free_seq {
                    return Err(format!("owner {k}'s fence covers frees not yet made"));
                }
            }
        }
        for p in &self.pending {
            if blocks.get(p.block as usize).map(|b| b.state) != Some(State::Pending) {
                return Err(format!(
                    "pending free of block {} that is not pending",
                    p.block
                ));
            }
        }
        for (i, b) in blocks.iter().enumerate() {
            if b.state == State::Pending && !self.pending.iter().any(|p| p.block == i as u32) {
                return Err(format!("pending block {i} is not in the pending list"));
            }
        }
        for &i in self.extra_streams.keys() {
            if !matches!(
                blocks.get(i as usize).map(|b| b.state),
                Some(State::Live { .. })
            ) {
                return Err(format!("block {i} has extra streams but is not live"));
            }
        }
        Ok(())
    }
}

impl Engine {
    /// The owner for frees on `stream`, created (with its free lists) at its first free.
    pub(super) fn owner_for(&mut self, stream: Stream) -> OwnerId {
        if let Some(o) = self.fences.owner_index(stream) {
            return o;
        }
        self.fences.owners.push(Owner {
            stream,
            free_seq: 0,
            fence: None,
        });
        self.arena.add_owner();
        OwnerId(self.fences.owners.len() as u16 - 1)
    }

    /// Destroy an event; if the driver refuses, keep it to retry later (never leak it).
    pub(super) fn destroy_event<D: Driver + ?Sized>(&mut self, d: &D, e: EventId) {
        if let Err(err) = self.driver_call(DriverOp::DestroyEvent, || d.destroy_event(e)) {
            tracing::warn!(%err, "could not destroy an event; will retry");
            self.fences.undestroyed_events.push(e);
        }
    }

    /// Retry destroying events whose destroy failed before.
    pub(super) fn retry_undestroyed_events<D: Driver + ?Sized>(&mut self, d: &D) {
        for e in std::mem::take(&mut self.fences.undestroyed_events) {
            self.destroy_event(d, e);
        }
    }

    /// Fence streams with unfenced frees, and make clean whatever has completed. With
    /// `wait`, block until every free so far is clean.
    pub(super) fn poll<D: Driver + ?Sized>(&mut self, d: &D, wait: bool) -> Result<()> {
        if !self.fences.undestroyed_events.is_empty() {
            self.retry_undestroyed_events(d);
        }
        if !self.handles.quarantined.is_empty() {
            self.retry_quarantine(d);
        }
        for k in 1..self.fences.owners.len() {
            self.poll_owner(d, OwnerId(k as u16), wait)?;
        }
        if !self.ghosts.is_empty() {
            self.poll_ghosts(d, wait)?;
        }
        self.poll_pending(d, wait)
    }

    /// Fence stream owner `k`'s frees and make clean what has completed (see `poll`).
    pub(super) fn poll_owner<D: Driver + ?Sized>(
        &mut self,
        d: &D,
        k: OwnerId,
        wait: bool,
    ) -> Result<()> {
        loop {
            let dirty = self.arena.bins[k.index()].iter().any(|b| b.count > 0);
            if self.fences.owner(k).fence.is_none() {
                if !dirty {
                    break;
                }
                let s = self.fences.owner(k).stream;
                let e = self.driver_call(DriverOp::RecordEvent, || d.record_event(s))?;
                let covered = self.fences.owner(k).free_seq;
                self.fences.owner_mut(k).fence = Some((e, covered));
            }
            let (e, covered) = self.fences.owner(k).fence.expect("fence set above");
            let done = self.event_done(d, e, wait)?;
            if !done {
                break;
            }
            self.fences.owner_mut(k).fence = None;
            self.destroy_event(d, e);
            self.arena.make_clean(k, covered);
            // Frees after the fence are still dirty: go round and fence them too.
        }
        Ok(())
    }

    /// Whether event `e` has completed; with `wait`, block until it has.
    pub(super) fn event_done<D: Driver + ?Sized>(
        &mut self,
        d: &D,
        e: EventId,
        wait: bool,
    ) -> Result<bool> {
        if wait {
            self.driver_call(DriverOp::WaitEvent, || d.wait_event(e))?;
            self.stats.event_waits += 1;
            Ok(true)
        } else {
            Ok(self.driver_call(DriverOp::QueryEvent, || d.query_event(e))?)
        }
    }

    /// Make clean the multi-stream frees whose events have all completed (all, with `wait`).
    pub(super) fn poll_pending<D: Driver + ?Sized>(&mut self, d: &D, wait: bool) -> Result<()> {
        let mut j = 0;
        while j < self.fences.pending.len() {
            let mut all = true;
            for idx in 0..self.fences.pending[j].events.len() {
                let e = self.fences.pending[j].events[idx];
                let done = self.event_done(d, e, wait)?;
                if !done {
                    all = false;
                    break;
                }
            }
            if all {
                let p = self.fences.pending.swap_remove(j);
                for e in p.events {
                    self.destroy_event(d, e);
                }
                let size = self.arena.blocks[p.block as usize].size;
                self.stats.pending_free -= size;
                self.arena.blocks[p.block as usize].state = State::Free {
                    owner: OwnerId::CLEAN,
                    seq: 0,
                };
                self.arena.coalesce_insert(p.block);
            } else {
                j += 1;
            }
        }
        Ok(())
    }
}
