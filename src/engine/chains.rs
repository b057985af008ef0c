//! Growing chains (`Config::chain_fit`): a tensor replaced every step by a copy a little
//! longer, the old one freed right after the copy (a KV cache grown by `torch.cat`, as
//! Hugging Face's `DynamicCache` does for every layer's keys and values at every token). A
//! chain's next copy never fits where its old one was, so a best fit puts it in some other
//! hole and leaves a piece of that hole behind, step after step. Such copies are placed by
//! next fit instead: the free block at the lowest address at or after where the last copy
//! ended (wrapping round to the lowest), so the copies of one step follow each other through
//! the holes the step before left, as a log does. Measured in design/zoo.md ("Nineteenth
//! session"): `stitch gen serve` seeds 1-8 at GPU lags 0 / 100 / 1000, 1.05-1.09 ->
//! 1.034-1.066, with no zoo workload higher.
//!
//! A request above half a granule ([`long_enough`]) is taken for a chain's next copy when
//! a live large request is at most [`CHAIN_STEP`] smaller, and only while such candidates
//! have mostly been confirmed: their smaller neighbour was freed within the next [`WINDOW`]
//! candidates (the old copy dropped after the concatenation). Training loops have sizes a little apart too, but those
//! tensors are not freed in that pattern, so they keep the best fit.
#![forbid(unsafe_code)]

use super::arena::{Arena, Pool, State};
use super::fences::OwnerId;
use super::handles::Handles;
use super::placement::contiguous_offset;
use std::collections::{BTreeMap, VecDeque};

/// A request is a candidate next copy when a live large request is smaller by at most this
/// (a token of keys or values is a few KiB per layer).
pub(crate) const CHAIN_STEP: u64 = 64 << 10;

/// Whether a request of `requested` bytes may be placed as a chain's next copy: only above
/// half a granule. Smaller copies share their handles with other blocks whichever way they
/// are placed, and next fit spreads them over every handle where best fit packs them: with
/// requests of 256 KiB to 1 MiB in the large pool (`Config::small_threshold` below them), a
/// loop of 256 interleaved K/V chains held 1.52-1.70 x its peak live by next fit and
/// 1.10-1.17 by best fit, random mid-sized churn 1.070-1.096 and 1.050-1.064 (design/zoo.md
/// "Twenty-third session"). Above half a granule nothing changed.
pub(crate) fn long_enough(requested: u64, granularity: u64) -> bool {
    requested > granularity / 2
}

/// Candidates waiting for their smaller neighbour's free; an older one unconfirmed counts
/// against the pattern.
pub(crate) const WINDOW: usize = 8;

/// Weight of each confirmation or miss in the running score.
const WEIGHT: f64 = 1.0 / 16.0;

/// The running score from which candidates are placed as chains.
const CONFIRMED: f64 = 0.5;

/// What tells a chain's next copy, and where the last one ended.
#[derive(Debug, Default)]
pub(crate) struct Chains {
    /// requested size -> how many live large allocations asked for it: exactly the live
    /// blocks of the large pool, counted by their `requested` (checked by `validate`).
    live: BTreeMap<u64, u32>,
    /// The sizes of the last candidates (at most [`WINDOW`]) whose smaller neighbour has not
    /// been freed yet, oldest first.
    pending: VecDeque<u64>,
    /// Running share of candidates confirmed, in [0, 1]; starts at 0, so chains are placed
    /// only once the pattern has been seen.
    score: f64,
    /// Where the last copy placed as a chain ended (next fit starts there).
    rover: u64,
}

impl Chains {
    /// A live large allocation of `requested` bytes.
    pub(crate) fn add(&mut self, requested: u64) {
        *self.live.entry(requested).or_insert(0) += 1;
    }

    /// A live large allocation of `requested` bytes was freed: one fewer, and a candidate
    /// just above it is confirmed.
    pub(crate) fn remove(&mut self, requested: u64) {
        if let Some(n) = self.live.get_mut(&requested) {
            *n -= 1;
            if *n == 0 {
                self.live.remove(&requested);
            }
        }
        if let Some(k) = self
            .pending
            .iter()
            .position(|&c| requested < c && requested + CHAIN_STEP >= c)
        {
            self.pending.remove(k);
            self.score += (1.0 - self.score) * WEIGHT;
        }
    }

    /// Whether a large request of `requested` bytes is to be placed as a chain's next copy:
    /// some live large allocation is at most [`CHAIN_STEP`] smaller (then it is recorded as
    /// a candidate) and the candidates before it were mostly confirmed.
    pub(crate) fn next_copy(&mut self, requested: u64) -> bool {
        let below = self
            .live
            .range(requested.saturating_sub(CHAIN_STEP)..requested)
            .next()
            .is_some();
        if !below {
            return false;
        }
        if self.pending.len() == WINDOW {
            self.pending.pop_front();
            self.score -= self.score * WEIGHT;
        }
        self.pending.push_back(requested);
        self.score >= CONFIRMED
    }

