//! Stitches that repeat at a steady peak: the sign that a loop with the same shapes every
//! step has settled into stitching every step, and the growth allowance that ends it.
//!
//! With no growth slack (the default), best fit at a fixed budget need not reach a layout
//! that serves a fixed-shape step from free blocks alone: a smaller tensor takes the free
//! block that a larger one of the same step needs, and that one is stitched from free
//! handles elsewhere, every step (design/zoo.md, "Eleventh session": llm-train-s with fixed
//! shapes on the H200, one stitch of about 8 ms of driver time per step, 0.80-0.85 of
//! PyTorch's speed in one process). A stitch for the same request size as the stitch just
//! before it, with no new peak of live bytes in between, extends a streak; from a streak of
//! [`REPEAT_STREAK`] on, each such stitch raises the allowance above the peak by the
//! request's size, up to [`REPEAT_ALLOWANCE`] of the peak, so that creating memory is
//! allowed again and the loop settles.
//!
//! Separately, every stitch made in the same state as an earlier one at the same lifetime
//! peak (the same request size with the same live bytes: the same point of a loop with the
//! same shapes every step) is counted (`Stats::repeated_stitches`), whether or not the
//! allowance ends it; past [`REPEAT_WARN`] of them the allocator says once, in a warning,
//! what can end them: a pre-allocated pool (design/zoo.md, "Fourteenth session").
#![forbid(unsafe_code)]

use rustc_hash::FxHashSet;

/// The most the allowance may reach, as a fraction of the lifetime peak of live bytes.
/// Measured on llm-train-s with fixed shapes (simulator, lag 100): a fixed growth slack of
/// 0.01 ends its per-step stitches (peak reserved / live 1.0090 -> 1.0098); 0.001-0.0075
/// change nothing there.
pub(crate) const REPEAT_ALLOWANCE: f64 = 0.01;

/// Identical stitches in a row (after the first) before the allowance grows. Measured
/// (simulator, lags 0 and 100): from the first repeat on, `gen llm` went from 1.0013-1.0028
/// to 1.0022-1.0100 (its largest requests are stitched again and again at one peak); from
/// the third on, `gen llm` and eight of the ten zoo workloads are unchanged, llm-train-l
/// 1.0049 -> 1.0054 (lag 0), 1.0052 -> 1.0062 (lag 1000), moe 1.0110 -> 1.0114 and
/// 1.0107 -> 1.0101, and the fixed-shape loop still settles (after about seven steps).
/// Most of llm-train-l's rise was the over-fit rule spending the allowance after the peak;
/// it no longer may (`Engine::overfit_may_create`): 1.0046 / 1.0049 at lags 0 / 1000.
pub(crate) const REPEAT_STREAK: u32 = 3;

/// Repeated stitches in the same state before the one-time warning.
pub(crate) const REPEAT_WARN: u64 = 8;

/// States remembered at one lifetime peak before they are forgotten and counted afresh.
const MAX_STATES: usize = 4096;

/// The last stitch and the streak of stitches that repeated it; the states stitched in at
/// the current lifetime peak.
#[derive(Debug, Default)]
pub(crate) struct Repeats {
    /// `(request bytes, lifetime peak)` of the last stitch; `(0, 0)` before the first.
    last: (u64, u64),
    /// How many stitches in a row repeated the one before them.
    streak: u32,
    /// The lifetime peak `states` belong to; a new peak clears them.
    states_peak: u64,
    /// `(request bytes, live bytes before the request)` of every stitch at `states_peak`
    /// (at most `MAX_STATES`).
    states: FxHashSet<(u64, u64)>,
    /// Whether the warning was given.
    pub(crate) warned: bool,
}

impl Repeats {
    /// Note a stitch for `rsize` bytes at lifetime peak `peak`; returns the new allowance,
    /// from `allowance` (raised when this stitch ends a streak of at least
    /// [`REPEAT_STREAK`] repeats; never lowered).
    pub(crate) fn on_stitch(&mut self, rsize: u64, peak: u64, allowance: u64) -> u64 {
        let repeat = self.last == (rsize, peak);
        self.last = (rsize, peak);
        self.streak = if repeat { self.streak + 1 } else { 0 };
        if self.streak < REPEAT_STREAK {
            return allowance;
        }
        let cap = (peak as f64 * REPEAT_ALLOWANCE) as u64;
        tracing::debug!(
            rsize,
            peak,
            streak = self.streak,
            "repeated stitch: growth allowance"
        );
        allowance.saturating_add(rsize).min(cap).max(allowance)
    }

    /// Whether a stitch for `rsize` bytes with `live` bytes live at lifetime peak `peak`
    /// would repeat an earlier stitch's state (as [`Repeats::repeats_state`], noting nothing).
    pub(crate) fn seen(&self, rsize: u64, live: u64, peak: u64) -> bool {
        peak == self.states_peak && self.states.contains(&(rsize, live))
    }

