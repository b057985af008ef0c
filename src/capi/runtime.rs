//! The per-process state behind the exports: the configuration (or why it is invalid), read
//! at the first call; and, resolved only at the first allocation, the backend and one lazily
//! created allocator per device.
//!
//! Nothing here touches a driver before the first allocation (issue #13, item 5): reading
//! the configuration, `stitch_init`, the statistics of a device not used yet and
//! `stitch_empty_cache` of one leave the CUDA driver uninitialised, so a process that only
//! loads and configures the library can still set `CUDA_VISIBLE_DEVICES` or fork.
#![forbid(unsafe_code)]

use super::capture::GraphHeld;
use super::conf::{Conf, LogLevel, Peers, DEFAULT_DEVICES, MAX_DEVICES};
use super::guard::panic_message;
use super::segments::{Logged, SegmentEvent, SegmentLog};
use super::stats::{DeviceStats, StatsDoc};
use super::CONF_ENV;
use crate::driver::host::HOST_DEFAULT_CAPACITY;
use crate::driver::sim::H200_CAPACITY;
use crate::driver::{Forward, HostDriver, SimDriver, Timed};
use crate::{Allocator, AnyDriver, Backend, CudaDriver, DevicePtr, Driver};
use parking_lot::Mutex;
use std::ffi::c_int;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::{Arc, OnceLock};

/// Every driver call is timed (two clock reads per call, on the slow path only), so that the
/// statistics can say how much wall time the allocator spent inside the driver.
/// Under the timing, [`Logged`] records maps and unmaps for torch's history when asked.
pub(super) type Alloc = Allocator<Timed<Logged<Device>>>;

/// The driver of one device: a backend of the crate, or (unit tests only) any driver.
#[cfg_attr(test, allow(clippy::large_enum_variant))] // the boxed variant is tests' only
pub(super) enum Device {
    /// What [`Backends`] opened.
    Backend(AnyDriver),
    /// A driver a test gave ([`Open`]).
    #[cfg(test)]
    Given(Box<dyn Driver>),
}

impl Forward for Device {
    type Inner = dyn Driver + 'static;
    fn inner(&self) -> &(dyn Driver + 'static) {
        match self {
            Device::Backend(d) => d,
            #[cfg(test)]
            Device::Given(d) => &**d,
        }
    }
}

/// How the runtime reaches the drivers: [`Backends`] in the library; unit tests give their
/// own (to count what is opened, or to open a driver that misbehaves).
pub(super) trait Open: Send + Sync {
    /// The number of usable CUDA devices, or why there is none (initialises the CUDA driver).
    fn cuda_devices(&self) -> Result<u32, String>;
    /// The driver of `device` on `backend` (never `Auto`); `bytes`: `capacity_bytes`;
    /// `peers`: which devices get access to its mappings (CUDA).
    fn open(
        &self,
        backend: Backend,
        device: c_int,
        bytes: Option<u64>,
        peers: &Peers,
    ) -> Result<Device, String>;
}

/// The crate's backends.
struct Backends;

impl Open for Backends {
    fn cuda_devices(&self) -> Result<u32, String> {
        match CudaDriver::unavailable_reason() {
            None => Ok(u32::try_from(CudaDriver::device_count()).unwrap_or(0)),
            Some(why) => Err(why),
        }
    }

    fn open(
        &self,
        backend: Backend,
        device: c_int,
        bytes: Option<u64>,
        peers: &Peers,
    ) -> Result<Device, String> {
        let d = match backend {
            Backend::Cuda | Backend::Auto => {
                let peers = peers.of(device, || {
                    CudaDriver::accessible_peers(device).unwrap_or_else(|e| {
                        tracing::warn!(%e, device, "no peer access: cannot ask which devices may");
                        Vec::new()
                    })
                });
                CudaDriver::with_peers(device, &peers)
                    .map(AnyDriver::Cuda)
                    .map_err(|e| {
                        format!("could not open CUDA device {device} (peers {peers:?}): {e}")
                    })?
            }
            Backend::Host => HostDriver::with_capacity(bytes.unwrap_or(HOST_DEFAULT_CAPACITY))
                .map(AnyDriver::Host)
                .map_err(|e| format!("could not open the host backend: {e}"))?,
            Backend::Sim => {
                AnyDriver::Sim(SimDriver::with_capacity(bytes.unwrap_or(H200_CAPACITY)))
            }
        };
        Ok(Device::Backend(d))
    }
}

/// One device ordinal.
pub(super) struct Slot {
    /// Created on first use; a failure to create is kept and reported on every later use.
    alloc: OnceLock<Result<Alloc, String>>,
    /// A fraction set before creation (held locked while creating).
    fraction: Mutex<Option<f64>>,
    /// Set by the first panic caught inside this device's allocator (issue #13, item 9):
    /// the engine may be half-updated (its mutexes do not poison), so every later call on the
    /// device fails with this message, which names that panic.
    poison: OnceLock<String>,
    /// Blocks freed during a CUDA graph capture, kept out of the pool.
    pub held: GraphHeld,
    /// Maps and unmaps of this device's driver, while a caller records them.
    pub segments: Arc<SegmentLog>,
}

/// The backend in use and the devices it serves.
struct Devices {
    /// `conf.abi.backend` with `auto` resolved (never `Auto`).
    backend: Backend,
    slots: Vec<Slot>,
}

/// Everything the exports share: the configuration (or why it is invalid) and the devices.
pub(super) struct Runtime {
    raw_conf: String,
    conf: Result<Conf, String>,
    open: Box<dyn Open>,
    /// Resolved at the first allocation (host and sim: at the first call that names a device,
    /// as resolving them touches no driver); kept, a failure too.
    devices: OnceLock<Result<Devices, String>>,
    /// The device count torch passed to `stitch_init` (-1 before).
    pub init_count: AtomicI32,
    /// Per device ordinal: whether its segment log should record (`stitch_segment_log`),
    /// applied to the log when the device's allocator is created and at once when it exists.
    segments_wanted: Box<[AtomicBool]>,
    /// The time `stitch_malloc` and `stitch_free` take (every device; see `apiclock`).
    pub api: super::apiclock::ApiClock,
}