    /// A copy was placed as a chain at `[addr, end)`.
    pub(crate) fn placed_at(&mut self, end: u64) {
        self.rover = end;
    }

    /// Next fit for `rsize` bytes: among the free large blocks that hold them (clean, or
    /// `own`'s), the one at the lowest address ending after the rover, else the lowest of
    /// all. Placement inside the block is the usual one (`contiguous_offset`).
    pub(crate) fn next_fit(
        &self,
        arena: &Arena,
        handles: &Handles,
        granularity: u64,
        rsize: u64,
        own: Option<OwnerId>,
    ) -> Option<u32> {
        let mut after: Option<(u64, u32)> = None;
        let mut first: Option<(u64, u32)> = None;
        let mut consider = |i: u32| {
            let b = &arena.blocks[i as usize];
            debug_assert!(matches!(b.state, State::Free { .. }) && b.pool == Pool::Large);
            if b.size < rsize
                || b.size < contiguous_offset(arena, handles, granularity, i, rsize) + rsize
            {
                return;
            }
            let slot = if b.addr + b.size > self.rover {
                &mut after
            } else {
                &mut first
            };
            if slot.is_none_or(|(a, _)| b.addr < a) {
                *slot = Some((b.addr, i));
            }
        };
        let large = Pool::Large as usize;
        arena.bins[OwnerId::CLEAN.index()][large].for_each_fitting(
            &arena.blocks,
            rsize,
            &mut consider,
        );
        if let Some(o) = own {
            arena.bins[o.index()][large].for_each_fitting(&arena.blocks, rsize, &mut consider);
        }
        after.or(first).map(|(_, i)| i)
    }

    /// Check the live sizes against the live large blocks of `arena`.
    pub(crate) fn validate(&self, arena: &Arena) -> Result<(), String> {
        let mut want: BTreeMap<u64, u32> = BTreeMap::new();
        for &i in arena.live.values() {
            let b = &arena.blocks[i as usize];
            if let (Pool::Large, State::Live { requested, .. }) = (b.pool, b.state) {
                *want.entry(requested).or_insert(0) += 1;
            }
        }
        if want != self.live {
            return Err(format!(
                "chains: {} live large sizes counted, the arena has {}",
                self.live.len(),
                want.len()
            ));
        }
        if self.pending.len() > WINDOW || !(0.0..=1.0).contains(&self.score) {
            return Err(format!(
                "chains: {} pending candidates (at most {WINDOW}), score {}",
                self.pending.len(),
                self.score
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const M: u64 = 1 << 20;

    #[test]
    fn a_candidate_needs_a_live_request_a_little_smaller() {
        let mut c = Chains::default();
        c.add(4 * M);
        assert!(
            !c.next_copy(4 * M),
            "the same size is a repeat, not a chain"
        );
        assert!(!c.next_copy(4 * M + CHAIN_STEP + 512), "too far above");
        assert!(!c.next_copy(4 * M - 512), "below");
        assert_eq!(c.pending.len(), 0);
        // A candidate, but the pattern has not been seen yet.
        assert!(!c.next_copy(4 * M + 3072));
        assert_eq!(c.pending.len(), 1);
    }

    #[test]
    fn chains_are_placed_once_their_old_copies_are_seen_freed() {
        let mut c = Chains::default();
        let mut size = 4 * M;
        c.add(size);
        let mut placed_from = None;
        for step in 0..64 {
            let next = size + 3072;
            if c.next_copy(next) && placed_from.is_none() {
                placed_from = Some(step);
            }
            c.add(next);
            c.remove(size); // the old copy, dropped after the concatenation
            size = next;
        }
        // 0.5 is reached after 11 confirmations at a weight of 1/16.
        assert_eq!(placed_from, Some(11));
        assert!(c.score > 0.9);
    }

    #[test]
    fn sizes_a_little_apart_that_are_not_freed_so_are_not_chains() {
        // A training step: many live tensors of nearby sizes, none freed after the larger one
        // is allocated.
        let mut c = Chains::default();
        let mut sizes = Vec::new();
        for k in 0..200u64 {
            let s = 4 * M + k * 1024;
            assert!(!c.next_copy(s), "step {k}");
            c.add(s);
            sizes.push(s);
        }
        assert_eq!(c.score, 0.0);
        for s in sizes {
            c.remove(s);
        }
        assert!(c.live.is_empty());
    }
}
