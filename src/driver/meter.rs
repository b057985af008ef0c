//! Metering: the one driver wrapper that counts every call, measures its wall time and prices
//! it with the cost model ([`crate::cost`]), by kind.
//!
//! [`Metering`] is a [`Forward`] wrapper whose hook records each call into a [`Meter`]. The
//! meter prices a call with the exact size of the handle or mapping it touches, which it
//! learns by keeping the handles and mappings the calls created in a ledger (the CPU
//! backends' bookkeeping, used here without its rule checks). Failed calls are priced too
//! (the GPU would have spent the time).
//!
//! Two ownerships of the same wrapper:
//! * [`Timed<D>`] owns its meter (the C ABI reads [`Metering::timings`] through the
//!   allocator's driver);
//! * [`Metered<D>`] shares an `Arc<Meter>` that the caller keeps (replays read the modeled
//!   time while the allocator owns the driver).
#![forbid(unsafe_code)]

use super::forward::{Call, Done, Forward};
use super::ledger::Ledger;
use super::{CallCounts, Driver, DriverError, DriverOp};
use crate::cost::CostModel;
use parking_lot::Mutex;
use std::borrow::Borrow;
use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

const KINDS: usize = DriverOp::ALL.len();

/// Size assumed for a released handle the meter never saw created.
const UNKNOWN_HANDLE_SIZE: u64 = 2 << 20;

#[derive(Debug)]
struct MeterState {
    /// Handles and mappings the metered calls created and have not yet given back; its
    /// `calls` counts every call seen, failed ones included.
    ledger: Ledger,
    /// Wall time inside the inner driver, by kind.
    ns: [u64; KINDS],
    /// Modeled microseconds, by kind.
    us: [f64; KINDS],
    /// Modeled microseconds in all, summed call by call (so that it does not depend on the
    /// order in which the kinds are added up).
    total_us: f64,
    /// Measured driver time of each request [`Meter::scoped`] ran that called the driver.
    requests: RequestTimes,
}

/// Buckets of [`RequestTimes`]: a quarter of a power of two each (values within 19%).
const REQUEST_BUCKETS: usize = 4 * 64;

/// A histogram of per-request driver time: log-spaced buckets, the exact maximum.
#[derive(Debug, Clone)]
struct RequestTimes {
    /// `counts[b]`: requests whose nanoseconds fell in bucket `b` (see [`bucket`]).
    counts: Vec<u64>,
    count: u64,
    max_ns: u64,
}

impl RequestTimes {
    fn new() -> Self {
        RequestTimes {
            counts: vec![0; REQUEST_BUCKETS],
            count: 0,
            max_ns: 0,
        }
    }
    fn add(&mut self, ns: u64) {
        self.counts[bucket(ns)] += 1;
        self.count += 1;
        self.max_ns = self.max_ns.max(ns);
    }
    /// The upper bound of the bucket holding the `q`-quantile (capped at the maximum).
    fn quantile_ns(&self, q: f64) -> u64 {
        if self.count == 0 {
            return 0;
        }
        let rank = ((q * self.count as f64).ceil() as u64).clamp(1, self.count);
        let mut seen = 0;
        for (b, &n) in self.counts.iter().enumerate() {
            seen += n;
            if seen >= rank {
                return bucket_upper(b).min(self.max_ns);
            }
        }
        self.max_ns
    }
}

/// The bucket of `ns`: `floor(4 * log2(ns))`, 0 for 0 and 1.
fn bucket(ns: u64) -> usize {
    if ns < 2 {
        return 0;
    }
    let lz = 63 - ns.leading_zeros() as u64; // floor(log2)
                                             // The next two bits below the leading one pick the quarter (an approximation of the
                                             // fractional part of the logarithm: buckets are evenly spaced in value within an octave).
    let frac = if lz >= 2 {
        (ns >> (lz - 2)) & 3
    } else {
        (ns << (2 - lz)) & 3
    };
    ((lz * 4 + frac) as usize).min(REQUEST_BUCKETS - 1)
}

/// The largest value of bucket `b`.
fn bucket_upper(b: usize) -> u64 {
    let (lz, frac) = ((b / 4) as u32, (b % 4) as u64);
    if lz < 2 {
        return (1u64 << lz) + 1;
    }
    let step = 1u128 << (lz - 2);
    let end = (1u128 << lz) + (u128::from(frac) + 1) * step - 1;
    u64::try_from(end).unwrap_or(u64::MAX)
}

