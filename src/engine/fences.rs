//! Stream fences: who may use a free block, and when it becomes usable by everyone.
//!
//! A block freed on one stream is "dirty": work queued on that stream may still use it, so
//! only that stream may reuse it. Fences are recorded lazily: on a slow path, one event per
//! stream with dirty blocks covers every free made on it so far; once it completes those
//! blocks become clean (owner [`OwnerId::CLEAN`]). A block used on several streams
//! (`record_stream`) is fenced at its free with one event per stream and waits, pending,
//! until all have completed.
//!
//! Owners are recycled: a stream with no dirty block and no fence is "quiet", and once the
//! table holds [`KEEP_OWNERS`] slots a new stream takes a quiet stream's slot instead of a
//! new one, so the table holds at most `KEEP_OWNERS` slots or one per stream with unfenced or
//! in-flight frees, not one per stream ever seen; `by_stream` finds a stream's owner in O(1). A stream whose fence cannot be recorded (a destroyed or broken
//! stream) keeps its frees dirty: usable by that stream only, never stitched, never unmapped
//! while the allocator runs; the other streams go on as before.
#![forbid(unsafe_code)]

use super::arena::{Block, State};
use super::Engine;
use crate::driver::{Driver, DriverOp, EventId, Stream};
use crate::error::Result;
use rustc_hash::FxHashMap;

/// Up to this many stream owners none is recycled: the table keeps the order of first frees,
/// which is the order a poll fences streams in (so small stream counts behave exactly as
/// when the table never shrank); beyond it, new streams reuse quiet streams' slots.
pub(crate) const KEEP_OWNERS: usize = 64;

/// The owner of a free block: an index into [`Fences::owners`] (and into the arena's bins).
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct OwnerId(pub(crate) u32);

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

/// Where a stream owner stands.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Standing {
    /// A free slot, in [`Fences::reusable`]: no dirty block, no fence, in no stream's entry.
    Idle,
    /// Holds its stream's frees; `by_stream` maps the stream to it.
    Active,
    /// Like `Active`, but the last fence on its stream could not be recorded or queried
    /// (logged once when it started failing); retried on every slow path.
    Failing,
    /// `retire_stream` could not fence the stream: never recorded on again, in no stream's
    /// entry; its dirty blocks are quarantined (usable by nobody) until teardown. Has no
    /// fence; becomes `Idle` once it holds no dirty block.
    Retired,
}

/// One stream that has freed memory, and its fence.
#[derive(Debug)]
pub(crate) struct Owner {
    /// The stream whose frees this owner holds (unused for the clean owner and idle slots).
    pub(crate) stream: Stream,
    /// Frees counted on this stream so far; a free block records the count at its free
    /// (`State::Free::seq`). Reset when the slot is reused.
    pub(crate) free_seq: u64,
    /// An event recorded on the stream, covering frees with `seq <= covered`; `covered <=
    /// free_seq`. Always `None` for the clean owner, idle and retired slots.
    pub(crate) fence: Option<(EventId, u64)>,
    /// Whether the slot is in use and how (see [`Standing`]); `Active` for the clean owner.
    pub(crate) standing: Standing,
    /// Whether the slot is in [`Fences::reusable`] (at most once).
    pub(crate) listed: bool,
}

/// A free of a block used on several streams, waiting for one event per stream.
#[derive(Debug)]
pub(crate) struct PendingFree {
    /// The block, in state `Pending`; each pending block is in exactly one `PendingFree`.
    pub(crate) block: u32,
    /// Events not yet destroyed; the block is clean once all have completed and `unfenced`
    /// is empty.
    pub(crate) events: Vec<EventId>,
    /// Streams whose event could not be recorded at the free; recorded on a later slow path.
    pub(crate) unfenced: Vec<Stream>,
    /// One of the streams was retired before it could be fenced: the block never becomes
    /// clean (nobody can tell when that stream stops using it) and stays until teardown.
    pub(crate) lost: bool,
}

