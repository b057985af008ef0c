//! The C ABI's own time: how long `stitch_malloc` and `stitch_free` take from entry to
//! return (lock, engine, any driver call). The driver calls inside them are measured on
//! every call (the metering wrapper times each one anyway); the rest, the host part, is
//! timed on every [`SAMPLE_EVERY`]th call and scaled, so that the clock itself costs a few
//! nanoseconds a call. (Sampling the whole call instead misses most of the rare calls that
//! go to the driver: through torch it gave 13.8 ms where the driver alone took 229.8 ms,
//! design/gpu-results.md run 61.) Issue #11's throughput question asks what the allocator
//! costs inside torch; the per-step share of this figure bounds what stitch-alloc's own
//! calls can take from a step, on a machine whose process-to-process spread hides a 1%
//! difference (design/gpu-results.md runs 52-54, 60).
#![forbid(unsafe_code)]

use crate::driver::meter::thread_driver_ns;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// One call in this many is timed; the estimate scales the timed ones by it.
pub(super) const SAMPLE_EVERY: u64 = 64;

/// Counts the calls, sums their driver time and the sampled ones' host time (process-wide,
/// every device).
#[derive(Debug, Default)]
pub(super) struct ApiClock {
    /// Calls entered.
    calls: AtomicU64,
    /// Invariant: the wall time minus the driver time of calls number 0, `SAMPLE_EVERY`,
    /// `2 * SAMPLE_EVERY`, ... (counted from 0 in the order they entered), summed.
    host_sampled_ns: AtomicU64,
    /// Invariant: the driver time measured on the calling thread during every call, summed.
    driver_ns: AtomicU64,
}

/// What [`ApiClock::estimate`] reports.
#[derive(Copy, Clone, Debug, Default, PartialEq)]
pub(super) struct ApiTime {
    /// `stitch_malloc` and `stitch_free` calls made.
    pub(super) calls: u64,
    /// Their time in all, microseconds: the driver time measured in every call plus the
    /// sampled calls' host time times [`SAMPLE_EVERY`].
    pub(super) estimated_us: f64,
}

impl ApiClock {
    /// Run `f`, timing it when its call number is a multiple of [`SAMPLE_EVERY`].
    #[inline]
    pub(super) fn time<T>(&self, f: impl FnOnce() -> T) -> T {
        let n = self.calls.fetch_add(1, Ordering::Relaxed);
        let d0 = thread_driver_ns();
        let t = (n % SAMPLE_EVERY == 0).then(Instant::now);
        let r = f();
        let driver = thread_driver_ns().saturating_sub(d0);
        if driver > 0 {
            self.driver_ns.fetch_add(driver, Ordering::Relaxed);
        }
        if let Some(t) = t {
            let wall = u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX);
            self.host_sampled_ns
                .fetch_add(wall.saturating_sub(driver), Ordering::Relaxed);
        }
        r
    }

    /// Calls so far and their estimated time.
    pub(super) fn estimate(&self) -> ApiTime {
        let host = self.host_sampled_ns.load(Ordering::Relaxed) * SAMPLE_EVERY;
        ApiTime {
            calls: self.calls.load(Ordering::Relaxed),
            estimated_us: (host + self.driver_ns.load(Ordering::Relaxed)) as f64 / 1e3,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn spin(d: Duration) {
        let t = Instant::now();
        while t.elapsed() < d {}
    }

    #[test]
    fn counts_every_call_and_times_one_in_sample_every() {
        let c = ApiClock::default();
        assert_eq!(c.estimate(), ApiTime::default());
        for _ in 0..SAMPLE_EVERY {
            c.time(|| ());
        }
        assert_eq!(c.estimate().calls, SAMPLE_EVERY);
        // Only call 0 was timed so far; call SAMPLE_EVERY is the next.
        let before = c.estimate().estimated_us;
        c.time(|| spin(Duration::from_millis(2)));
        let after = c.estimate().estimated_us;
        assert!(
            after - before >= 2_000.0 * SAMPLE_EVERY as f64,
            "{before} -> {after}"
        );
        assert_eq!(c.time(|| 7), 7);
        assert_eq!(c.estimate().calls, SAMPLE_EVERY + 2);
    }

    #[test]
    fn the_estimate_follows_calls_of_equal_length() {
        let c = ApiClock::default();
        let t = Instant::now();
        for _ in 0..4 * SAMPLE_EVERY {
            c.time(|| spin(Duration::from_micros(50)));
        }
        let real_us = t.elapsed().as_secs_f64() * 1e6;
        let est = c.estimate().estimated_us;
        // Each call spins at least 50 us; a preempted sample can only lengthen one.
        assert!(est >= 4.0 * SAMPLE_EVERY as f64 * 50.0, "{est}");
        assert!(est < 4.0 * real_us, "{est} against {real_us} measured");
    }
}