/// Driver time of requests (allocations that called the driver), from [`Meter::request_times`].
#[derive(Copy, Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct RequestTiming {
    /// Requests that called the driver at least once.
    pub count: u64,
    /// Median of their driver time, microseconds (bucket resolution: within 19%).
    pub p50_us: f64,
    /// 99th percentile, microseconds (same resolution).
    pub p99_us: f64,
    /// The slowest one, microseconds (exact).
    pub max_us: f64,
}

thread_local! {
    /// (calls, nanoseconds) measured inside the driver on this thread, by every metering
    /// wrapper.
    static THREAD_NS: std::cell::Cell<(u64, u64)> = const { std::cell::Cell::new((0, 0)) };
}

/// Nanoseconds measured inside driver calls on this thread so far, by every metering
/// wrapper (what [`Meter::scoped`] reads; the C ABI's call clock subtracts it).
#[cfg_attr(not(feature = "capi"), allow(dead_code))]
pub(crate) fn thread_driver_ns() -> u64 {
    THREAD_NS.with(|c| c.get().1)
}

/// What a [`Metering`] driver recorded: calls, measured time and modeled time, by kind.
#[derive(Debug)]
pub struct Meter {
    cost: CostModel,
    state: Mutex<MeterState>,
}

impl Meter {
    /// A shared meter pricing with `cost` (for [`Metered`]).
    pub fn new(cost: CostModel) -> Arc<Self> {
        Arc::new(Self::unshared(cost))
    }

    /// A meter pricing with `cost`, to be owned by one wrapper (for [`Timed`]).
    pub fn unshared(cost: CostModel) -> Self {
        Meter {
            cost,
            state: Mutex::new(MeterState {
                // No granularity or capacity rule is checked: any power of two will do.
                ledger: Ledger::new(1, u64::MAX),
                ns: [0; KINDS],
                us: [0.0; KINDS],
                total_us: 0.0,
                requests: RequestTimes::new(),
            }),
        }
    }

    /// Run one request (an allocation) and, if it called the driver on this thread,
    /// record how long it spent there ([`Meter::request_times`]).
    ///
    /// ```
    /// use stitch_alloc::driver::{Driver, SimDriver, Timed};
    /// let d = Timed::new(SimDriver::with_capacity(1 << 30));
    /// let va = d.meter().scoped(|| d.reserve(1 << 21).unwrap());
    /// d.meter().scoped(|| ()); // no driver call: not counted
    /// assert_eq!(d.meter().request_times().count, 1);
    /// d.free_reservation(va, 1 << 21).unwrap();
    /// ```
    pub fn scoped<T>(&self, f: impl FnOnce() -> T) -> T {
        let (calls0, ns0) = THREAD_NS.with(|c| c.get());
        let r = f();
        let (calls1, ns1) = THREAD_NS.with(|c| c.get());
        if calls1 != calls0 {
            self.state.lock().requests.add(ns1 - ns0);
        }
        r
    }

    /// The distribution of per-request driver time recorded by [`Meter::scoped`].
    pub fn request_times(&self) -> RequestTiming {
        let s = self.state.lock();
        let r = &s.requests;
        RequestTiming {
            count: r.count,
            p50_us: r.quantile_ns(0.5) as f64 / 1e3,
            p99_us: r.quantile_ns(0.99) as f64 / 1e3,
            max_us: r.max_ns as f64 / 1e3,
        }
    }

    /// The cost model in use.
    pub fn cost_model(&self) -> &CostModel {
        &self.cost
    }

    /// Modeled microseconds so far.
    pub fn total_us(&self) -> f64 {
        self.state.lock().total_us
    }