/// Stream owners, pending multi-stream frees and events whose destroy must be retried.
#[derive(Debug)]
pub(crate) struct Fences {
    /// `owners[0]` is the clean owner ([`OwnerId::CLEAN`]); the others are stream owners
    /// and idle slots. As long as the arena's bins; never shrinks, but slots are reused, so
    /// it is as long as the most streams that had dirty memory or a fence at one time.
    pub(crate) owners: Vec<Owner>,
    /// stream -> owner, for exactly the `Active` and `Failing` owners (one per stream).
    by_stream: FxHashMap<Stream, OwnerId>,
    /// Slots a new stream may take, last-in first-out: every `Idle` slot, and owners that
    /// were quiet (no dirty block, no fence) when last polled; those may have freed again
    /// since, which is checked when they are taken. Exactly the owners with `listed` set.
    reusable: Vec<OwnerId>,
    /// Multi-stream frees, in no particular order.
    pub(crate) pending: Vec<PendingFree>,
    /// Completed events whose destroy failed; retried on later slow paths and at teardown,
    /// so no event leaks.
    pub(crate) undestroyed_events: Vec<EventId>,
    /// Streams other than the allocating one that used a live block (`record_stream`),
    /// by block id; only live blocks have an entry.
    pub(crate) extra_streams: FxHashMap<u32, Vec<Stream>>,
    /// Events lent to threads waiting for them outside the engine's lock
    /// ([`Engine::wait_target`]), with how many waiters hold each. A lent event is never
    /// destroyed: a destroy while it is lent parks it in `orphaned` until its last waiter is
    /// back ([`Engine::waited`]).
    pub(crate) lent: FxHashMap<EventId, u32>,
    /// Lent events nothing but their waiters refer to any more; destroyed when returned.
    /// Every entry is a key of `lent`.
    pub(crate) orphaned: Vec<EventId>,
}

impl Fences {
    pub(crate) fn new() -> Self {
        Fences {
            owners: vec![Owner {
                stream: Stream::sim(u64::MAX),
                free_seq: 0,
                fence: None,
                standing: Standing::Active,
                listed: false,
            }],
            by_stream: FxHashMap::default(),
            reusable: Vec::new(),
            pending: Vec::new(),
            undestroyed_events: Vec::new(),
            extra_streams: FxHashMap::default(),
            lent: FxHashMap::default(),
            orphaned: Vec::new(),
        }
    }

    /// Whether any stream holds dirty memory or a fence (otherwise no lookup is needed).
    #[inline]
    pub(crate) fn has_streams(&self) -> bool {
        !self.by_stream.is_empty()
    }

    /// The owner holding `stream`'s frees, if it has unfenced or in-flight ones.
    #[inline]
    pub(crate) fn owner_index(&self, stream: Stream) -> Option<OwnerId> {
        self.by_stream.get(&stream).copied()
    }

    /// Forget every stream owner (teardown, once their fences are destroyed).
    pub(crate) fn clear_owners(&mut self) {
        self.owners.truncate(1);
        self.by_stream.clear();
        self.reusable.clear();
    }

    /// Take owner `k` (a stream owner) out of its stream's entry: `Retired`, or `Idle` when
    /// it holds no dirty block. Its fence must be gone.
    fn detach(&mut self, k: OwnerId, dirty: bool) {
        let o = &mut self.owners[k.index()];
        debug_assert!(o.fence.is_none());
        if matches!(o.standing, Standing::Active | Standing::Failing) {
            self.by_stream.remove(&o.stream);
        }
        if dirty {
            o.standing = Standing::Retired;
        } else {
            o.standing = Standing::Idle;
            self.list(k);
        }
    }