impl Runtime {
    pub fn new(raw_conf: &str) -> Self {
        Self::with_open(raw_conf, Box::new(Backends))
    }

    /// A runtime whose drivers come from `open` (tests; the library uses [`Backends`]).
    pub(super) fn with_open(raw_conf: &str, open: Box<dyn Open>) -> Self {
        Runtime {
            raw_conf: raw_conf.to_string(),
            conf: Conf::parse(raw_conf)
                .map_err(|e| format!("invalid {CONF_ENV} {raw_conf:?}: {e}")),
            open,
            devices: OnceLock::new(),
            init_count: AtomicI32::new(-1),
            segments_wanted: (0..MAX_DEVICES).map(|_| AtomicBool::new(false)).collect(),
            api: Default::default(),
        }
    }

    /// The configuration, or why it is invalid.
    pub fn conf(&self) -> Result<&Conf, String> {
        self.conf.as_ref().map_err(Clone::clone)
    }

    /// The devices, resolving them now (this may initialise the CUDA driver).
    fn resolve(&self) -> Result<&Devices, String> {
        let conf = self.conf()?;
        self.devices
            .get_or_init(|| {
                let d = Devices::new(conf, &*self.open);
                if let Err(e) = &d {
                    // Said once, on stderr, whatever the log level.
                    eprintln!(
                        "stitch-alloc: {e}; no allocator is created and every allocation fails"
                    );
                }
                d
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    /// The devices if they can be known without touching a driver: resolved already, or a
    /// host or sim configuration (resolved now). `Ok(None)`: not yet known.
    fn known(&self) -> Result<Option<&Devices>, String> {
        let conf = self.conf()?;
        match (self.devices.get(), conf.abi.backend) {
            (Some(d), _) => d.as_ref().map(Some).map_err(Clone::clone),
            (None, Backend::Host | Backend::Sim) => self.resolve().map(Some),
            (None, _) => Ok(None),
        }
    }

    /// The backend as known now: resolved, or the configured one (`auto` or `cuda`) before
    /// the first allocation.
    pub fn backend(&self) -> Result<Backend, String> {
        Ok(match self.known()? {
            Some(d) => d.backend,
            None => self.conf()?.abi.backend,
        })
    }

    /// Whether the devices are resolved (an allocation was attempted).
    pub fn resolved(&self) -> bool {
        self.devices.get().is_some()
    }

    /// The number of device slots (0 with an invalid configuration, or before the devices are
    /// resolved).
    pub fn devices(&self) -> usize {
        match self.devices.get() {
            Some(Ok(d)) => d.slots.len(),
            _ => 0,
        }
    }

    /// The slot of `device`, checked.
    fn slot<'a>(&self, devices: &'a Devices, device: c_int) -> Result<&'a Slot, String> {
        match usize::try_from(device)
            .ok()
            .and_then(|d| devices.slots.get(d))
        {
            Some(s) => Ok(s),
            None if devices.slots.is_empty() => Err(format!(
                "device {device} is out of range: the {} backend found no device",
                devices.backend
            )),
            None => Err(format!(
                "device {device} is out of range: the {} backend serves devices 0 to {}",
                devices.backend,
                devices.slots.len() - 1
            )),
        }
    }

    /// The slot of `device` if the devices are known without touching a driver
    /// ([`Runtime::known`]); before that, `device` is checked against the most this
    /// configuration may serve.
    fn known_slot(&self, device: c_int) -> Result<Option<&Slot>, String> {
        match self.known()? {
            Some(d) => self.slot(d, device).map(Some),
            None => {
                let most = self.conf()?.abi.devices.unwrap_or(MAX_DEVICES);
                match u32::try_from(device) {
                    Ok(d) if d < most => Ok(None),
                    _ => Err(format!(
                        "device {device} is out of range: this configuration serves at most \
                         devices 0 to {}",
                        most - 1
                    )),
                }
            }
        }
    }

    /// Turn the segment log of `device` on or off (`stitch_segment_log`), without touching a
    /// driver: before the device's allocator exists the wish is kept for its creation.
    pub fn want_segments(&self, device: c_int, on: bool) -> Result<(), String> {
        let slot = self.known_slot(device)?;
        self.segments_wanted[device as usize].store(on, Ordering::Release);
        if let Some(s) = slot {
            s.segments.set_enabled(on);
        }
        Ok(())
    }

    /// Up to `max` of the oldest segment events of `device` (none before its allocator
    /// exists).
    pub fn drain_segments(&self, device: c_int, max: usize) -> Result<Vec<SegmentEvent>, String> {
        Ok(match self.known_slot(device)? {
            Some(s) => s.segments.drain(max),
            None => Vec::new(),
        })
    }

    /// Check that `device` may be served (without touching a driver, see
    /// [`Runtime::known_slot`]).
    pub fn check_device(&self, device: c_int) -> Result<(), String> {
        self.known_slot(device).map(|_| ())
    }

    /// Run `f` on the allocator of `device` (created on first use; this resolves the devices)
    /// and its slot. A device poisoned by an earlier panic fails with that panic's message;
    /// a panic in `f` (or in creating the allocator) poisons the device, then goes on
    /// unwinding to the export's guard. `func` names the export, for the poison message.
    pub fn with_alloc<T>(
        &self,
        func: &str,
        device: c_int,
        f: impl FnOnce(&Alloc, &Slot) -> T,
    ) -> Result<T, String> {
        let devices = self.resolve()?;
        let slot = self.slot(devices, device)?;
        if let Some(p) = slot.poison.get() {
            return Err(p.clone());
        }
        let run = || {
            let a = slot
                .alloc
                .get_or_init(|| {
                    let fraction = slot.fraction.lock();
                    self.create(devices.backend, device, *fraction, &slot.segments)
                })
                .as_ref()
                .map_err(Clone::clone)?;
            Ok(f(a, slot))
        };
        match catch_unwind(AssertUnwindSafe(run)) {
            Ok(r) => r,
            Err(p) => {
                let _ = slot.poison.set(format!(
                    "device {device} is disabled: an internal error (panic) in {func} may have \
                     left its allocator half-updated: {}; every later call on this device \
                     fails",
                    panic_message(&*p)
                ));
                resume_unwind(p)
            }
        }
    }

    /// The allocator of `device` if it exists already and is not poisoned (never creates one).
    pub fn existing(&self, device: usize) -> Option<&Alloc> {
        let Some(Ok(d)) = self.devices.get() else {
            return None;
        };
        let slot = d.slots.get(device)?;
        if slot.poison.get().is_some() {
            return None;
        }
        slot.alloc.get()?.as_ref().ok()
    }

    /// Why `device` is poisoned, if it is.
    pub fn poisoned(&self, device: usize) -> Option<&str> {
        let Some(Ok(d)) = self.devices.get() else {
            return None;
        };
        d.slots.get(device)?.poison.get().map(String::as_str)
    }

    /// The device whose (healthy) allocator holds a live allocation at `addr`.
    pub fn owner_of(&self, addr: u64) -> Option<usize> {
        (0..self.devices()).find(|&d| {
            self.existing(d)
                .is_some_and(|a| a.usable_size(DevicePtr(addr)).is_some())
        })
    }

    pub fn set_fraction(&self, fraction: f64, device: c_int) -> Result<(), String> {
        if !(fraction > 0.0 && fraction <= 1.0) {
            return Err(format!("fraction {fraction} is not in (0, 1]"));
        }
        let devices = self.resolve()?;
        let slot = self.slot(devices, device)?;
        let mut f = slot.fraction.lock();
        if slot.alloc.get().is_some() {
            // The allocator exists: change its capacity now (issue #12). Nothing live is
            // touched; later allocations beyond the new limit fail.
            let conf = self.conf()?;
            return self
                .with_alloc("stitch_set_memory_fraction", device, |a, _| {
                    let mem = a.driver().mem_info().map_err(|e| e.to_string())?;
                    let cap = conf.capacity_limit(mem.total, Some(fraction));
                    a.set_capacity(cap).map_err(|e| e.to_string())
                })?
                .map(|_| *f = Some(fraction));
        }
        *f = Some(fraction);
        Ok(())
    }

    /// The memory fraction last set on `device` (None: never set).
    pub fn fraction(&self, device: c_int) -> Result<Option<f64>, String> {
        let devices = self.resolve()?;
        Ok(*self.slot(devices, device)?.fraction.lock())
    }

    /// The statistics document of `device` (see the header for its fields). Touches no
    /// driver for a device without an allocator.
    pub fn stats_json(&self, device: c_int) -> Result<String, String> {
        let slot = self.known_slot(device)?;
        if let Some(p) = slot.and_then(|s| s.poison.get()) {
            return Err(p.clone());
        }
        let a = slot.and_then(|s| s.alloc.get()?.as_ref().ok());
        let held = slot.map_or(0, |s| s.held.bytes());
        let init = self.init_count.load(Ordering::Relaxed);
        let mut doc = StatsDoc::new(device, self.backend()?, init, &self.raw_conf, a, held)?;
        doc.segment_events_dropped = slot.map_or(0, |s| s.segments.dropped());
        let api = self.api.estimate();
        (doc.malloc_free_calls, doc.malloc_free_time_us) = (api.calls, api.estimated_us);
        doc.to_json()
    }

    /// The typed statistics of `device` (all 0 before its allocator exists; touches no
    /// driver then).
    pub fn device_stats(&self, device: c_int) -> Result<DeviceStats, String> {
        let slot = self.known_slot(device)?;
        if let Some(p) = slot.and_then(|s| s.poison.get()) {
            return Err(p.clone());
        }
        let Some((a, slot)) = slot.and_then(|s| Some((s.alloc.get()?.as_ref().ok()?, s))) else {
            return Ok(DeviceStats::default());
        };
        let d = a.detailed_stats();
        Ok(DeviceStats::new(&d.stats, &d, slot.held.bytes()))
    }

    /// Run `f` on the allocator of `device` if it exists (a reset of one not created yet has
    /// nothing to reset and touches no driver).
    pub fn if_created(
        &self,
        func: &str,
        device: c_int,
        f: impl FnOnce(&Alloc),
    ) -> Result<(), String> {
        let slot = self.known_slot(device)?;
        if let Some(p) = slot.and_then(|s| s.poison.get()) {
            return Err(p.clone());
        }
        if slot.is_some_and(|s| s.alloc.get().is_some()) {
            self.with_alloc(func, device, |a, _| f(a))?;
        }
        Ok(())
    }

    fn create(
        &self,
        backend: Backend,
        device: c_int,
        fraction: Option<f64>,
        segments: &Arc<SegmentLog>,
    ) -> Result<Alloc, String> {
        let conf = self.conf()?;
        let driver = self
            .open
            .open(backend, device, conf.abi.capacity_bytes, &conf.abi.peers)?;
        let mem = driver
            .mem_info()
            .map_err(|e| format!("device {device}: {e}"))?;
        let cfg = conf.allocator_config(mem, fraction);
        segments.set_enabled(self.segments_wanted[device as usize].load(Ordering::Acquire));
        let a = Allocator::new(Timed::new(Logged::new(driver, segments.clone())), cfg)
            .map_err(|e| format!("device {device}: {e}"))?;
        tracing::info!(
            device,
            backend = backend.name(),
            capacity = a.capacity(),
            total = mem.total,
            free = mem.free,
            "stitch-alloc: allocator created"
        );
        Ok(a)
    }
}

impl Devices {
    /// Resolve the backend (`auto`: CUDA when usable, else host memory) and count the
    /// devices. Only `cuda` and `auto` touch the driver.
    fn new(conf: &Conf, open: &dyn Open) -> Result<Self, String> {
        let cuda = || {
            open.cuda_devices().and_then(|n| {
                if n == 0 {
                    Err("cuDeviceGetCount found no CUDA device".to_string())
                } else {
                    Ok(n)
                }
            })
        };
        let (backend, n) = match conf.abi.backend {
            Backend::Host => (Backend::Host, None),
            Backend::Sim => (Backend::Sim, None),
            Backend::Cuda => match cuda() {
                Ok(n) => (Backend::Cuda, Some(n)),
                Err(why) => return Err(format!("backend cuda: no usable CUDA device ({why})")),
            },
            // The one rule (`Backend`): host memory or the simulator only when named.
            Backend::Auto => match cuda() {
                Ok(n) => (Backend::Cuda, Some(n)),
                Err(why) => {
                    return Err(format!(
                        "backend auto: no usable CUDA device ({why}); set backend:host or \
                         backend:sim to run without a GPU"
                    ))
                }
            },
        };
        let n = match n {
            Some(count) => count.min(conf.abi.devices.unwrap_or(MAX_DEVICES)),
            None => conf.abi.devices.unwrap_or(DEFAULT_DEVICES),
        };
        let slots = (0..n)
            .map(|_| Slot {
                alloc: OnceLock::new(),
                fraction: Mutex::new(None),
                poison: OnceLock::new(),
                held: GraphHeld::default(),
                segments: Arc::default(),
            })
            .collect();
        Ok(Devices { backend, slots })
    }
}

static RUNTIME: OnceLock<Runtime> = OnceLock::new();

/// The process's runtime, configured from `STITCH_ALLOC_CONF` on first use (which also
/// installs the fork handler).
pub(super) fn runtime() -> &'static Runtime {
    RUNTIME.get_or_init(|| {
        super::fork::register();
        let raw = std::env::var(CONF_ENV).unwrap_or_default();
        // The log level first, so that backend selection can already log.
        let level = Conf::parse(&raw).map_or(LogLevel::Warn, |c| c.abi.log);
        init_logging(level);
        let rt = Runtime::new(&raw);
        if let Err(e) = &rt.conf {
            // Said once, on stderr, whatever the log level.
            eprintln!("stitch-alloc: {e}; no allocator is created and every allocation fails");
        }
        rt
    })
}

