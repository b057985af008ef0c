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
//! A large request is taken for a chain's next copy when a live large request is at most
//! [`CHAIN_STEP`] smaller, and only while such candidates have mostly been confirmed: their
//! smaller neighbour was freed within the next [`WINDOW`] candidates while they themselves
//! still lived (the old copy dropped after the concatenation). Training loops have sizes a
//! little apart too, but those tensors are not freed in that pattern, so they keep the best
//! fit; a transient freed before any smaller neighbour (a scratch tensor beside each copy)
//! counts against the pattern at once, so a loop that interleaves such transients with its
//! copies keeps the best fit as well (design/zoo.md, "Twenty-fifth session": next fit over
//! copies and transients alike held 1.52-1.70 x peak live on such a loop, best fit 1.10-1.17).
#![forbid(unsafe_code)]

use super::arena::{Arena, Pool, State};
use super::fences::OwnerId;
use super::handles::Handles;
use super::placement::contiguous_offset;
use std::collections::{BTreeMap, VecDeque};

/// A request is a candidate next copy when a live large request is smaller by at most this
/// (a token of keys or values is a few KiB per layer).
pub(crate) const CHAIN_STEP: u64 = 64 << 10;

/// Candidates waiting for their smaller neighbour's free; an older one unconfirmed counts
/// against the pattern.
pub(crate) const WINDOW: usize = 8;

/// Weight of each confirmation or miss in the running score.
const WEIGHT: f64 = 1.0 / 16.0;

/// The running score from which candidates are placed as chains. A loop whose every copy
/// comes with a transient freed first scores about one half, so the bar is well above it
/// (`examples/mid_sized`'s K/V chain loop, seed 1: 1.21 x peak live at a bar of 0.7, 1.12 at
/// 0.8; at 0.9 `stitch gen serve` kept less than half its gain at GPU lags 100 and 1000:
/// design/zoo.md, "Twenty-fifth session").
const CONFIRMED: f64 = 0.8;

/// What tells a chain's next copy, and where the last one ended.
#[derive(Debug, Default)]
pub(crate) struct Chains {
    /// requested size -> how many live large allocations asked for it: exactly the live
    /// blocks of the large pool, counted by their `requested` (checked by `validate`).
    live: BTreeMap<u64, u32>,
    /// The last candidates (at most [`WINDOW`]) whose smaller neighbour has not been freed
    /// yet, oldest first: (requested size, address once placed, else 0).
    pending: VecDeque<(u64, u64)>,
    /// Running share of candidates confirmed, in [0, 1]; starts at 0, so chains are placed
    /// only once the pattern has been seen.
    score: f64,
    /// Where the last copy placed as a chain ended (next fit starts there).
    rover: u64,
}

impl Chains {
    /// A live large allocation of `requested` bytes at `addr` (never 0): counted, and the
    /// candidate just recorded for it, if any, learns its address.
    pub(crate) fn add(&mut self, requested: u64, addr: u64) {
        *self.live.entry(requested).or_insert(0) += 1;
        if let Some(last) = self.pending.back_mut() {
            if *last == (requested, 0) {
                last.1 = addr;
            }
        }
    }

    /// The live large allocation of `requested` bytes at `addr` was freed: one fewer. A
    /// pending candidate freed itself before any smaller neighbour was a transient, not a
    /// copy (a miss); otherwise a candidate just above it is confirmed.
    pub(crate) fn remove(&mut self, requested: u64, addr: u64) {
        if let Some(n) = self.live.get_mut(&requested) {
            *n -= 1;
            if *n == 0 {
                self.live.remove(&requested);
            }
        }
        if let Some(k) = self.pending.iter().position(|&(_, a)| a == addr) {
            self.pending.remove(k);
            self.score -= self.score * WEIGHT;
        } else if let Some(k) = self
            .pending
            .iter()
            .position(|&(c, _)| requested < c && requested + CHAIN_STEP >= c)
        {
            self.pending.remove(k);
            self.score += (1.0 - self.score) * WEIGHT;
        }
    }

