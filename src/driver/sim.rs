//! `SimDriver`: a deterministic, accounting-only device. No memory is touched, so it runs at
//! any scale (hundreds of GiB, 100k+ handles); every CUDA VMM rule is enforced and every call
//! is counted.
#![forbid(unsafe_code)]

use super::ledger::{LeakReport, Ledger};
use super::streams::WorkId;
use super::{
    code, CallCounts, DevAddr, Driver, DriverError, DriverOp, DriverResult, EventId, MemInfo,
    PhysHandle, Stream,
};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

/// The H200's usable device memory as the simulator's default capacity: 139.8 GiB, rounded
/// down to the 2 MiB granularity.
pub const H200_CAPACITY: u64 = 71_577 * (2 << 20);

/// The granularity of current NVIDIA GPUs: 2 MiB.
pub const GPU_GRANULARITY: u64 = 2 << 20;

/// An accounting-only device that enforces the CUDA VMM rules.
///
/// ```
/// use stitch_alloc::driver::{Driver, SimDriver};
/// let sim = SimDriver::with_capacity(64 << 20);
/// let va = sim.reserve(8 << 20).unwrap();
/// let h = sim.create(4 << 20).unwrap();
/// sim.map(va, 4 << 20, h).unwrap();
/// sim.set_access(va, 4 << 20).unwrap();
/// assert!(sim.release(h).is_err(), "a mapped handle cannot be released");
/// sim.unmap(va, 4 << 20).unwrap();
/// sim.release(h).unwrap();
/// sim.free_reservation(va, 8 << 20).unwrap();
/// assert!(sim.leak_report().is_clean());
/// ```
#[derive(Debug)]
pub struct SimDriver {
    inner: Mutex<Ledger>,
    panic_on_leak: AtomicBool,
}

impl Default for SimDriver {
    fn default() -> Self {
        Self::new()
    }
}

impl SimDriver {
    /// A simulated H200: 139.8 GiB, 2 MiB granularity.
    pub fn new() -> Self {
        Self::with_config(GPU_GRANULARITY, H200_CAPACITY)
    }

    /// A simulated device of `capacity` bytes (rounded down to 2 MiB).
    pub fn with_capacity(capacity: u64) -> Self {
        Self::with_config(GPU_GRANULARITY, capacity)
    }

    /// A simulated device with a chosen granularity (a power of two) and capacity.
    pub fn with_config(granularity: u64, capacity: u64) -> Self {
        SimDriver {
            inner: Mutex::new(Ledger::new(granularity, capacity)),
            panic_on_leak: AtomicBool::new(true),
        }
    }

    /// Calls made so far, by kind.
    pub fn calls(&self) -> CallCounts {
        self.inner.lock().calls
    }

    /// What the device still holds (handles, mappings, reservations, events).
    pub fn leak_report(&self) -> LeakReport {
        self.inner.lock().leak_report()
    }

    /// Whether dropping a driver that still holds something panics (default: true, so tests
    /// notice leaks). Either way the leak is logged with `tracing::error!`.
    pub fn set_panic_on_leak(&self, on: bool) {
        self.panic_on_leak.store(on, Ordering::Relaxed);
    }

    /// Physical bytes in live handles.
    pub fn used_bytes(&self) -> u64 {
        self.inner.lock().used
    }

    /// Simulate a kernel on `stream` that touches `[addr, addr+len)`; it stays in flight until
    /// [`SimDriver::complete`] or a wait on a later event. Unmapping the range before then is
    /// refused as a use-after-free.
    pub fn launch(&self, stream: Stream, addr: DevAddr, len: u64) -> WorkId {
        self.inner.lock().streams.launch(stream, addr, len)
    }

    /// Complete the simulated work on `stream`, up to and including `upto` (all when `None`).
    pub fn complete(&self, stream: Stream, upto: Option<WorkId>) {
        self.inner.lock().streams.complete(stream, upto)
    }

    /// Whether simulated work `w` has completed.
    pub fn work_done(&self, w: WorkId) -> bool {
        self.inner.lock().streams.is_done(w)
    }

    /// Complete all simulated work on every stream.
    pub fn complete_all(&self) {
        self.inner.lock().streams.complete_all()
    }

    /// Work items still in flight.
    pub fn in_flight(&self) -> usize {
        self.inner.lock().streams.in_flight_count()
    }

    /// Number of live mappings (for tests).
    pub fn mapping_count(&self) -> usize {
        self.inner.lock().mappings.len()
    }

    #[cfg(feature = "testing")]
    /// Every live handle as `(size, addresses it is mapped at)` (read-only, for the test
    /// harness's oracle).
    pub(crate) fn handle_mappings(&self) -> Vec<(u64, Vec<DevAddr>)> {
        self.inner.lock().handle_mappings()
    }