    /// Modeled microseconds so far, by call kind (kinds never called are left out).
    pub fn by_call(&self) -> BTreeMap<&'static str, f64> {
        let s = self.state.lock();
        DriverOp::ALL
            .iter()
            .zip(s.us.iter())
            .filter(|(_, &us)| us > 0.0)
            .map(|(op, &us)| (op.name(), us))
            .collect()
    }

    /// Modeled microseconds and calls so far, read together ([`Meter::total_us`],
    /// [`Meter::calls`]).
    ///
    /// ```
    /// use stitch_alloc::driver::{Driver, SimDriver, Timed, DriverOp};
    /// let d = Timed::new(SimDriver::with_capacity(1 << 30));
    /// let va = d.reserve(1 << 21).unwrap();
    /// let (us, calls) = d.meter().totals();
    /// assert_eq!((us, calls.get(DriverOp::Reserve)), (d.meter().total_us(), 1));
    /// d.free_reservation(va, 1 << 21).unwrap();
    /// ```
    pub fn totals(&self) -> (f64, CallCounts) {
        let s = self.state.lock();
        (s.total_us, s.ledger.calls)
    }

    /// Calls seen so far, by kind (failed ones included).
    pub fn calls(&self) -> CallCounts {
        self.state.lock().ledger.calls
    }

    /// The counts and times so far.
    pub fn timings(&self) -> Timings {
        let s = self.state.lock();
        Timings(std::array::from_fn(|i| {
            let op = DriverOp::ALL[i];
            OpTiming {
                op,
                calls: s.ledger.calls.get(op),
                measured_ns: s.ns[i],
                modeled_ns: (s.us[i] * 1e3) as u64,
                modeled: self.cost.price(op, 0).is_some(),
            }
        }))
    }

    /// Zero the counts and times (the handle and mapping tables are kept, so later calls
    /// are still priced with their sizes).
    pub fn reset(&self) {
        let mut s = self.state.lock();
        s.ledger.calls = CallCounts::default();
        s.ns = [0; KINDS];
        s.us = [0.0; KINDS];
        s.total_us = 0.0;
        s.requests = RequestTimes::new();
    }

    /// Count, time and price one call the inner driver returned from.
    fn record(&self, call: &Call, result: Result<Done, &DriverError>, ns: u64, devices: u32) {
        let c = &self.cost;
        let op = call.op();
        let mut s = self.state.lock();
        let l = &mut s.ledger;
        l.calls.add(op);
        let us = match *call {
            Call::Create { size } => {
                if let Ok(Done::Handle(h)) = result {
                    l.commit_create_as(h.0, size);
                }
                c.price(op, size)
            }
            Call::Release { handle } => {
                let size = l.handles.get(&handle.0).map(|i| i.size);
                if result.is_ok() {
                    l.commit_release(handle);
                }
                c.price(op, size.unwrap_or(UNKNOWN_HANDLE_SIZE))
            }
            Call::Map { addr, size, handle } => {
                if result.is_ok() {
                    l.commit_map(addr, size, handle);
                }
                c.price(op, size)
            }
            Call::Unmap { addr, size } => {
                if result.is_ok() {
                    l.commit_unmap(addr);
                }
                c.price(op, size)
            }
            // One call per mapping the range covers (anchors: cost follows handles).
            // Per device granted access too (the owner and its peers).
            Call::SetAccess { addr, size } => Some(
                c.price_set_access_devices(
                    l.mappings
                        .range(addr..addr.saturating_add(size))
                        .map(|(_, m)| m.size),
                    size,
                    devices,
                ),
            ),
            Call::Reserve { size } | Call::FreeReservation { size, .. } => c.price(op, size),
            _ => c.price(op, 0),
        };
        s.ns[op as usize] += ns;
        THREAD_NS.with(|c| {
            let (n, t) = c.get();
            c.set((n + 1, t + ns));
        });
        if let Some(us) = us {
            s.us[op as usize] += us;
            s.total_us += us;
        }
    }
}

/// Measured and modeled time of one kind of call.
#[derive(Copy, Clone, Debug, PartialEq, serde::Serialize)]
pub struct OpTiming {
    /// The kind of call.
    pub op: DriverOp,
    /// Calls made (failed ones included).
    pub calls: u64,
    /// Wall time spent inside them, in nanoseconds.
    pub measured_ns: u64,
    /// What the cost model predicts for them, in nanoseconds (0 when it prices none).
    pub modeled_ns: u64,
    /// Whether the model prices this kind at all.
    pub modeled: bool,
}

/// Timings of every kind of call, from [`Metering::timings`].
#[derive(Clone, Debug, PartialEq)]
pub struct Timings(pub [OpTiming; KINDS]);