    /// Put owner `k` in `reusable` unless it is there.
    fn list(&mut self, k: OwnerId) {
        let o = &mut self.owners[k.index()];
        if !o.listed {
            o.listed = true;
            self.reusable.push(k);
        }
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
        if self.owners.len() > u32::MAX as usize {
            return Err("owner ids overflow".into());
        }
        let mut dirty = vec![false; self.owners.len()];
        for b in blocks {
            if let State::Free { owner, .. } = b.state {
                if let Some(x) = dirty.get_mut(owner.index()) {
                    *x = true;
                }
            }
        }
        let (mut listed, mut mapped) = (0, 0);
        for (k, o) in self.owners.iter().enumerate().skip(1) {
            if let Some((_, covered)) = o.fence {
                if covered > o.free_seq {
                    return Err(format!("owner {k}'s fence covers frees not yet made"));
                }
            }
            let entry = self.by_stream.get(&o.stream) == Some(&OwnerId(k as u32));
            if o.listed {
                listed += 1;
                if !self.reusable.contains(&OwnerId(k as u32)) {
                    return Err(format!("owner {k} is listed but not in the reusable slots"));
                }
            }
            let ok = match o.standing {
                Standing::Idle => !dirty[k] && o.fence.is_none() && o.listed,
                Standing::Active | Standing::Failing => {
                    mapped += 1;
                    entry
                }
                Standing::Retired => !entry && o.fence.is_none() && dirty[k],
            };
            if !ok {
                return Err(format!("owner {k} ({:?}) breaks its standing", o.standing));
            }
        }
        if listed != self.reusable.len() || mapped != self.by_stream.len() {
            return Err("the reusable slots or the stream map disagree with the owners".into());
        }
        for p in &self.pending {
            if p.lost && !p.unfenced.is_empty() {
                return Err(format!(
                    "lost pending free of block {} has streams to fence",
                    p.block
                ));
            }
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
        if let Some(e) = self.orphaned.iter().find(|e| !self.lent.contains_key(e)) {
            return Err(format!("orphaned event {e:?} is not lent"));
        }
        if self.lent.values().any(|&n| n == 0) {
            return Err("an event is lent to no waiter".into());
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

/// Whether `stream` is capturing a CUDA graph now: nothing may be recorded on it (an
/// event record would be captured into the graph, or invalidate the capture). A query that
/// fails counts as not capturing (the record that follows reports the stream's trouble).
pub(super) fn capturing<D: Driver + ?Sized>(d: &D, stream: Stream) -> bool {
    matches!(d.stream_capturing(stream), Ok(true))
}

impl Engine {
    /// The owner for frees on `stream`: its own, else (once the table holds `KEEP_OWNERS`
    /// slots) a reusable one, else a new one (with its free lists).
    pub(super) fn owner_for(&mut self, stream: Stream) -> OwnerId {
        if let Some(o) = self.fences.owner_index(stream) {
            return o;
        }
        let reused = if self.fences.owners.len() > KEEP_OWNERS {
            self.take_reusable()
        } else {
            None
        };
        let k = match reused {
            Some(k) => k,
            None => {
                let k = u32::try_from(self.fences.owners.len()).expect("at most 2^32 owners");
                self.fences.owners.push(Owner {
                    stream,
                    free_seq: 0,
                    fence: None,
                    standing: Standing::Idle,
                    listed: false,
                });
                self.arena.add_owner();
                OwnerId(k)
            }
        };
        let o = self.fences.owner_mut(k);
        debug_assert_eq!(o.standing, Standing::Idle);
        *o = Owner {
            stream,
            free_seq: 0,
            fence: None,
            standing: Standing::Active,
            listed: false,
        };
        self.fences.by_stream.insert(stream, k);
        k
    }

    /// A slot for a new stream from `reusable`, made `Idle` (a quiet owner leaves its
    /// stream's entry); `None` if every listed one is busy again.
    fn take_reusable(&mut self) -> Option<OwnerId> {
        while let Some(k) = self.fences.reusable.pop() {
            self.fences.owner_mut(k).listed = false;
            let o = self.fences.owner(k);
            match o.standing {
                Standing::Idle => return Some(k),
                Standing::Active | Standing::Failing if o.fence.is_none() && !self.has_dirty(k) => {
                    let stream = o.stream;
                    self.fences.by_stream.remove(&stream);
                    self.fences.owner_mut(k).standing = Standing::Idle;
                    return Some(k);
                }
                _ => {} // busy again: listed anew when next found quiet
            }
        }
        None
    }

    /// Whether owner `k` holds a dirty free block.
    fn has_dirty(&self, k: OwnerId) -> bool {
        self.arena.bins[k.index()].iter().any(|b| b.count > 0)
    }

    /// Owner `k`'s stream could not be fenced: note it (logged when it starts failing).
    fn fence_failed(&mut self, k: OwnerId, err: &dyn std::fmt::Display) {
        let o = self.fences.owner_mut(k);
        if o.standing == Standing::Active {
            o.standing = Standing::Failing;
            tracing::warn!(
                err = %err,
                stream = o.stream.raw(),
                "cannot fence a stream: its frees stay usable by it only until a fence works"
            );
        }
    }

    /// Never fence owner `k`'s stream again (`retire_stream` failed): its dirty blocks are
    /// quarantined until teardown.
    fn retire_owner<D: Driver + ?Sized>(&mut self, d: &D, k: OwnerId) {
        if let Some((e, _)) = self.fences.owner_mut(k).fence.take() {
            self.destroy_event(d, e);
        }
        let dirty = self.has_dirty(k);
        if dirty {
            tracing::error!(
                stream = self.fences.owner(k).stream.raw(),
                "a retired stream could not be fenced: its freed memory is quarantined"
            );
        }
        self.fences.detach(k, dirty);
    }

    /// Destroy an event; if the driver refuses, keep it to retry later (never leak it). An
    /// event lent to a waiter is destroyed when the last one is back.
    pub(super) fn destroy_event<D: Driver + ?Sized>(&mut self, d: &D, e: EventId) {
        if self.fences.lent.contains_key(&e) {
            self.fences.orphaned.push(e);
            return;
        }
        match self.driver_call(DriverOp::DestroyEvent, || d.destroy_event(e)) {
            Ok(()) => self.stats.events_held -= 1,
            Err(err) => {
                tracing::warn!(%err, "could not destroy an event; will retry");
                self.fences.undestroyed_events.push(e);
            }
        }
    }

    /// Record an event on `stream`, counted in `stats.events_held` until it is destroyed.
    /// Between engine calls that count equals the number of distinct events the fences, the
    /// pending frees, the ghosts, the waiters and the retry list refer to
    /// ([`Engine::validate_events`]): an event dropped from every list without a destroy is
    /// a leaked `CUevent`.
    pub(super) fn record_event<D: Driver + ?Sized>(
        &mut self,
        d: &D,
        stream: Stream,
    ) -> crate::driver::DriverResult<EventId> {
        let e = self.driver_call(DriverOp::RecordEvent, || d.record_event(stream))?;
        self.stats.events_held += 1;
        Ok(e)
    }

    /// Every event recorded and not destroyed is referred to by a stream's fence, a pending
    /// free, a ghost, the retry list or a waiter, and nothing refers to one destroyed: the
    /// distinct events referred to must be exactly as many as `stats.events_held`.
    pub(super) fn validate_events(&self) -> std::result::Result<(), String> {
        let f = &self.fences;
        let mut seen: Vec<u64> = f
            .owners
            .iter()
            .filter_map(|o| o.fence.map(|(e, _)| e))
            .chain(f.pending.iter().flat_map(|p| p.events.iter().copied()))
            .chain(f.undestroyed_events.iter().copied())
            .chain(f.lent.keys().copied())
            .chain(f.orphaned.iter().copied())
            .chain(self.ghosts.events())
            .map(|e| e.raw())
            .collect();
        seen.sort_unstable();
        seen.dedup();
        if seen.len() as u64 != self.stats.events_held {
            return Err(format!(
                "{} events recorded and not destroyed, but {} referred to",
                self.stats.events_held,
                seen.len()
            ));
        }
        Ok(())
    }

    /// Retry destroying events whose destroy failed before.
    pub(super) fn retry_undestroyed_events<D: Driver + ?Sized>(&mut self, d: &D) {
        for e in std::mem::take(&mut self.fences.undestroyed_events) {
            self.destroy_event(d, e);
        }
    }

    /// Fence streams with unfenced frees, and make clean whatever has completed. With
    /// `wait`, block until every free so far is clean, except those of streams that cannot
    /// be fenced (they stay dirty; see the module docs).
    pub(super) fn poll<D: Driver + ?Sized>(&mut self, d: &D, wait: bool) -> Result<()> {
        self.poll_with(d, wait, usize::MAX)
    }

    /// [`Engine::poll`] for an allocation's slow path: no waiting, and at most
    /// [`Engine::ghost_unmap_budget`] old mappings unmapped (the rest on later slow paths).
    pub(super) fn poll_for_alloc<D: Driver + ?Sized>(&mut self, d: &D) -> Result<()> {
        let budget = self.ghost_unmap_budget();
        self.poll_with(d, false, budget)
    }

    fn poll_with<D: Driver + ?Sized>(
        &mut self,
        d: &D,
        wait: bool,
        ghost_budget: usize,
    ) -> Result<()> {
        if !self.fences.undestroyed_events.is_empty() {
            self.retry_undestroyed_events(d);
        }
        if !self.handles.quarantined.is_empty() {
            self.retry_quarantine(d);
        }
        for k in 1..self.fences.owners.len() {
            let k = OwnerId(k as u32);
            if self.fences.owner(k).standing != Standing::Idle {
                // A failure is contained to that stream's owner (see `poll_owner`).
                let _ = self.poll_owner(d, k, wait);
            }
        }
        if !self.ghosts.is_empty() {
            self.poll_ghosts(d, wait, ghost_budget)?;
        }
        self.poll_pending(d, wait);
        Ok(())
    }

    /// Fence stream owner `k`'s frees and make clean what has completed (see `poll`); an
    /// owner left quiet (no dirty block, no fence) becomes reusable. An error
    /// (recording or querying its fence failed) leaves its dirty blocks dirty and marks it
    /// `Failing`; retried on the next call.
    pub(super) fn poll_owner<D: Driver + ?Sized>(
        &mut self,
        d: &D,
        k: OwnerId,
        wait: bool,
    ) -> Result<()> {
        loop {
            let dirty = self.has_dirty(k);
            if self.fences.owner(k).fence.is_none() {
                if !dirty {
                    break;
                }
                if self.fences.owner(k).standing == Standing::Retired {
                    return Ok(());
                }
                let s = self.fences.owner(k).stream;
                if capturing(d, s) {
                    // An event recorded now would become part of the graph being captured
                    // (or invalidate the capture): fence the stream once its capture ends.
                    return Ok(());
                }
                let e = match self.record_event(d, s) {
                    Ok(e) => e,
                    Err(err) => {
                        self.fence_failed(k, &err);
                        return Err(err.into());
                    }
                };
                let covered = self.fences.owner(k).free_seq;
                let o = self.fences.owner_mut(k);
                o.fence = Some((e, covered));
                if o.standing == Standing::Failing {
                    tracing::info!(
                        stream = s.raw(),
                        "a stream that could not be fenced can again"
                    );
                    o.standing = Standing::Active;
                }
            }
            let (e, covered) = self.fences.owner(k).fence.expect("fence set above");
            let done = match self.event_done(d, e, wait) {
                Ok(done) => done,
                Err(err) => {
                    // A broken event: drop it; its frees stay dirty until a new fence works.
                    self.fences.owner_mut(k).fence = None;
                    self.destroy_event(d, e);
                    self.fence_failed(k, &err);
                    return Err(err);
                }
            };
            if !done {
                return Ok(());
            }
            self.fences.owner_mut(k).fence = None;
            self.destroy_event(d, e);
            self.arena.make_clean(k, covered);
            // Frees after the fence are still dirty: go round and fence them too.
        }
        if self.fences.owner(k).standing == Standing::Retired {
            self.fences.detach(k, false); // nothing left to quarantine
        } else {
            self.fences.list(k);
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

    /// Fence the streams of multi-stream free `j` not fenced yet; whether all its events
    /// have completed (waiting for them with `wait`). Failures are logged and leave it
    /// pending.
    fn pending_done<D: Driver + ?Sized>(&mut self, d: &D, j: usize, wait: bool) -> bool {
        if self.fences.pending[j].lost {
            return false;
        }
        let mut i = 0;
        while i < self.fences.pending[j].unfenced.len() {
            let s = self.fences.pending[j].unfenced[i];
            if capturing(d, s) {
                i += 1; // fenced once its capture ends (see `poll_owner`)
                continue;
            }
            match self.record_event(d, s) {
                Ok(e) => {
                    let p = &mut self.fences.pending[j];
                    p.events.push(e);
                    p.unfenced.swap_remove(i);
                }
                Err(err) => {
                    tracing::debug!(%err, stream = s.raw(), "still cannot fence a pending free");
                    i += 1;
                }
            }
        }
        if !self.fences.pending[j].unfenced.is_empty() {
            return false;
        }
        // Completed events are dropped as they are found, so `events[0]` is always one not
        // known to have completed (what `wait_target` lends).
        while let Some(&e) = self.fences.pending[j].events.first() {
            match self.event_done(d, e, wait) {
                Ok(true) => {
                    self.fences.pending[j].events.remove(0);
                    self.destroy_event(d, e);
                }
                Ok(false) => return false,
                Err(err) => {
                    tracing::warn!(%err, "querying the event of a pending free failed");
                    return false;
                }
            }
        }
        true
    }

    /// Make clean the multi-stream frees whose events have all completed (all, with `wait`,
    /// but those that cannot be fenced).
    pub(super) fn poll_pending<D: Driver + ?Sized>(&mut self, d: &D, wait: bool) {
        let mut j = 0;
        while j < self.fences.pending.len() {
            if self.pending_done(d, j, wait) {
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
    }

    /// The one event a slow path should wait for next, outside the lock: of the streams'
    /// fences and the first open event of each multi-stream free, the one whose completion
    /// makes the most free bytes clean (ties: owners in table order, then pending frees).
    /// The requesting stream's own fence counts too: its dirty blocks are reusable by it in
    /// place, but only clean ones can be stitched. `None`: nothing in flight could help. The
    /// event is lent (never destroyed) until [`Engine::waited`] returns it.
    ///
    /// Call after `poll(d, false)`, so every fence left is one not known to have completed.
    pub(crate) fn wait_target(&mut self) -> Option<EventId> {
        let mut best: Option<(u64, EventId)> = None;
        let mut blocks = Vec::new();
        for k in 1..self.fences.owners.len() {
            let k = OwnerId(k as u32);
            let o = self.fences.owner(k);
            let Some((e, _)) = o.fence else { continue };
            if !matches!(o.standing, Standing::Active | Standing::Failing) {
                continue;
            }
            // All of the owner's dirty bytes, not only those the fence covers: a free after
            // the fence may have merged with covered ones (the merged block takes the later
            // free's count); once the fence completes, the next poll fences the rest anew.
            blocks.clear();
            self.arena.collect_free(k, &mut blocks);
            let gain: u64 = blocks
                .iter()
                .map(|&b| self.arena.blocks[b as usize].size)
                .sum();
            if gain > 0 && best.is_none_or(|(g, _)| gain > g) {
                best = Some((gain, e));
            }
        }
        for p in &self.fences.pending {
            if p.lost || !p.unfenced.is_empty() {
                continue;
            }
            let Some(&e) = p.events.first() else { continue };
            let gain = self.arena.blocks[p.block as usize].size;
            if best.is_none_or(|(g, _)| gain > g) {
                best = Some((gain, e));
            }
        }
        let (_, e) = best?;
        *self.fences.lent.entry(e).or_insert(0) += 1;
        Some(e)
    }

    /// A waiter lent `e` by [`Engine::wait_target`] is back with the wait's `result`. On
    /// success the next poll finds `e` complete; on failure the owner whose fence it is
    /// drops it (its frees stay dirty until a new fence works) and a pending free keeps it
    /// (queried again later).
    pub(crate) fn waited<D: Driver + ?Sized>(
        &mut self,
        d: &D,
        e: EventId,
        result: crate::driver::DriverResult<()>,
    ) {
        self.stats.calls.add(DriverOp::WaitEvent);
        match &result {
            Ok(()) => self.stats.event_waits += 1,
            Err(err) => {
                let k = (1..self.fences.owners.len())
                    .map(|k| OwnerId(k as u32))
                    .find(|&k| matches!(self.fences.owner(k).fence, Some((f, _)) if f == e));
                if let Some(k) = k {
                    self.fences.owner_mut(k).fence = None;
                    self.fence_failed(k, err);
                    self.destroy_event(d, e);
                } else {
                    tracing::warn!(%err, "waiting for the event of a pending free failed");
                }
            }
        }
        let n = self
            .fences
            .lent
            .get_mut(&e)
            .expect("a lent event comes back");
        *n -= 1;
        if *n == 0 {
            self.fences.lent.remove(&e);
            if let Some(i) = self.fences.orphaned.iter().position(|&x| x == e) {
                self.fences.orphaned.swap_remove(i);
                self.destroy_event(d, e);
            }
        }
    }

    /// `retire_stream`'s work on the fences: fence `stream`'s frees and wait for them; what
    /// cannot be fenced is quarantined for good (so `stream` is never recorded on again) and
    /// the first error returned.
    pub(super) fn retire_fences<D: Driver + ?Sized>(
        &mut self,
        d: &D,
        stream: Stream,
    ) -> Result<()> {
        let mut result = Ok(());
        if let Some(k) = self.fences.owner_index(stream) {
            if let Err(e) = self.poll_owner(d, k, true) {
                self.retire_owner(d, k);
                result = Err(e);
            }
        }
        for j in 0..self.fences.pending.len() {
            let p = &self.fences.pending[j];
            if !p.unfenced.contains(&stream) {
                continue;
            }
            match self.record_event(d, stream) {
                Ok(e) => {
                    let p = &mut self.fences.pending[j];
                    p.events.push(e);
                    p.unfenced.retain(|&s| s != stream);
                }
                Err(err) => {
                    tracing::error!(
                        %err,
                        stream = stream.raw(),
                        "a retired stream could not be fenced: a freed block is quarantined"
                    );
                    let p = &mut self.fences.pending[j];
                    p.lost = true;
                    p.unfenced.clear();
                    if result.is_ok() {
                        result = Err(err.into());
                    }
                }
            }
        }
        let uses = |p: &PendingFree| !p.events.is_empty() && !p.lost;
        if self.fences.pending.iter().any(uses) {
            self.poll_pending(d, true);
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use crate::driver::Stream;
    use crate::engine::Engine;
    use crate::Config;

    /// `validate` counts the events recorded and not destroyed against those the structures
    /// refer to: one dropped from its list without a destroy (a leaked `CUevent`) fails it.
    #[test]
    fn validate_catches_an_event_dropped_without_a_destroy() {
        let (d, mut e) = Engine::on_sim(64 << 20, &Config::default());
        let (s1, s2) = (Stream::sim(1), Stream::sim(2));
        let p = e.alloc(&d, 4 << 20, s1).unwrap();
        e.record_stream(p, s2).unwrap();
        d.launch(s2, p, 4 << 20);
        e.free(&d, p, s1).unwrap(); // used on two streams: one event per stream
        assert_eq!(e.stats.events_held, 2);
        e.validate().unwrap();
        let lost = e.fences.pending[0].events.pop().unwrap();
        let err = e.validate().unwrap_err();
        assert!(
            err.contains("2 events recorded and not destroyed, but 1"),
            "{err}"
        );
        e.fences.pending[0].events.push(lost);
        e.validate().unwrap();
        d.complete_all();
        e.poll(&d, true).unwrap();
        assert_eq!(e.stats.events_held, 0);
        e.validate().unwrap();
        e.teardown(&d);
        assert!(d.leak_report().is_clean());
    }
}