/// Install a stderr subscriber at `level` (once; kept if one is installed already).
fn init_logging(level: LogLevel) {
    use tracing::level_filters::LevelFilter;
    let filter = match level {
        LogLevel::Off => return,
        LogLevel::Error => LevelFilter::ERROR,
        LogLevel::Warn => LevelFilter::WARN,
        LogLevel::Info => LevelFilter::INFO,
        LogLevel::Debug => LevelFilter::DEBUG,
        LogLevel::Trace => LevelFilter::TRACE,
    };
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_max_level(filter)
        .try_init();
}

#[cfg(test)]
mod tests {
    use super::super::calls;
    use super::super::guard::{guard, last_error};
    use super::*;
    use crate::driver::{Call, DriverOp, DriverResult, MemInfo};
    use crate::Stream;
    use serde_json::Value;
    use std::sync::atomic::AtomicU64;
    use std::sync::Arc;

    const MIB: u64 = 1 << 20;

    /// The one backend rule: `auto` (also the default) is CUDA or an error, never host.
    #[test]
    fn runtime_auto_is_cuda_or_an_error() {
        for conf in ["backend:auto", ""] {
            let rt = Runtime::new(conf);
            match rt.with_alloc("test", 0, |_, _| ()) {
                Ok(()) => assert!(CudaDriver::available()),
                Err(e) => {
                    assert!(!CudaDriver::available(), "{e}");
                    assert!(e.contains("no usable CUDA device"), "{e}");
                    assert!(
                        e.contains("backend:host") && e.contains("backend:sim"),
                        "{e}"
                    );
                }
            }
        }
    }