    /// Whether `[addr, addr+len)` is fully mapped with access set.
    pub fn is_accessible(&self, addr: DevAddr, len: u64) -> bool {
        self.inner.lock().check_data(addr, len).is_ok()
    }
}

fn unknown_event(op: DriverOp, e: EventId) -> DriverError {
    DriverError::new(op, code::INVALID_HANDLE, format!("unknown event {}", e.0))
}

impl super::SimulatedWork for SimDriver {
    fn launch(&self, stream: Stream, addr: DevAddr, len: u64) -> WorkId {
        SimDriver::launch(self, stream, addr, len)
    }
    fn complete(&self, stream: Stream, upto: Option<WorkId>) {
        SimDriver::complete(self, stream, upto)
    }
    fn work_done(&self, w: WorkId) -> bool {
        SimDriver::work_done(self, w)
    }
}

impl Driver for SimDriver {
    fn name(&self) -> &'static str {
        "sim"
    }
    fn granularity(&self) -> u64 {
        self.inner.lock().granularity
    }
    fn mem_info(&self) -> DriverResult<MemInfo> {
        let mut l = self.inner.lock();
        l.calls.add(DriverOp::MemInfo);
        Ok(MemInfo {
            free: l.capacity - l.used,
            total: l.capacity,
        })
    }
    fn reserve(&self, size: u64) -> DriverResult<DevAddr> {
        let mut l = self.inner.lock();
        l.calls.add(DriverOp::Reserve);
        let base = l.find_va(size)?;
        l.check_reserve_at(base, size)?;
        l.commit_reserve(base, size);
        Ok(base)
    }
    fn free_reservation(&self, base: DevAddr, size: u64) -> DriverResult<()> {
        let mut l = self.inner.lock();
        l.calls.add(DriverOp::FreeReservation);
        l.check_free_reservation(base, size)?;
        l.commit_free_reservation(base);
        Ok(())
    }
    fn create(&self, size: u64) -> DriverResult<PhysHandle> {
        let mut l = self.inner.lock();
        l.calls.add(DriverOp::Create);
        l.check_create(size)?;
        Ok(l.commit_create(size))
    }
    fn release(&self, handle: PhysHandle) -> DriverResult<()> {
        let mut l = self.inner.lock();
        l.calls.add(DriverOp::Release);
        l.check_release(handle)?;
        l.commit_release(handle);
        Ok(())
    }
    fn map(&self, addr: DevAddr, size: u64, handle: PhysHandle) -> DriverResult<()> {
        let mut l = self.inner.lock();
        l.calls.add(DriverOp::Map);
        l.check_map(addr, size, handle)?;
        l.commit_map(addr, size, handle);
        Ok(())
    }
    fn unmap(&self, addr: DevAddr, size: u64) -> DriverResult<()> {
        let mut l = self.inner.lock();
        l.calls.add(DriverOp::Unmap);
        l.check_unmap(addr, size)?;
        l.commit_unmap(addr);
        Ok(())
    }
    fn set_access(&self, addr: DevAddr, size: u64) -> DriverResult<()> {
        let mut l = self.inner.lock();
        l.calls.add(DriverOp::SetAccess);
        l.check_set_access(addr, size)?;
        l.commit_set_access(addr, size);
        Ok(())
    }
    fn record_event(&self, stream: Stream) -> DriverResult<EventId> {
        let mut l = self.inner.lock();
        l.calls.add(DriverOp::RecordEvent);
        Ok(l.streams.record(stream))
    }
    fn query_event(&self, event: EventId) -> DriverResult<bool> {
        let mut l = self.inner.lock();
        l.calls.add(DriverOp::QueryEvent);
        l.streams
            .query(event)
            .ok_or_else(|| unknown_event(DriverOp::QueryEvent, event))
    }
    fn wait_event(&self, event: EventId) -> DriverResult<()> {
        let mut l = self.inner.lock();
        l.calls.add(DriverOp::WaitEvent);
        l.streams
            .wait(event)
            .ok_or_else(|| unknown_event(DriverOp::WaitEvent, event))
    }
    fn destroy_event(&self, event: EventId) -> DriverResult<()> {
        let mut l = self.inner.lock();
        l.calls.add(DriverOp::DestroyEvent);
        l.streams
            .destroy(event)
            .ok_or_else(|| unknown_event(DriverOp::DestroyEvent, event))
    }
    fn simulated_work(&self) -> Option<&dyn super::SimulatedWork> {
        Some(self)
    }
}

impl Drop for SimDriver {
    fn drop(&mut self) {
        let report = self.inner.get_mut().leak_report();
        if !report.is_clean() {
            tracing::error!(
                ?report,
                "SimDriver dropped while still holding device resources"
            );
            if self.panic_on_leak.load(Ordering::Relaxed) && !std::thread::panicking() {
                panic!("SimDriver leak: {report:?}");
            }
        }
    }
}
