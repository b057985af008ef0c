//! `FaultyDriver`: a wrapper that makes chosen driver calls fail, on a schedule or at random
//! (seeded), to prove that every failure leaves the allocator consistent and leak-free.
#![forbid(unsafe_code)]

use super::forward::{Call, Forward};
use super::{code, Driver, DriverError, DriverOp, DriverResult};
use parking_lot::Mutex;

/// Every kind of call the allocator makes after start-up, i.e. every kind worth failing.
pub const INJECTABLE: [DriverOp; 10] = [
    DriverOp::Reserve,
    DriverOp::Create,
    DriverOp::Release,
    DriverOp::Map,
    DriverOp::Unmap,
    DriverOp::SetAccess,
    DriverOp::RecordEvent,
    DriverOp::QueryEvent,
    DriverOp::WaitEvent,
    DriverOp::DestroyEvent,
];

#[derive(Debug)]
struct Plan {
    on: bool,
    /// Calls of each kind so far.
    seen: [u64; DriverOp::ALL.len()],
    /// Fail the n-th call (1-based) of a kind.
    at: Vec<(DriverOp, u64)>,
    /// Fail each call of the listed kinds with this probability.
    prob: f64,
    kinds: Vec<DriverOp>,
    rng: u64,
    /// Failures injected so far.
    injected: u64,
}

/// Wraps a driver and fails chosen calls with code [`code::INJECTED`] (or
/// [`code::OUT_OF_MEMORY`] for `create`, as a real device would).
///
/// ```
/// use stitch_alloc::driver::{Driver, DriverOp, FaultyDriver, SimDriver};
/// let d = FaultyDriver::new(SimDriver::with_capacity(1 << 30));
/// d.fail_nth(DriverOp::Create, 2);
/// let a = d.create(2 << 20).unwrap();
/// assert!(d.create(2 << 20).is_err(), "the second create fails");
/// d.release(a).unwrap();
/// assert_eq!(d.faults_fired(), 1);
/// ```
#[derive(Debug)]
pub struct FaultyDriver<D> {
    inner: D,
    plan: Mutex<Plan>,
}

impl<D: Driver> FaultyDriver<D> {
    /// A wrapper that fails nothing until told to.
    pub fn new(inner: D) -> Self {
        FaultyDriver {
            inner,
            plan: Mutex::new(Plan {
                on: true,
                seen: [0; DriverOp::ALL.len()],
                at: Vec::new(),
                prob: 0.0,
                kinds: Vec::new(),
                rng: 1,
                injected: 0,
            }),
        }
    }

    /// The wrapped driver.
    pub fn inner(&self) -> &D {
        &self.inner
    }

    /// Fail the `n`-th call (counting from 1, from now) of kind `op`.
    pub fn fail_nth(&self, op: DriverOp, n: u64) {
        let mut p = self.plan.lock();
        let base = p.seen[op as usize];
        p.at.push((op, base + n));
    }

    /// Fail each call of the given kinds with probability `prob`, drawn from `seed`.
    pub fn fail_randomly(&self, kinds: &[DriverOp], prob: f64, seed: u64) {
        let mut p = self.plan.lock();
        p.kinds = kinds.to_vec();
        p.prob = prob;
        p.rng = seed | 1;
    }

    /// Turn injection on or off (calls are still counted).
    pub fn set_enabled(&self, on: bool) {
        self.plan.lock().on = on;
    }

    /// Faults injected (calls failed on purpose) so far: a test asserts on it that a fault
    /// fired.
    pub fn faults_fired(&self) -> u64 {
        self.plan.lock().injected
    }

    /// The same as [`FaultyDriver::faults_fired`].
    pub fn injected(&self) -> u64 {
        self.faults_fired()
    }

    fn check(&self, op: DriverOp) -> DriverResult<()> {
        let mut p = self.plan.lock();
        p.seen[op as usize] += 1;
        let n = p.seen[op as usize];
        if !p.on {
            return Ok(());
        }
        let mut fail = false;
        if let Some(pos) = p.at.iter().position(|&(o, k)| o == op && k == n) {
            p.at.swap_remove(pos);
            fail = true;
        }
        if !fail && p.prob > 0.0 && p.kinds.contains(&op) {
            // xorshift64*
            p.rng ^= p.rng >> 12;
            p.rng ^= p.rng << 25;
            p.rng ^= p.rng >> 27;
            let r = p.rng.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11;
            fail = (r as f64) < p.prob * (1u64 << 53) as f64;
        }
        if fail {
            p.injected += 1;
            let c = if op == DriverOp::Create {
                code::OUT_OF_MEMORY
            } else {
                code::INJECTED
            };
            return Err(DriverError::new(
                op,
                c,
                format!("injected failure of {op} call {n}"),
            ));
        }
        Ok(())
    }
}

impl<D: Driver> Forward for FaultyDriver<D> {
    type Inner = D;
    fn inner(&self) -> &D {
        &self.inner
    }
    /// Counts the call and fails it when the plan says so (copies are never failed).
    fn before(&self, call: &Call) -> DriverResult<()> {
        match call.op() {
            DriverOp::Copy => Ok(()),
            op => self.check(op),
        }
    }
}
