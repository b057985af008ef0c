//! [`Forward`]: the one forwarding layer for driver wrappers.
//!
//! A wrapper implements [`Forward::inner`] (the driver it forwards to) and, optionally, the
//! hooks [`Forward::before`] (which may refuse the call: fault injection) and
//! [`Forward::after`] (which sees the outcome: metering); it then gets [`Driver`] through the
//! blanket implementation here. `Arc<D>`, [`AnyDriver`](crate::AnyDriver),
//! [`FaultyDriver`](super::FaultyDriver), [`Metered`](super::Metered) /
//! [`Timed`](super::Timed) and the GPU test device are all wrappers of this kind.
//!
//! ```
//! use stitch_alloc::driver::{Call, Driver, DriverResult, Forward, SimDriver};
//! use std::sync::atomic::{AtomicU64, Ordering};
//! /// Counts the maps it forwards.
//! struct CountMaps(SimDriver, AtomicU64);
//! impl Forward for CountMaps {
//!     type Inner = SimDriver;
//!     fn inner(&self) -> &SimDriver {
//!         &self.0
//!     }
//!     fn before(&self, call: &Call) -> DriverResult<()> {
//!         if matches!(call, Call::Map { .. }) {
//!             self.1.fetch_add(1, Ordering::Relaxed);
//!         }
//!         Ok(())
//!     }
//! }
//! let d = CountMaps(SimDriver::with_capacity(1 << 30), AtomicU64::new(0));
//! let g = d.granularity();
//! let va = d.reserve(g).unwrap();
//! let h = d.create(g).unwrap();
//! d.map(va, g, h).unwrap();
//! assert_eq!(d.1.load(Ordering::Relaxed), 1);
//! d.unmap(va, g).unwrap();
//! d.release(h).unwrap();
//! d.free_reservation(va, g).unwrap();
//! ```
#![forbid(unsafe_code)]

use super::{
    DevAddr, Driver, DriverError, DriverOp, DriverResult, EventId, MemInfo, PhysHandle,
    SimulatedWork, Stream,
};
use std::os::fd::{BorrowedFd, OwnedFd};
use std::time::Instant;

/// One driver call and its arguments, as the hooks of a [`Forward`] wrapper see it.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
#[allow(missing_docs)] // the fields are the arguments of the `Driver` method of that name
pub enum Call {
    /// [`Driver::mem_info`].
    MemInfo,
    /// [`Driver::reserve`].
    Reserve { size: u64 },
    /// [`Driver::free_reservation`].
    FreeReservation { base: DevAddr, size: u64 },
    /// [`Driver::create`].
    Create { size: u64 },
    /// [`Driver::release`].
    Release { handle: PhysHandle },
    /// [`Driver::map`].
    Map {
        addr: DevAddr,
        size: u64,
        handle: PhysHandle,
    },
    /// [`Driver::unmap`].
    Unmap { addr: DevAddr, size: u64 },
    /// [`Driver::set_access`].
    SetAccess { addr: DevAddr, size: u64 },
    /// [`Driver::record_event`].
    RecordEvent { stream: Stream },
    /// [`Driver::query_event`].
    QueryEvent { event: EventId },
    /// [`Driver::wait_event`].
    WaitEvent { event: EventId },
    /// [`Driver::destroy_event`].
    DestroyEvent { event: EventId },
    /// [`Driver::write`] of `len` bytes.
    Write { addr: DevAddr, len: u64 },
    /// [`Driver::read`] of `len` bytes.
    Read { addr: DevAddr, len: u64 },
    /// [`Driver::export`].
    Export { handle: PhysHandle },
    /// [`Driver::import`] of a handle of `size` bytes.
    Import { size: u64 },
}

impl Call {
    /// The kind of call (writes and reads are both [`DriverOp::Copy`]).
    pub fn op(&self) -> DriverOp {
        match self {
            Call::MemInfo => DriverOp::MemInfo,
            Call::Reserve { .. } => DriverOp::Reserve,
            Call::FreeReservation { .. } => DriverOp::FreeReservation,
            Call::Create { .. } => DriverOp::Create,
            Call::Release { .. } => DriverOp::Release,
            Call::Map { .. } => DriverOp::Map,
            Call::Unmap { .. } => DriverOp::Unmap,
            Call::SetAccess { .. } => DriverOp::SetAccess,
            Call::RecordEvent { .. } => DriverOp::RecordEvent,
            Call::QueryEvent { .. } => DriverOp::QueryEvent,
            Call::WaitEvent { .. } => DriverOp::WaitEvent,
            Call::DestroyEvent { .. } => DriverOp::DestroyEvent,
            Call::Write { .. } | Call::Read { .. } => DriverOp::Copy,
            Call::Export { .. } | Call::Import { .. } => DriverOp::Share,
        }
    }
}