    fn host_rt(extra: &str) -> Runtime {
        let rt = Runtime::new(&format!(
            "backend:host,capacity_bytes:64MiB,devices:2{extra}"
        ));
        assert!(rt.conf.is_ok(), "{:?}", rt.conf.as_ref().err());
        rt
    }

    /// The allocator of `device`, created on first use.
    fn alloc(rt: &Runtime, device: c_int) -> Result<&Alloc, String> {
        let a = rt.with_alloc("test", device, |a, _| a as *const Alloc)?;
        Ok(rt
            .existing(device as usize)
            .filter(|e| std::ptr::eq(*e, a))
            .unwrap())
    }

    fn doc(rt: &Runtime, device: c_int) -> Value {
        serde_json::from_str(&rt.stats_json(device).unwrap()).unwrap()
    }

    /// What the test driver and opener share with the test.
    #[derive(Default)]
    struct Knobs {
        /// Calls of `Open::cuda_devices` (each initialises the CUDA driver in the library).
        probes: AtomicU64,
        /// Drivers opened.
        opens: AtomicU64,
        /// The raw stream the driver reports as capturing a graph (0: none).
        capturing: AtomicU64,
        /// Maps so far, and the map (1-based) that panics (0: none).
        maps: AtomicU64,
        panic_at_map: AtomicU64,
    }

    /// A simulated device that can capture and panic.
    struct TestDriver {
        sim: SimDriver,
        knobs: Arc<Knobs>,
    }