    /// Whether a stitch for `rsize` bytes with `live` bytes live at lifetime peak `peak`
    /// was made in a state an earlier stitch at this peak was made in; notes the state.
    pub(crate) fn repeats_state(&mut self, rsize: u64, live: u64, peak: u64) -> bool {
        if peak != self.states_peak || self.states.len() >= MAX_STATES {
            self.states_peak = peak;
            self.states.clear();
        }
        !self.states.insert((rsize, live))
    }

    /// Heap bytes of the remembered states (hashbrown: the entry and one control byte per
    /// bucket).
    pub(crate) fn metadata_bytes(&self) -> u64 {
        (self.states.capacity() * (16 + 1)) as u64 * 8 / 7
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The allowance is earned by repeated stitches to end them by growth; the over-fit
    /// rule (a large request that would pin a free block four or more times its size gets
    /// new memory instead, within the growth budget) must not spend it. It did: replaying
    /// llm-train-l, reserved grew by 22 MiB (lag 0) / 40 MiB (lag 1000) after the peak of
    /// live bytes, in extensions of 2-16 MiB beside more than 20 GiB of free blocks.
    #[test]
    fn the_over_fit_rule_does_not_spend_the_repeat_allowance() {
        use crate::driver::Stream;
        use crate::engine::Engine;
        use crate::Config;
        let s = Stream::DEFAULT;
        for (slack, grows) in [(0.0, false), (0.05, true)] {
            let cfg = Config {
                reserve_slack: slack,
                ..Config::default()
            };
            let (d, mut e) = Engine::on_sim(1 << 30, &cfg);
            let p = e.alloc(&d, 256 * M, s).unwrap();
            e.free(&d, p, s).unwrap();
            // As if a loop had earned it at this peak.
            e.stats.repeat_allowance = 16 * M;
            let q = e.alloc(&d, 8 * M, s).unwrap();
            let reserved = e.stats.reserved.current;
            if grows {
                // Within a growth slack the rule creates a fitting block, as before.
                assert_eq!(reserved, 264 * M, "slack {slack}");
            } else {
                assert_eq!(reserved, 256 * M, "no growth beside the free 256 MiB");
                assert!((p..p + 256 * M).contains(&q), "placed in the free block");
            }
            e.validate().unwrap();
            e.free(&d, q, s).unwrap();
            e.teardown(&d);
            assert!(d.leak_report().is_clean());
        }
    }

    const M: u64 = 1 << 20;

    /// `n` stitches of `rsize` at `peak`; the allowance after each.
    fn run(r: &mut Repeats, n: usize, rsize: u64, peak: u64, mut a: u64) -> Vec<u64> {
        (0..n)
            .map(|_| {
                a = r.on_stitch(rsize, peak, a);
                a
            })
            .collect()
    }

    #[test]
    fn only_a_streak_of_identical_stitches_at_one_peak_raises_the_allowance() {
        let mut r = Repeats::default();
        let peak = 100_000 * M;
        let got = run(&mut r, 5, 64 * M, peak, 0);
        let k = REPEAT_STREAK as usize;
        assert!(got[..k].iter().all(|&a| a == 0), "{got:?}");
        assert_eq!(got[k], 64 * M, "{got:?}");
        assert_eq!(got[k + 1], 128 * M, "{got:?}");
    }

    #[test]
    fn another_size_or_a_new_peak_breaks_the_streak() {
        let peak = 100_000 * M;
        let k = REPEAT_STREAK as usize;
        let mut r = Repeats::default();
        run(&mut r, k, 64 * M, peak, 0);
        assert_eq!(r.on_stitch(32 * M, peak, 0), 0, "another size");
        assert_eq!(run(&mut r, k, 64 * M, peak, 0), vec![0; k]);
        let mut r = Repeats::default();
        run(&mut r, k, 64 * M, peak, 0);
        assert_eq!(r.on_stitch(64 * M, peak + M, 0), 0, "a new peak");
    }

    #[test]
    fn a_state_repeats_only_at_the_same_peak() {
        let mut r = Repeats::default();
        let peak = 1_000 * M;
        assert!(!r.repeats_state(64 * M, 900 * M, peak), "first time");
        assert!(
            r.repeats_state(64 * M, 900 * M, peak),
            "same size, same live bytes"
        );
        assert!(!r.repeats_state(64 * M, 901 * M, peak), "other live bytes");
        assert!(!r.repeats_state(32 * M, 900 * M, peak), "other size");
        assert!(
            !r.repeats_state(64 * M, 900 * M, peak + M),
            "a new peak forgets"
        );
        assert!(r.repeats_state(64 * M, 900 * M, peak + M));
    }

    #[test]
    fn the_allowance_stops_at_its_fraction_of_the_peak() {
        let mut r = Repeats::default();
        let peak = 1_000 * M;
        let got = run(&mut r, 10, 531 * M, peak, 0);
        assert_eq!(
            *got.last().unwrap(),
            (peak as f64 * REPEAT_ALLOWANCE) as u64
        );
        // Never lowered: an allowance above the cap (the peak is lifetime, so only by a
        // caller's own value) stays.
        assert_eq!(r.on_stitch(531 * M, peak, 50 * M), 50 * M);
    }
}