impl Timings {
    /// The timing of `op`.
    pub fn get(&self, op: DriverOp) -> OpTiming {
        self.0[op as usize]
    }
    /// Every kind, in [`DriverOp::ALL`] order.
    pub fn iter(&self) -> impl Iterator<Item = OpTiming> + '_ {
        self.0.iter().copied()
    }
    /// Measured nanoseconds over all calls.
    pub fn measured_ns(&self) -> u64 {
        self.0.iter().map(|t| t.measured_ns).sum()
    }
    /// Measured nanoseconds over the kinds the model prices (to compare with
    /// [`Timings::modeled_ns`]).
    pub fn measured_modeled_kinds_ns(&self) -> u64 {
        self.0
            .iter()
            .filter(|t| t.modeled)
            .map(|t| t.measured_ns)
            .sum()
    }
    /// Modeled nanoseconds over all priced calls.
    pub fn modeled_ns(&self) -> u64 {
        self.0.iter().map(|t| t.modeled_ns).sum()
    }
}

impl fmt::Display for Timings {
    /// A table: one row per kind with calls, measured and modeled milliseconds, their ratio
    /// and the measured mean per call; then the totals.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{:<17} {:>8} {:>12} {:>12} {:>9} {:>12}",
            "call", "count", "measured_ms", "modeled_ms", "meas/mod", "us_per_call"
        )?;
        let ms = |ns: u64| ns as f64 / 1e6;
        for t in self.iter().filter(|t| t.calls > 0) {
            let name = t.op.name();
            let modeled = if t.modeled {
                format!("{:.3}", ms(t.modeled_ns))
            } else {
                "-".into()
            };
            let ratio = if t.modeled && t.modeled_ns > 0 {
                format!("{:.2}", t.measured_ns as f64 / t.modeled_ns as f64)
            } else {
                "-".into()
            };
            writeln!(
                f,
                "{:<17} {:>8} {:>12.3} {:>12} {:>9} {:>12.2}",
                name,
                t.calls,
                ms(t.measured_ns),
                modeled,
                ratio,
                t.measured_ns as f64 / 1e3 / t.calls as f64
            )?;
        }
        let (m, p) = (self.measured_modeled_kinds_ns(), self.modeled_ns());
        writeln!(
            f,
            "priced calls: measured {:.3} ms, modeled {:.3} ms, measured/modeled {:.2}; all calls measured {:.3} ms",
            ms(m),
            ms(p),
            if p > 0 { m as f64 / p as f64 } else { 0.0 },
            ms(self.measured_ns())
        )
    }
}

/// A [`Driver`] that forwards every call to `D` and records it into a [`Meter`] (`M` is the
/// meter or a shared `Arc` of one): count, wall time inside the call, and the cost model's
/// price for it.
///
/// Works over any backend: on `CudaDriver` it measures the real driver; on the CPU backends
/// it measures their bookkeeping and still prices the calls as an H200 would.
pub struct Metering<D, M> {
    inner: D,
    meter: M,
}

/// A [`Metering`] driver that owns its meter, pricing with the H200 table.
///
/// ```
/// use stitch_alloc::driver::{DriverOp, SimDriver, Timed};
/// use stitch_alloc::{Allocator, Config, Stream};
/// let a = Allocator::new(Timed::new(SimDriver::with_capacity(1 << 30)), Config::default())
///     .unwrap();
/// let p = a.alloc(64 << 20, Stream::DEFAULT).unwrap();
/// a.free(p, Stream::DEFAULT).unwrap();
/// let t = a.driver().timings();
/// assert_eq!(t.get(DriverOp::Create).calls, a.stats().calls.get(DriverOp::Create));
/// assert!(t.modeled_ns() > 0);
/// println!("{t}");
/// ```
pub type Timed<D> = Metering<D, Meter>;

/// A [`Metering`] driver recording into a meter the caller shares (replays).
///
/// ```
/// use stitch_alloc::cost::CostModel;
/// use stitch_alloc::driver::{Meter, Metered, SimDriver};
/// use stitch_alloc::{Allocator, Config, Stream};
/// let meter = Meter::new(CostModel::h200());
/// let a = Allocator::new(Metered::new(SimDriver::with_capacity(1 << 30), meter.clone()),
///     Config::default()).unwrap();
/// a.alloc(64 << 20, Stream::DEFAULT).unwrap();
/// assert!(meter.total_us() > 0.0);
/// ```
pub type Metered<D> = Metering<D, Arc<Meter>>;

impl<D: fmt::Debug, M> fmt::Debug for Metering<D, M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Metering")
            .field("inner", &self.inner)
            .finish()
    }
}

impl<D: Driver> Metering<D, Meter> {
    /// Wrap `inner` with a meter of its own, pricing with [`CostModel::h200`].
    pub fn new(inner: D) -> Self {
        Metering {
            inner,
            meter: Meter::unshared(CostModel::h200()),
        }
    }
}