    /// Whether a live large request is at most [`CHAIN_STEP`] smaller than `requested`.
    pub(crate) fn has_below(&self, requested: u64) -> bool {
        self.live
            .range(requested.saturating_sub(CHAIN_STEP)..requested)
            .next()
            .is_some()
    }

    /// Whether a large request of `requested` bytes is to be placed as a chain's next copy:
    /// some live large allocation is at most [`CHAIN_STEP`] smaller (then it is recorded as
    /// a candidate) and the candidates before it were mostly confirmed.
    pub(crate) fn next_copy(&mut self, requested: u64) -> bool {
        if !self.has_below(requested) {
            return false;
        }
        if self.pending.len() == WINDOW {
            self.pending.pop_front();
            self.score -= self.score * WEIGHT;
        }
        self.pending.push_back((requested, 0));
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
        c.add(4 * M, M);
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

    /// One step of a chain (at `addr`, the old copy at `old_addr`), optionally with a
    /// transient a little larger than the copy allocated before it and freed before the old
    /// copy (at `addr + 64 M`). Returns whether the copy was to be placed as a chain.
    fn step(c: &mut Chains, size: u64, (old_addr, addr): (u64, u64), transient: bool) -> bool {
        let next = size + 3072;
        let scratch = next + CHAIN_STEP / 2;
        if transient {
            c.next_copy(scratch);
            c.add(scratch, addr + 64 * M);
        }
        let chained = c.next_copy(next);
        c.add(next, addr);
        if transient {
            c.remove(scratch, addr + 64 * M);
        }
        c.remove(size, old_addr); // the old copy, dropped after the concatenation
        chained
    }

    #[test]
    fn chains_are_placed_once_their_old_copies_are_seen_freed() {
        let mut c = Chains::default();
        let mut size = 4 * M;
        c.add(size, M);
        let mut placed_from = None;
        for step_no in 0..64u64 {
            let addrs = (M * (1 + step_no % 2), M * (1 + (step_no + 1) % 2));
            if step(&mut c, size, addrs, false) && placed_from.is_none() {
                placed_from = Some(step_no);
            }
            size += 3072;
        }
        // 0.8 is reached after 25 confirmations at a weight of 1/16.
        assert_eq!(placed_from, Some(25));
        assert!(c.score > 0.95);
    }

    #[test]
    fn a_transient_freed_before_any_smaller_neighbour_counts_against_the_pattern() {
        // Chains whose every copy comes after a transient a little larger than it: the
        // transient has a live neighbour a little smaller too (the old copy) but is freed
        // first, so it is a miss, and the score settles near one half, below the bar.
        let mut c = Chains::default();
        let mut sizes: Vec<u64> = (0..32).map(|k| M + k * CHAIN_STEP).collect();
        for (k, &s) in sizes.iter().enumerate() {
            c.add(s, (1 + k as u64) * 256 * M);
        }
        let mut chained = 0;
        for round in 0..50u64 {
            for (k, size) in sizes.iter_mut().enumerate() {
                let base = (1 + k as u64) * 256 * M;
                let addrs = if round % 2 == 0 {
                    (base, base + 128 * M)
                } else {
                    (base + 128 * M, base)
                };
                chained += step(&mut c, *size, addrs, true) as u32;
                *size += 3072;
            }
        }
        assert_eq!(chained, 0, "score {}", c.score);
        assert!(c.score < CONFIRMED, "score {}", c.score);
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
            c.add(s, (k + 1) * M);
            sizes.push(s);
        }
        assert_eq!(c.score, 0.0);
        for (k, s) in sizes.into_iter().enumerate() {
            c.remove(s, (k as u64 + 1) * M);
        }
        assert!(c.live.is_empty());
    }
}