    impl Forward for TestDriver {
        type Inner = SimDriver;
        fn inner(&self) -> &SimDriver {
            &self.sim
        }
        fn before(&self, call: &Call) -> DriverResult<()> {
            if matches!(call, Call::Map { .. }) {
                let n = self.knobs.maps.fetch_add(1, Ordering::Relaxed) + 1;
                if n == self.knobs.panic_at_map.load(Ordering::Relaxed) {
                    panic!("injected panic at map {n}");
                }
            }
            Ok(())
        }
        fn forward_stream_capturing(&self, stream: Stream) -> DriverResult<bool> {
            let c = self.knobs.capturing.load(Ordering::Relaxed);
            Ok(c != 0 && stream.raw() == c)
        }
    }

    /// Opens one [`TestDriver`] per device: a sim of `capacity` bytes of which `taken` are
    /// held already (by "another process").
    struct TestOpen {
        knobs: Arc<Knobs>,
        capacity: u64,
        taken: u64,
    }

    impl Open for TestOpen {
        fn cuda_devices(&self) -> Result<u32, String> {
            self.knobs.probes.fetch_add(1, Ordering::Relaxed);
            Ok(2)
        }
        fn open(&self, _: Backend, _: c_int, _: Option<u64>, _: &Peers) -> Result<Device, String> {
            self.knobs.opens.fetch_add(1, Ordering::Relaxed);
            let sim = SimDriver::with_capacity(self.capacity);
            if self.taken > 0 {
                sim.create(self.taken).unwrap();
            }
            Ok(Device::Given(Box::new(TestDriver {
                sim,
                knobs: self.knobs.clone(),
            })))
        }
    }

    /// A runtime on [`TestDriver`]s of 1 GiB, `taken` bytes of each held elsewhere. Never
    /// dropped, as the library's is not (a poisoned engine, memory held "by another
    /// process" and graph-held blocks would be reported as leaks).
    fn test_rt(conf: &str, taken: u64) -> (&'static Runtime, Arc<Knobs>) {
        let knobs = Arc::new(Knobs::default());
        let open = TestOpen {
            knobs: knobs.clone(),
            capacity: 1 << 30,
            taken,
        };
        (
            Box::leak(Box::new(Runtime::with_open(conf, Box::new(open)))),
            knobs,
        )
    }

    /// `stitch_malloc` on `rt`, under the export's guard.
    fn malloc(rt: &Runtime, size: u64, device: c_int, stream: Stream) -> u64 {
        guard("stitch_malloc", 0, || {
            calls::malloc(rt, size as usize, device, stream)
        })
    }

    fn free(rt: &Runtime, p: u64, device: c_int, stream: Stream) {
        guard("stitch_free", (), || calls::free(rt, p, 0, device, stream))
    }

    #[test]
    fn runtime_devices_are_independent_and_checked() {
        let rt = host_rt("");
        let a0 = alloc(&rt, 0).unwrap();
        let a1 = alloc(&rt, 1).unwrap();
        assert!(!std::ptr::eq(a0, a1));
        assert!(std::ptr::eq(a0, alloc(&rt, 0).unwrap()), "created once");
        for bad in [-1, 2, c_int::MAX] {
            let e = rt.with_alloc("test", bad, |_, _| ()).unwrap_err();
            assert!(e.contains("out of range"), "{e}");
        }
        let p = a1.alloc(MIB, Stream::DEFAULT).unwrap();
        assert_eq!(rt.owner_of(p.addr()), Some(1));
        assert_eq!(rt.owner_of(p.addr() + 8), None);
        a1.free(p, Stream::DEFAULT).unwrap();
        assert_eq!(rt.owner_of(p.addr()), None);
    }

    #[test]
    fn runtime_bad_config_fails_every_call() {
        for (conf, needle) in [
            ("backend:host,nonsense:3", "nonsense"),
            ("backend:host,reserve_slack:1e300", "reserve_slack"),
        ] {
            let rt = Runtime::new(conf);
            let e = rt.with_alloc("test", 0, |_, _| ()).unwrap_err();
            assert!(e.contains("STITCH_ALLOC_CONF") && e.contains(needle), "{e}");
            assert!(rt.stats_json(0).is_err());
            assert!(rt.set_fraction(0.5, 0).is_err());
            assert_eq!(rt.owner_of(0x1000), None);
            assert_eq!(rt.devices(), 0);
        }
    }

    #[test]
    fn runtime_fraction_only_before_creation() {
        let rt = host_rt("");
        rt.set_fraction(0.5, 1).unwrap();
        assert!(rt.set_fraction(1.5, 1).unwrap_err().contains("(0, 1]"));
        assert!(rt.set_fraction(f64::NAN, 1).is_err());
        assert_eq!(alloc(&rt, 1).unwrap().capacity(), 32 * MIB);
        assert_eq!(rt.fraction(1).unwrap(), Some(0.5));
        // Issue #12: later, it changes the capacity at once; live memory is untouched and
        // a later allocation beyond the limit fails.
        let a = alloc(&rt, 1).unwrap();
        let p = a.alloc(12 * MIB, Stream::DEFAULT).unwrap();
        calls::memory_fraction(&rt, 0.25, 1);
        assert_eq!(a.capacity(), 16 * MIB);
        assert_eq!(rt.fraction(1).unwrap(), Some(0.25));
        assert!(
            a.alloc(8 * MIB, Stream::DEFAULT).is_err(),
            "12 + 8 MiB > 16 MiB"
        );
        assert_eq!(a.usable_size(p), Some(12 * MIB));
        a.free(p, Stream::DEFAULT).unwrap();
        assert_eq!(alloc(&rt, 0).unwrap().capacity(), 64 * MIB);
    }

    #[test]
    fn runtime_bad_allocator_config_is_kept() {
        // 3 MiB is not a multiple of the 2 MiB granularity: Allocator::new refuses.
        let rt = host_rt(",max_handle:3MiB");
        let e = rt.with_alloc("test", 0, |_, _| ()).unwrap_err();
        assert!(e.contains("max_handle"), "{e}");
        assert_eq!(rt.with_alloc("test", 0, |_, _| ()).unwrap_err(), e);
    }