/// What a successful call returned, as [`Forward::after`] sees it.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Done {
    /// A call that returns nothing.
    Unit,
    /// The base of a new reservation.
    Addr(DevAddr),
    /// A new physical handle.
    Handle(PhysHandle),
    /// A new event.
    Event(EventId),
    /// Whether a queried event has completed.
    Ready(bool),
    /// Device memory.
    MemInfo(MemInfo),
}

impl From<()> for Done {
    fn from(_: ()) -> Self {
        Done::Unit
    }
}
impl From<DevAddr> for Done {
    fn from(a: DevAddr) -> Self {
        Done::Addr(a)
    }
}
impl From<PhysHandle> for Done {
    fn from(h: PhysHandle) -> Self {
        Done::Handle(h)
    }
}
impl From<EventId> for Done {
    fn from(e: EventId) -> Self {
        Done::Event(e)
    }
}
impl From<bool> for Done {
    fn from(b: bool) -> Self {
        Done::Ready(b)
    }
}
impl From<MemInfo> for Done {
    fn from(m: MemInfo) -> Self {
        Done::MemInfo(m)
    }
}

/// A driver wrapper: forwards every [`Driver`] call to [`Forward::inner`], running the hooks
/// around it. Implementing this trait gives the type [`Driver`].
///
/// `name`, `granularity`, `stream_capturing`, `exchange_capture_mode`, `has_data`,
/// `access_devices` and `simulated_work` are forwarded
/// without hooks; every other call runs `before` (an error there is returned without calling
/// the inner driver), then the inner call, then `after` with its outcome.
pub trait Forward: Send + Sync {
    /// The driver calls are forwarded to.
    type Inner: Driver + ?Sized;

    /// Whether the layer measures the wall time of each inner call for [`Forward::after`]
    /// (otherwise `after` gets 0 nanoseconds, and no clock is read).
    const MEASURE: bool = false;

    /// The driver calls are forwarded to.
    fn inner(&self) -> &Self::Inner;

    /// Runs before `call` is forwarded; an error is returned to the caller instead of making
    /// the call.
    fn before(&self, call: &Call) -> DriverResult<()> {
        let _ = call;
        Ok(())
    }

    /// Runs after the inner driver returned from `call` (not when [`Forward::before`]
    /// refused it), with what it returned and, when [`Forward::MEASURE`] is set, the
    /// nanoseconds it took.
    fn after(&self, call: &Call, result: Result<Done, &DriverError>, elapsed_ns: u64) {
        let _ = (call, result, elapsed_ns);
    }

    /// How this wrapper performs [`Driver::write`] (by default the inner driver's).
    fn forward_write(&self, addr: DevAddr, data: &[u8]) -> DriverResult<()> {
        self.inner().write(addr, data)
    }

    /// How this wrapper answers [`Driver::stream_capturing`] (by default the inner driver's;
    /// a test wrapper may mark streams as capturing). Forwarded without hooks: it is no
    /// [`DriverOp`] and is neither counted nor timed.
    fn forward_stream_capturing(&self, stream: Stream) -> DriverResult<bool> {
        self.inner().stream_capturing(stream)
    }

    /// How this wrapper answers [`Driver::access_devices`] (by default the inner driver's; a
    /// test wrapper may pretend to have peers).
    fn forward_access_devices(&self) -> u32 {
        self.inner().access_devices()
    }

    /// How this wrapper performs [`Driver::read`] (by default the inner driver's).
    fn forward_read(&self, addr: DevAddr, buf: &mut [u8]) -> DriverResult<()> {
        self.inner().read(addr, buf)
    }
}

/// Run `call` through `f`'s hooks, making it with `go`.
#[inline]
fn hooked<F, T>(f: &F, call: Call, go: impl FnOnce(&F) -> DriverResult<T>) -> DriverResult<T>
where
    F: Forward + ?Sized,
    T: Copy + Into<Done>,
{
    hooked_as(f, call, go, |&v| v.into())
}

/// [`hooked`] for a result that is no [`Done`] itself: `after` sees `done` of it.
#[inline]
fn hooked_as<F, T>(
    f: &F,
    call: Call,
    go: impl FnOnce(&F) -> DriverResult<T>,
    done: impl FnOnce(&T) -> Done,
) -> DriverResult<T>
where
    F: Forward + ?Sized,
{
    f.before(&call)?;
    let t0 = F::MEASURE.then(Instant::now);
    let r = go(f);
    let ns = t0.map_or(0, |t| t.elapsed().as_nanos() as u64);
    f.after(&call, r.as_ref().map(done), ns);
    r
}