impl<D: Driver> Metering<D, Arc<Meter>> {
    /// Wrap `inner`, recording into `meter`.
    pub fn new(inner: D, meter: Arc<Meter>) -> Self {
        Metering { inner, meter }
    }
}

impl<D, M: Borrow<Meter>> Metering<D, M> {
    /// The wrapped driver.
    pub fn inner(&self) -> &D {
        &self.inner
    }
    /// The meter (a shared `Arc` for [`Metered`]).
    pub fn meter(&self) -> &M {
        &self.meter
    }
    /// The counts and times so far ([`Meter::timings`]).
    pub fn timings(&self) -> Timings {
        self.meter.borrow().timings()
    }
    /// Zero the counts and times ([`Meter::reset`]).
    pub fn reset(&self) {
        self.meter.borrow().reset()
    }
}

impl<D: Driver, M: Borrow<Meter> + Send + Sync> Forward for Metering<D, M> {
    type Inner = D;
    const MEASURE: bool = true;
    fn inner(&self) -> &D {
        &self.inner
    }
    fn after(&self, call: &Call, result: Result<Done, &DriverError>, elapsed_ns: u64) {
        let devices = if matches!(call, Call::SetAccess { .. }) {
            self.inner.access_devices()
        } else {
            1
        };
        self.meter
            .borrow()
            .record(call, result, elapsed_ns, devices);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::SimDriver;
    use crate::{Allocator, Config, Stream};

    const MIB: u64 = 1 << 20;

    #[test]
    fn request_buckets_are_ordered_and_bound_their_values() {
        let mut prev = 0;
        for ns in [
            0u64,
            1,
            2,
            3,
            4,
            5,
            7,
            8,
            100,
            1_000,
            12_345,
            1 << 40,
            u64::MAX,
        ] {
            let b = bucket(ns);
            assert!(b >= prev, "bucket of {ns} below the one of a smaller value");
            assert!(ns <= bucket_upper(b), "{ns} above its bucket's bound");
            if ns >= 4 {
                assert!(
                    bucket_upper(b) as f64 <= ns as f64 * 1.25 + 1.0,
                    "{ns}: too coarse"
                );
            }
            prev = b;
        }
        let mut r = RequestTimes::new();
        for ns in 1..=1000u64 {
            r.add(ns * 1000);
        }
        let (p50, p99) = (r.quantile_ns(0.5), r.quantile_ns(0.99));
        assert!((500_000..=625_000).contains(&p50), "p50 {p50}");
        assert!((990_000..=1_000_000).contains(&p99), "p99 {p99}");
        assert_eq!(r.max_ns, 1_000_000);
    }

    #[test]
    fn scoped_requests_count_only_this_threads_driver_calls() {
        let d = Timed::new(SimDriver::with_capacity(1 << 30));
        let a = Allocator::new(d, Config::default()).unwrap();
        let m = a.driver().meter();
        let p = m.scoped(|| a.alloc(64 * MIB, Stream::DEFAULT).unwrap());
        let q = m.scoped(|| a.alloc(4096, Stream::DEFAULT).unwrap());
        let fast = m.scoped(|| a.alloc(4096, Stream::DEFAULT).unwrap()); // same page: no call
        let t = m.request_times();
        assert_eq!(t.count, 2, "{t:?}");
        assert!(
            t.max_us > 0.0 && t.p50_us <= t.max_us && t.p99_us <= t.max_us,
            "{t:?}"
        );
        // Another thread's driver calls during a request are not this request's.
        std::thread::scope(|sc| {
            sc.spawn(|| a.alloc(32 * MIB, Stream::DEFAULT).unwrap());
        });
        m.scoped(|| ());
        assert_eq!(m.request_times().count, 2);
        for x in [p, q, fast] {
            a.free(x, Stream::DEFAULT).unwrap();
        }
    }

    #[test]
    fn counts_match_the_allocator_and_set_access_is_priced_per_mapping() {
        let a = Allocator::new(
            Timed::new(SimDriver::with_capacity(1 << 30)),
            Config::default().with_handle_sizes(0, 2 * MIB),
        )
        .unwrap();
        let p = a.alloc(16 * MIB, Stream::DEFAULT).unwrap();
        a.free(p, Stream::DEFAULT).unwrap();
        a.empty_cache().unwrap();
        let t = a.driver().timings();
        let calls = a.stats().calls;
        for op in DriverOp::ALL {
            if op != DriverOp::MemInfo {
                assert_eq!(t.get(op).calls, calls.get(op), "{op}");
            }
        }
        // 8 handles of 2 MiB: 8 creates, maps, unmaps and releases, and access for 8
        // mappings however many set_access calls covered them.
        assert_eq!(t.get(DriverOp::Create).calls, 8);
        assert_eq!(t.get(DriverOp::Create).modeled_ns, 8 * 11_000);
        assert_eq!(t.get(DriverOp::Release).modeled_ns, 8 * 12_000);
        assert_eq!(t.get(DriverOp::Unmap).modeled_ns, 8 * 18_000);
        let sa = t.get(DriverOp::SetAccess);
        let per_mapping = 8 * 26_500;
        assert!(
            sa.modeled_ns >= per_mapping && sa.modeled_ns < per_mapping + 8 * 8 * 33 + 1,
            "{sa:?}"
        );
        assert!(t.measured_ns() > 0);
        let table = t.to_string();
        assert!(table.contains("set_access") && table.contains("measured/modeled"));
        a.driver().reset();
        assert_eq!(a.driver().timings().measured_ns(), 0);
        assert_eq!(a.driver().timings().get(DriverOp::Create).calls, 0);
        assert!(a.driver().inner().leak_report().reservations > 0);
    }

    /// A driver with two peers (issue #14: access for a peer is set once per mapping and
    /// priced): SetAccess costs three times the one-device price, nothing else changes.
    #[test]
    fn set_access_is_priced_per_device_granted_access() {
        struct Peers(SimDriver);
        impl crate::driver::Forward for Peers {
            type Inner = SimDriver;
            fn inner(&self) -> &SimDriver {
                &self.0
            }
            fn forward_access_devices(&self) -> u32 {
                3
            }
        }
        let run = |peers: bool| {
            let sim = SimDriver::with_capacity(1 << 30);
            let cfg = Config::default().with_handle_sizes(0, 2 * MIB);
            let t = if peers {
                let a = Allocator::new(Timed::new(Peers(sim)), cfg).unwrap();
                let p = a.alloc(16 * MIB, Stream::DEFAULT).unwrap();
                a.free(p, Stream::DEFAULT).unwrap();
                a.driver().timings()
            } else {
                let a = Allocator::new(Timed::new(sim), cfg).unwrap();
                let p = a.alloc(16 * MIB, Stream::DEFAULT).unwrap();
                a.free(p, Stream::DEFAULT).unwrap();
                a.driver().timings()
            };
            (t.get(DriverOp::SetAccess), t.get(DriverOp::Create))
        };
        let (one, c1) = run(false);
        let (three, c3) = run(true);
        assert_eq!(one.calls, three.calls);
        assert!(one.modeled_ns > 0);
        let ratio = three.modeled_ns as f64 / one.modeled_ns as f64;
        assert!((ratio - 3.0).abs() < 1e-3, "{ratio}");
        assert_eq!(c1.modeled_ns, c3.modeled_ns);
    }

    #[test]
    fn failed_calls_are_counted_and_priced_and_sizes_come_from_the_calls() {
        let meter = Meter::new(CostModel::h200());
        let d = Metered::new(SimDriver::with_capacity(64 * MIB), meter.clone());
        assert!(d.create(128 * MIB).is_err(), "over capacity");
        let h = d.create(64 * MIB).unwrap();
        let va = d.reserve(64 * MIB).unwrap();
        d.map(va, 64 * MIB, h).unwrap();
        d.set_access(va, 64 * MIB).unwrap();
        d.unmap(va, 64 * MIB).unwrap();
        d.release(h).unwrap();
        d.free_reservation(va, 64 * MIB).unwrap();
        let c = CostModel::h200();
        let by = meter.by_call();
        assert_eq!(by["create"], c.create.at(128 * MIB) + c.create.at(64 * MIB));
        assert_eq!(
            by["release"], 40.0,
            "priced with the size it was created with"
        );
        assert_eq!(by["set_access"], 43.5 + c.set_access_quadratic);
        assert_eq!(meter.calls().get(DriverOp::Create), 2);
        let sum: f64 = by.values().sum();
        assert!((meter.total_us() - sum).abs() < 1e-9);
        assert_eq!(d.timings().get(DriverOp::Copy).calls, 0);
    }
}