    #[test]
    fn stats_document() {
        let rt = host_rt("");
        let v = doc(&rt, 1);
        assert_eq!(v["initialized"], false);
        assert_eq!(v["torch"]["allocated_bytes.all.current"], 0);
        let a = alloc(&rt, 0).unwrap();
        let p = a.alloc(3 * MIB, Stream::DEFAULT).unwrap();
        let text = rt.stats_json(0).unwrap();
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["initialized"], true);
        assert_eq!(v["backend"], "host");
        assert_eq!(v["capacity"], 64 * MIB);
        assert_eq!(v["conf"], "backend:host,capacity_bytes:64MiB,devices:2");
        assert_eq!(v["graph_held_bytes"], 0);
        assert_eq!(v["torch"]["allocated_bytes.all.current"], 3 * MIB);
        assert_eq!(v["torch"]["requested_bytes.all.peak"], 3 * MIB);
        assert!(v["torch"]["reserved_bytes.all.current"].as_u64().unwrap() >= 3 * MIB);
        assert_eq!(v["stats"]["live_allocations"]["current"], 1);
        assert!(v["fragmentation"]["stranded_bytes"].is_u64());
        assert!(v["fragmentation"].get("stats").is_none());
        assert!(v["driver_calls"].as_u64().unwrap() > 0);
        // The keys of every object are written in sorted order.
        let top: Vec<&String> = v.as_object().unwrap().keys().collect();
        assert!(top.windows(2).all(|w| w[0] < w[1]), "{top:?}");
        assert!(
            text.starts_with("{\"backend\":\"host\",\"capacity\":"),
            "{text}"
        );
        // The host backend's create and map are real system calls: they took some time.
        let by = &v["driver_time_us_by_call"];
        assert!(by["create"].as_f64().unwrap() > 0.0, "{by}");
        assert!(by["map"].as_f64().unwrap() > 0.0, "{by}");
        let sum: f64 = by
            .as_object()
            .unwrap()
            .values()
            .map(|x| x.as_f64().unwrap())
            .sum();
        assert!((v["driver_time_us"].as_f64().unwrap() - sum).abs() < 1e-6);
        a.free(p, Stream::DEFAULT).unwrap();
        assert!(rt.stats_json(9).unwrap_err().contains("out of range"));
    }

    #[test]
    fn the_stats_count_and_time_every_malloc_and_free() {
        let (rt, _) = test_rt("backend:sim", 0);
        assert_eq!(doc(rt, 0)["malloc_free_calls"], 0);
        assert_eq!(doc(rt, 0)["malloc_free_time_us"], 0.0);
        for _ in 0..100 {
            let p = malloc(rt, 3 << 20, 0, Stream::DEFAULT);
            assert_ne!(p, 0);
            free(rt, p, 0, Stream::DEFAULT);
        }
        free(rt, 0x1000, 0, Stream::DEFAULT); // refused, still a call
        let v = doc(rt, 0);
        assert_eq!(v["malloc_free_calls"], 201);
        // Calls 0, 64, 128 and 192 were timed; the first created and mapped memory.
        assert!(v["malloc_free_time_us"].as_f64().unwrap() > 0.0, "{v}");
    }

    /// A size larger than the allocation is reported, and the block is freed all the same
    /// (checked on the block the free looked up, in the same lookup).
    #[test]
    fn free_with_a_size_above_the_allocation_reports_it_and_frees() {
        let (rt, _) = test_rt("backend:sim", 0);
        let p = malloc(rt, 3 << 20, 0, Stream::DEFAULT);
        assert_ne!(p, 0);
        guard("stitch_free", (), || {
            calls::free(rt, p, 64 << 20, 0, Stream::DEFAULT)
        });
        let e = last_error();
        assert!(e.contains("size 67108864 exceeds the allocation's"), "{e}");
        assert!(e.contains("freed anyway"), "{e}");
        assert_eq!(doc(rt, 0)["torch"]["allocated_bytes.all.current"], 0);
        // A size that fits (the usable size rounds up) says nothing.
        let q = malloc(rt, 3 << 20, 0, Stream::DEFAULT);
        guard("stitch_free", (), || {
            calls::free(rt, q, 3 << 20, 0, Stream::DEFAULT)
        });
        assert_eq!(doc(rt, 0)["torch"]["allocated_bytes.all.current"], 0);
    }

    /// The driver time of calls that are not sampled counts in full: only call 0 below is
    /// timed, a zero-size request, and the 30 after it each create a handle.
    #[test]
    fn malloc_free_time_holds_the_driver_time_of_every_call() {
        let rt = host_rt(",max_handle:2MiB");
        alloc(&rt, 0).unwrap();
        let before = doc(&rt, 0)["driver_time_us"].as_f64().unwrap();
        assert_eq!(calls::malloc(&rt, 0, 0, Stream::DEFAULT), 0);
        let ptrs: Vec<u64> = (0..30)
            .map(|_| calls::malloc(&rt, 2 << 20, 0, Stream::DEFAULT))
            .collect();
        assert!(ptrs.iter().all(|&p| p != 0));
        let v = doc(&rt, 0);
        let driver = v["driver_time_us"].as_f64().unwrap() - before;
        assert!(driver > 0.0, "{v}");
        assert_eq!(v["malloc_free_calls"], 31);
        let t = v["malloc_free_time_us"].as_f64().unwrap();
        assert!(
            t >= driver,
            "{t} us estimated, {driver} us inside the driver"
        );
        for p in ptrs {
            calls::free(&rt, p, 0, 0, Stream::DEFAULT);
        }
    }

    /// Issue #13, item 5: nothing but an allocation touches the driver. Reading the
    /// configuration, `stitch_init`, statistics, `empty_cache` and `reset` of devices not
    /// used yet neither probe CUDA (`cuInit`) nor open a device.
    #[test]
    fn no_driver_is_touched_before_the_first_allocation() {
        let (rt, k) = test_rt("backend:cuda", 0);
        calls::init(rt, 2);
        let v = doc(rt, 0);
        assert_eq!(v["initialized"], false);
        assert_eq!(v["backend"], "cuda", "the configured backend, unresolved");
        assert!(rt.stats_json(1).is_ok());
        assert!(
            rt.stats_json(MAX_DEVICES as c_int).is_err(),
            "still range-checked"
        );
        assert_eq!(calls::empty_cache(rt, 0), 0);
        calls::reset(rt);
        calls::free(rt, 0x1000, 0, 0, Stream::DEFAULT); // not one of ours
        calls::record_stream(rt, 0x1000, Stream::DEFAULT);
        assert_eq!(calls::segment_log(rt, 0, true), 0);
        assert_eq!(calls::segment_events(rt, 0, 10), Ok(Vec::new()));
        assert_eq!(
            k.probes.load(Ordering::Relaxed),
            0,
            "no cuInit before a malloc"
        );
        assert_eq!(k.opens.load(Ordering::Relaxed), 0);
        let p = malloc(rt, MIB, 0, Stream::DEFAULT);
        assert_ne!(p, 0, "{}", last_error());
        assert_eq!(k.probes.load(Ordering::Relaxed), 1);
        assert_eq!(k.opens.load(Ordering::Relaxed), 1);
        assert_eq!(doc(rt, 1)["initialized"], false);
        assert_eq!(
            k.opens.load(Ordering::Relaxed),
            1,
            "device 1 is not opened by stats"
        );
        // On the host backend too: statistics before any allocation open nothing.
        let (rt, k) = test_rt("backend:host", 0);
        assert_eq!(doc(rt, 0)["backend"], "host");
        assert_eq!(k.opens.load(Ordering::Relaxed), 0);
    }

    /// Issue #12 item 5: the segment log, asked for before the device's first allocation,
    /// records that allocation's maps, then the unmaps of `empty_cache`; it balances against
    /// the mapped bytes; stopping it stops the events; a bad device is refused.
    #[test]
    fn segment_events_follow_the_mappings() {
        let (rt, _k) = test_rt("backend:cuda", 0);
        assert_eq!(calls::segment_log(rt, 0, true), 0);
        let p = malloc(rt, 40 * MIB, 0, Stream::DEFAULT);
        assert_ne!(p, 0, "{}", last_error());
        let ev = calls::segment_events(rt, 0, usize::MAX).unwrap();
        let mapped: u64 = ev.iter().filter(|e| e.map).map(|e| e.size).sum();
        assert!(ev.iter().all(|e| e.map) && mapped >= 40 * MIB, "{ev:?}");
        assert!(
            ev.iter().any(|e| e.addr <= p && p < e.addr + e.size),
            "a map covers the allocation"
        );
        assert_eq!(doc(rt, 0)["stats"]["mapped"]["current"], mapped);
        free(rt, p, 0, Stream::DEFAULT);
        assert_eq!(calls::empty_cache(rt, 0), 0);
        let ev = calls::segment_events(rt, 0, usize::MAX).unwrap();
        let unmapped: u64 = ev.iter().filter(|e| !e.map).map(|e| e.size).sum();
        assert_eq!(unmapped, mapped, "{ev:?}");
        assert_eq!(calls::segment_log(rt, 0, false), 0);
        let p = malloc(rt, 8 * MIB, 0, Stream::DEFAULT);
        assert!(calls::segment_events(rt, 0, 10).unwrap().is_empty());
        free(rt, p, 0, Stream::DEFAULT);
        assert_eq!(calls::segment_log(rt, MAX_DEVICES as c_int, true), -1);
        assert!(calls::segment_events(rt, -1, 1).is_err());
        assert_eq!(doc(rt, 0)["segment_events_dropped"], 0);
    }

    /// Issue #12: an allocation on a capturing stream is refused (naming the missing
    /// support); a free on one keeps the block out of the pool, counted in the statistics,
    /// until the capture has ended; the default stream and other streams go on as before.
    #[test]
    fn graph_capture_is_refused_and_frees_are_held_until_it_ends() {
        let (rt, k) = test_rt("backend:cuda", 0);
        let cap = Stream::sim(7);
        let p = malloc(rt, 8 * MIB, 0, cap);
        assert_ne!(p, 0, "not capturing yet");
        k.capturing.store(cap.raw(), Ordering::Relaxed);
        assert_eq!(malloc(rt, MIB, 0, cap), 0, "refused while capturing");
        let e = last_error();
        assert!(
            e.contains("CUDA graph capture is not supported") && e.contains("graph pools"),
            "{e}"
        );
        // The free during the capture holds the block: still allocated, not reusable.
        free(rt, p, 0, cap);
        let v = doc(rt, 0);
        assert_eq!(v["graph_held_bytes"], 8 * MIB);
        assert_eq!(v["torch"]["allocated_bytes.all.current"], 8 * MIB);
        assert_eq!(v["stats"]["frees"], 0);
        // Other streams still allocate, and never get the held block while it is held.
        let q = malloc(rt, 8 * MIB, 0, Stream::sim(2));
        assert!(q != 0 && q != p);
        // A second free during the capture is refused, not a second hold.
        free(rt, p, 0, cap);
        assert!(last_error().contains("freed already, during a CUDA graph capture"));
        assert_eq!(doc(rt, 0)["graph_held_bytes"], 8 * MIB);
        // The capture ends: the next call frees the held block on its stream.
        k.capturing.store(0, Ordering::Relaxed);
        free(rt, q, 0, Stream::sim(2));
        let v = doc(rt, 0);
        assert_eq!(v["graph_held_bytes"], 0);
        assert_eq!(v["torch"]["allocated_bytes.all.current"], 0);
        assert_eq!(v["stats"]["frees"], 2);
        // Now a free of it is a plain double free.
        free(rt, p, 0, cap);
        assert!(
            last_error().contains("invalid pointer") || last_error().contains("double free"),
            "{}",
            last_error()
        );
    }

    /// Issue #13 (soak, H200 run 26): a block freed on a stream while it was capturing, whose
    /// stream is then retired (about to be destroyed), is freed at the retire; the stream is
    /// not queried again.
    #[test]
    fn retire_stream_releases_blocks_held_for_it() {
        let (rt, k) = test_rt("backend:cuda", 0);
        let cap = Stream::sim(11);
        let p = malloc(rt, 4 * MIB, 0, cap);
        k.capturing.store(cap.raw(), Ordering::Relaxed);
        free(rt, p, 0, cap);
        assert_eq!(doc(rt, 0)["graph_held_bytes"], 4 * MIB);
        // Still reported as capturing (a stale query): retiring it releases the block.
        assert_eq!(calls::retire_stream(rt, 0, cap), 0, "{}", last_error());
        k.capturing.store(0, Ordering::Relaxed);
        let v = doc(rt, 0);
        assert_eq!(v["graph_held_bytes"], 0);
        assert_eq!(v["torch"]["allocated_bytes.all.current"], 0);
    }

    /// Issue #12: graph-pool memory is handed out on a capturing stream (stitch_malloc
    /// refuses it), records no event, and comes back clean.
    #[test]
    fn graph_pool_allocation_is_allowed_while_capturing() {
        let (rt, k) = test_rt("backend:cuda", 0);
        let cap = Stream::sim(9);
        k.capturing.store(cap.raw(), Ordering::Relaxed);
        assert_eq!(malloc(rt, MIB, 0, cap), 0, "the ordinary path refuses");
        let before = alloc(rt, 0).unwrap().stats().calls;
        let p = guard("stitch_malloc_graph", 0, || {
            calls::malloc_graph(rt, 8 << 20, 0, cap)
        });
        assert_ne!(p, 0, "{}", last_error());
        let after = alloc(rt, 0).unwrap().stats().calls;
        for op in [
            DriverOp::RecordEvent,
            DriverOp::QueryEvent,
            DriverOp::WaitEvent,
        ] {
            assert_eq!(after.get(op), before.get(op), "{op:?}");
        }
        assert_eq!(calls::free_graph(rt, p, 0), 0);
        assert_eq!(calls::free_graph(rt, p, 0), -1);
        assert!(last_error().contains("double free"), "{}", last_error());
        let v = doc(rt, 0);
        assert_eq!(v["torch"]["allocated_bytes.all.current"], 0);
        assert_eq!(v["graph_held_bytes"], 0);
        k.capturing.store(0, Ordering::Relaxed);
    }

    /// Issue #13, item 9: a panic inside the allocator disables its device; every later
    /// call fails naming the first panic, other devices go on.
    #[test]
    fn a_panic_poisons_its_device() {
        let (rt, k) = test_rt("backend:cuda,max_handle:8MiB", 0);
        // Fragment device 0, then ask for a span that must be stitched from several handles.
        let ps: Vec<u64> = (0..8)
            .map(|_| malloc(rt, 8 * MIB, 0, Stream::DEFAULT))
            .collect();
        assert!(ps.iter().all(|&p| p != 0));
        for &p in ps.iter().step_by(2) {
            free(rt, p, 0, Stream::DEFAULT);
        }
        let maps = k.maps.load(Ordering::Relaxed);
        k.panic_at_map.store(maps + 2, Ordering::Relaxed);
        assert_eq!(malloc(rt, 32 * MIB, 0, Stream::DEFAULT), 0);
        assert!(
            k.maps.load(Ordering::Relaxed) >= maps + 2,
            "the second map of the stitch panicked"
        );
        let e = last_error();
        assert!(
            e.contains("panic") && e.contains("injected panic at map"),
            "{e}"
        );
        k.panic_at_map.store(0, Ordering::Relaxed);
        // Every later call on device 0 fails, naming that panic.
        assert_eq!(malloc(rt, MIB, 0, Stream::DEFAULT), 0);
        let e = last_error();
        assert!(
            e.contains("device 0 is disabled") && e.contains("injected panic at map"),
            "{e}"
        );
        free(rt, ps[1], 0, Stream::DEFAULT);
        assert!(last_error().contains("device 0 is disabled"));
        assert!(rt
            .stats_json(0)
            .unwrap_err()
            .contains("device 0 is disabled"));
        assert_eq!(calls::empty_cache(rt, 0), -1);
        assert!(last_error().contains("device 0 is disabled"));
        // Device 1 is unharmed.
        let p = malloc(rt, MIB, 1, Stream::DEFAULT);
        assert_ne!(p, 0, "{}", last_error());
        free(rt, p, 1, Stream::DEFAULT);
    }

    /// Issue #13, item 11: a zero-size allocation (every empty tensor) does not replace the
    /// out-of-memory diagnosis the user is told to read.
    #[test]
    fn zero_size_keeps_the_last_error() {
        let (rt, _) = test_rt("backend:cuda", 0);
        assert_eq!(malloc(rt, 4 << 30, 0, Stream::DEFAULT), 0);
        let oom = last_error();
        assert!(
            oom.contains("out of memory") || oom.contains("too large"),
            "{oom}"
        );
        assert_eq!(malloc(rt, 0, 0, Stream::DEFAULT), 0);
        assert_eq!(last_error(), oom);
    }

    /// Issue #13, item 11: the default capacity is the memory free when the allocator is
    /// created, not the total (another process holds part of it).
    #[test]
    fn capacity_excludes_memory_held_elsewhere() {
        let (rt, _) = test_rt("backend:cuda", 256 * MIB);
        assert_ne!(malloc(rt, MIB, 0, Stream::DEFAULT), 0);
        let v = doc(rt, 0);
        assert_eq!(v["capacity"], (1u64 << 30) - 256 * MIB);
        let m: MemInfo = alloc(rt, 0).unwrap().driver().mem_info().unwrap();
        assert_eq!(m.total, 1 << 30);
    }
}