impl<F: Forward> Driver for F {
    fn name(&self) -> &'static str {
        self.inner().name()
    }
    fn granularity(&self) -> u64 {
        self.inner().granularity()
    }
    fn mem_info(&self) -> DriverResult<MemInfo> {
        hooked(self, Call::MemInfo, |f| f.inner().mem_info())
    }
    fn reserve(&self, size: u64) -> DriverResult<DevAddr> {
        hooked(self, Call::Reserve { size }, |f| f.inner().reserve(size))
    }
    fn free_reservation(&self, base: DevAddr, size: u64) -> DriverResult<()> {
        hooked(self, Call::FreeReservation { base, size }, |f| {
            f.inner().free_reservation(base, size)
        })
    }
    fn create(&self, size: u64) -> DriverResult<PhysHandle> {
        hooked(self, Call::Create { size }, |f| f.inner().create(size))
    }
    fn release(&self, handle: PhysHandle) -> DriverResult<()> {
        hooked(self, Call::Release { handle }, |f| {
            f.inner().release(handle)
        })
    }
    fn map(&self, addr: DevAddr, size: u64, handle: PhysHandle) -> DriverResult<()> {
        hooked(self, Call::Map { addr, size, handle }, |f| {
            f.inner().map(addr, size, handle)
        })
    }
    fn unmap(&self, addr: DevAddr, size: u64) -> DriverResult<()> {
        hooked(self, Call::Unmap { addr, size }, |f| {
            f.inner().unmap(addr, size)
        })
    }
    fn set_access(&self, addr: DevAddr, size: u64) -> DriverResult<()> {
        hooked(self, Call::SetAccess { addr, size }, |f| {
            f.inner().set_access(addr, size)
        })
    }
    fn record_event(&self, stream: Stream) -> DriverResult<EventId> {
        hooked(self, Call::RecordEvent { stream }, |f| {
            f.inner().record_event(stream)
        })
    }
    fn query_event(&self, event: EventId) -> DriverResult<bool> {
        hooked(self, Call::QueryEvent { event }, |f| {
            f.inner().query_event(event)
        })
    }
    fn wait_event(&self, event: EventId) -> DriverResult<()> {
        hooked(self, Call::WaitEvent { event }, |f| {
            f.inner().wait_event(event)
        })
    }
    fn destroy_event(&self, event: EventId) -> DriverResult<()> {
        hooked(self, Call::DestroyEvent { event }, |f| {
            f.inner().destroy_event(event)
        })
    }
    fn write(&self, addr: DevAddr, data: &[u8]) -> DriverResult<()> {
        let len = data.len() as u64;
        hooked(self, Call::Write { addr, len }, |f| {
            f.forward_write(addr, data)
        })
    }
    fn read(&self, addr: DevAddr, buf: &mut [u8]) -> DriverResult<()> {
        let len = buf.len() as u64;
        hooked(self, Call::Read { addr, len }, |f| {
            f.forward_read(addr, buf)
        })
    }
    fn export(&self, handle: PhysHandle) -> DriverResult<OwnedFd> {
        // The descriptor is no `Done`: `after` sees a unit result.
        hooked_as(
            self,
            Call::Export { handle },
            |f| f.inner().export(handle),
            |_| Done::Unit,
        )
    }
    fn import(&self, fd: BorrowedFd<'_>, size: u64) -> DriverResult<PhysHandle> {
        hooked(self, Call::Import { size }, |f| f.inner().import(fd, size))
    }
    fn stream_capturing(&self, stream: Stream) -> DriverResult<bool> {
        self.forward_stream_capturing(stream)
    }
    fn exchange_capture_mode(&self, mode: super::CaptureMode) -> DriverResult<super::CaptureMode> {
        self.inner().exchange_capture_mode(mode)
    }
    fn handle_limit(&self) -> Option<u64> {
        self.inner().handle_limit()
    }
    fn has_data(&self) -> bool {
        self.inner().has_data()
    }
    fn access_devices(&self) -> u32 {
        self.forward_access_devices()
    }
    fn simulated_work(&self) -> Option<&dyn SimulatedWork> {
        self.inner().simulated_work()
    }
}

/// A shared driver: lets a test keep a handle on the driver (say, to read a `SimDriver`'s
/// leak report after the allocator is dropped).
///
/// ```
/// use std::sync::Arc;
/// use stitch_alloc::{Allocator, Config, Stream};
/// use stitch_alloc::driver::SimDriver;
/// let sim = Arc::new(SimDriver::with_capacity(1 << 30));
/// let a = Allocator::new(sim.clone(), Config::default()).unwrap();
/// a.alloc(10 << 20, Stream::DEFAULT).unwrap();
/// drop(a); // gives everything back, reporting the live allocation as a leak
/// assert!(sim.leak_report().is_clean());
/// ```
impl<T: Driver + ?Sized> Forward for std::sync::Arc<T> {
    type Inner = T;
    fn inner(&self) -> &T {
        self
    }
}
