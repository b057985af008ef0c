//! The C ABI: `libstitch_alloc.so`, the library PyTorch loads through
//! `torch.cuda.memory.CUDAPluggableAllocator`, usable from any C program.
//!
//! `include/stitch_alloc.h` is the C view of this module; keep the two in step.
//!
//! * One [`Allocator`] per device, created on the device's first use, kept in a process-wide
//!   table for the life of the process (it is never dropped: the process's exit returns the
//!   memory).
//! * The backend and settings come from the environment variable `STITCH_ALLOC_CONF`, read
//!   once, at the first call of any function here: a comma-separated `key:value` list in the
//!   style of `PYTORCH_CUDA_ALLOC_CONF` (see [`CONF_KEYS`] and the header). An unknown key or
//!   a bad value is rejected loudly: it is printed to stderr once, no allocator is created,
//!   every allocation returns NULL and [`stitch_last_error`] says why.
//! * Nothing crosses the boundary as a panic: every export runs under `catch_unwind`. A
//!   failure (a NULL from [`stitch_malloc`], an invalid pointer given to [`stitch_free`], a
//!   device out of range, ...) is logged through `tracing` and kept as the calling thread's
//!   last error. Pointers given in are never dereferenced: they are looked up in the
//!   allocator's tables, so freeing an unknown pointer, a pointer inside an allocation or the
//!   same pointer twice is an error report, never undefined behaviour.
//!
//! No function here has a safety precondition (none reads through a pointer it is given), so
//! this module holds no `unsafe` code; `#[no_mangle]` is the only reason it is not under
//! `forbid(unsafe_code)`.

use crate::driver::host::HOST_DEFAULT_CAPACITY;
use crate::driver::sim::H200_CAPACITY;
use crate::driver::{DriverOp, HostDriver, SimDriver, Timed};
use crate::{
    AllocError, Allocator, AnyDriver, Capacity, Config, CudaDriver, DetailedStats, DevicePtr,
    Driver, Stats, Stream,
};
use parking_lot::Mutex;
use serde_json::{json, Map, Value};
use std::cell::RefCell;
use std::ffi::{c_char, c_double, c_int, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::OnceLock;

/// The environment variable read for the configuration.
pub const CONF_ENV: &str = "STITCH_ALLOC_CONF";

/// The keys `STITCH_ALLOC_CONF` accepts.
pub const CONF_KEYS: [&str; 14] = [
    "backend",
    "capacity_fraction",
    "capacity_bytes",
    "small_threshold",
    "min_handle",
    "max_handle",
    "stitching",
    "reserve_slack",
    "reserve_slack_min",
    "medium_threshold",
    "medium_page",
    "log",
    "devices",
    "on_oom",
];

/// Device ordinals served by the host and simulated backends when `devices` is not given.
const DEFAULT_DEVICES: u32 = 8;
/// The most device ordinals `devices` may ask for.
const MAX_DEVICES: u32 = 1024;

const VERSION: &CStr =
    match CStr::from_bytes_with_nul(concat!(env!("CARGO_PKG_VERSION"), "\0").as_bytes()) {
        Ok(v) => v,
        Err(_) => panic!("the version has no interior NUL"),
    };

// ---------------------------------------------------------------------------------------
// Configuration.

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum BackendKind {
    Auto,
    Cuda,
    Host,
    Sim,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum LogLevel {
    Off,
    Error,
    Warn,
    Info,
    Debug,
    Trace,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum OnOom {
    Null,
    Abort,
}

/// `STITCH_ALLOC_CONF`, parsed and checked.
#[derive(Clone, Debug, PartialEq)]
struct CapiConfig {
    backend: BackendKind,
    capacity_fraction: Option<f64>,
    capacity_bytes: Option<u64>,
    small_threshold: Option<u64>,
    min_handle: Option<u64>,
    max_handle: Option<u64>,
    stitching: Option<bool>,
    reserve_slack: Option<f64>,
    reserve_slack_min: Option<u64>,
    medium_threshold: Option<u64>,
    medium_page: Option<u64>,
    log: LogLevel,
    devices: Option<u32>,
    on_oom: OnOom,
}

impl Default for CapiConfig {
    fn default() -> Self {
        CapiConfig {
            backend: BackendKind::Auto,
            capacity_fraction: None,
            capacity_bytes: None,
            small_threshold: None,
            min_handle: None,
            max_handle: None,
            stitching: None,
            reserve_slack: None,
            reserve_slack_min: None,
            medium_threshold: None,
            medium_page: None,
            log: LogLevel::Warn,
            devices: None,
            on_oom: OnOom::Null,
        }
    }
}

/// A byte count: digits and an optional binary suffix (`B`, `K`/`KiB`, `M`/`MiB`, `G`/`GiB`,
/// `T`/`TiB`, case-insensitive). `KB`, `MB`, ... are refused as ambiguous.
fn parse_size(v: &str) -> Result<u64, String> {
    let t = v.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    if num.is_empty() {
        return Err("a byte count such as 1073741824, 512KiB, 128MiB or 1GiB".into());
    }
    let n: u64 = num
        .parse()
        .map_err(|_| format!("a byte count that fits in 64 bits, not {num}"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "kb" | "mb" | "gb" | "tb" => {
            return Err(format!(
            "a binary unit: {unit:?} is ambiguous, write KiB/MiB/GiB/TiB (powers of 1024) or bytes"
        ))
        }
        _ => {
            return Err(format!(
                "a byte count with unit B, KiB, MiB, GiB or TiB, not {unit:?}"
            ))
        }
    };
    n.checked_mul(mult)
        .ok_or_else(|| "a byte count that fits in 64 bits".to_string())
}

fn parse_f64(v: &str) -> Option<f64> {
    v.trim().parse::<f64>().ok().filter(|f| f.is_finite())
}

impl CapiConfig {
    /// Parse a `key:value,key:value` list; an empty string gives the defaults.
    fn parse(s: &str) -> Result<Self, String> {
        let mut c = CapiConfig::default();
        let mut seen: Vec<String> = Vec::new();
        for item in s.split(',') {
            let item = item.trim();
            if item.is_empty() {
                continue;
            }
            let Some((k, v)) = item.split_once(':') else {
                return Err(format!("{item:?} is not of the form key:value"));
            };
            let (k, v) = (k.trim(), v.trim());
            let key = k.to_ascii_lowercase();
            if seen.contains(&key) {
                return Err(format!("key {k:?} is given twice"));
            }
            let bad = |what: &str| format!("bad value {v:?} for {k}: expected {what}");
            let size = || parse_size(v).map_err(|e| bad(&e));
            let lower = v.to_ascii_lowercase();
            match key.as_str() {
                "backend" => {
                    c.backend = match lower.as_str() {
                        "auto" => BackendKind::Auto,
                        "cuda" => BackendKind::Cuda,
                        "host" => BackendKind::Host,
                        "sim" => BackendKind::Sim,
                        _ => return Err(bad("one of auto, cuda, host, sim")),
                    }
                }
                "capacity_fraction" => {
                    let f = parse_f64(v)
                        .filter(|f| *f > 0.0 && *f <= 1.0)
                        .ok_or_else(|| bad("a number in (0, 1]"))?;
                    c.capacity_fraction = Some(f);
                }
                "capacity_bytes" => {
                    let b = size()?;
                    if b == 0 {
                        return Err(bad("a byte count above zero"));
                    }
                    c.capacity_bytes = Some(b);
                }
                "small_threshold" => c.small_threshold = Some(size()?),
                "min_handle" => c.min_handle = Some(size()?),
                "max_handle" => c.max_handle = Some(size()?),
                "stitching" => {
                    c.stitching = Some(match lower.as_str() {
                        "true" | "1" | "yes" | "on" => true,
                        "false" | "0" | "no" | "off" => false,
                        _ => return Err(bad("true or false")),
                    })
                }
                "reserve_slack" => {
                    let f = parse_f64(v)
                        .filter(|f| *f >= 0.0)
                        .ok_or_else(|| bad("a finite number >= 0"))?;
                    c.reserve_slack = Some(f);
                }
                "reserve_slack_min" => c.reserve_slack_min = Some(size()?),
                "medium_threshold" => c.medium_threshold = Some(size()?),
                "medium_page" => c.medium_page = Some(size()?),
                "log" => {
                    c.log = match lower.as_str() {
                        "off" | "none" => LogLevel::Off,
                        "error" => LogLevel::Error,
                        "warn" | "warning" => LogLevel::Warn,
                        "info" => LogLevel::Info,
                        "debug" => LogLevel::Debug,
                        "trace" => LogLevel::Trace,
                        _ => return Err(bad("one of off, error, warn, info, debug, trace")),
                    }
                }
                "devices" => {
                    let n = v
                        .parse::<u32>()
                        .ok()
                        .filter(|n| (1..=MAX_DEVICES).contains(n))
                        .ok_or_else(|| bad(&format!("an integer from 1 to {MAX_DEVICES}")))?;
                    c.devices = Some(n);
                }
                "on_oom" => {
                    c.on_oom = match lower.as_str() {
                        "null" => OnOom::Null,
                        "abort" => OnOom::Abort,
                        _ => return Err(bad("null or abort")),
                    }
                }
                _ => {
                    return Err(format!(
                        "unknown key {k:?}; known keys: {}",
                        CONF_KEYS.join(", ")
                    ))
                }
            }
            seen.push(key);
        }
        if c.capacity_fraction.is_some() && c.capacity_bytes.is_some() {
            return Err("capacity_fraction and capacity_bytes exclude each other".into());
        }
        Ok(c)
    }

    /// The allocator configuration for a device of `total` bytes, with a memory fraction set
    /// through [`stitch_memory_fraction`] (if any) as a further limit.
    fn allocator_config(&self, total: u64, fraction: Option<f64>) -> Config {
        let mut cfg = Config::default();
        let mut cap = match (self.capacity_bytes, self.capacity_fraction) {
            (Some(b), _) => b,
            (None, Some(f)) => (total as f64 * f) as u64,
            (None, None) => total,
        };
        if let Some(f) = fraction {
            cap = cap.min((total as f64 * f) as u64);
        }
        cfg.capacity = Capacity::Bytes(cap);
        if let Some(v) = self.small_threshold {
            cfg.small_threshold = v;
        }
        if let Some(v) = self.min_handle {
            cfg.min_handle = v;
        }
        if let Some(v) = self.max_handle {
            cfg.max_handle = v;
        }
        if let Some(v) = self.stitching {
            cfg.stitching = v;
        }
        if let Some(v) = self.reserve_slack_min {
            cfg.reserve_slack_min = v;
        }
        if let Some(v) = self.medium_threshold {
            cfg.medium_threshold = v;
        }
        if let Some(v) = self.medium_page {
            cfg.medium_page = v;
        }
        if let Some(v) = self.reserve_slack {
            cfg.reserve_slack = v;
        }
        cfg
    }
}

// ---------------------------------------------------------------------------------------
// The per-process state.

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Backend {
    Cuda,
    Host,
    Sim,
}

impl Backend {
    fn name(self) -> &'static str {
        match self {
            Backend::Cuda => "cuda",
            Backend::Host => "host",
            Backend::Sim => "sim",
        }
    }
}

/// Every driver call is timed (two clock reads per call, on the slow path only), so that the
/// statistics can say how much wall time the allocator spent inside the driver.
type Alloc = Allocator<Timed<AnyDriver>>;

struct Slot {
    /// Created on first use; a failure to create is kept and reported on every later use.
    alloc: OnceLock<Result<Alloc, String>>,
    /// A fraction set before creation (held locked while creating).
    fraction: Mutex<Option<f64>>,
}

struct Ready {
    conf: CapiConfig,
    backend: Backend,
    slots: Vec<Slot>,
}

/// Everything the exports share: the configuration (or why it is invalid) and the devices.
struct Runtime {
    raw_conf: String,
    state: Result<Ready, String>,
    /// The device count torch passed to `stitch_init` (-1 before).
    init_count: AtomicI32,
}

impl Runtime {
    fn new(raw_conf: &str) -> Self {
        let state = CapiConfig::parse(raw_conf)
            .map_err(|e| format!("invalid {CONF_ENV} {raw_conf:?}: {e}"))
            .and_then(Ready::new);
        Runtime {
            raw_conf: raw_conf.to_string(),
            state,
            init_count: AtomicI32::new(-1),
        }
    }

    fn ready(&self) -> Result<&Ready, String> {
        self.state.as_ref().map_err(Clone::clone)
    }

    /// The slot of `device`, checked.
    fn slot(&self, device: c_int) -> Result<(&Ready, &Slot), String> {
        let r = self.ready()?;
        match usize::try_from(device).ok().and_then(|d| r.slots.get(d)) {
            Some(s) => Ok((r, s)),
            None if r.slots.is_empty() => Err(format!(
                "device {device} is out of range: the {} backend found no device",
                r.backend.name()
            )),
            None => Err(format!(
                "device {device} is out of range: the {} backend serves devices 0 to {}",
                r.backend.name(),
                r.slots.len() - 1
            )),
        }
    }

    /// The allocator of `device`, created on first use.
    fn allocator(&self, device: c_int) -> Result<&Alloc, String> {
        let (r, slot) = self.slot(device)?;
        slot.alloc
            .get_or_init(|| {
                let fraction = slot.fraction.lock();
                r.create(device, *fraction)
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    /// The allocator of `device` if it exists already (never creates one).
    fn existing(&self, device: usize) -> Option<&Alloc> {
        let r = self.state.as_ref().ok()?;
        r.slots.get(device)?.alloc.get()?.as_ref().ok()
    }

    /// The device whose allocator holds a live allocation at `addr`.
    fn owner_of(&self, addr: u64) -> Option<usize> {
        let n = self.state.as_ref().map_or(0, |r| r.slots.len());
        (0..n).find(|&d| {
            self.existing(d)
                .is_some_and(|a| a.usable_size(DevicePtr(addr)).is_some())
        })
    }

    fn set_fraction(&self, fraction: f64, device: c_int) -> Result<(), String> {
        if !(fraction > 0.0 && fraction <= 1.0) {
            return Err(format!("fraction {fraction} is not in (0, 1]"));
        }
        let (_, slot) = self.slot(device)?;
        let mut f = slot.fraction.lock();
        if slot.alloc.get().is_some() {
            return Err(format!(
                "device {device} already has its allocator (created at its first allocation); \
                 a memory fraction takes effect only when set before that"
            ));
        }
        *f = Some(fraction);
        Ok(())
    }

    /// The statistics document of `device` (see the header for its fields).
    fn stats_json(&self, device: c_int) -> Result<String, String> {
        let (r, _) = self.slot(device)?;
        let a = self.existing(device as usize);
        let (stats, detailed, capacity, granularity) = match a {
            Some(a) => {
                let d = a.detailed_stats();
                (d.stats, d.clone(), d.capacity, d.granularity)
            }
            None => (Stats::default(), DetailedStats::default(), 0, 0),
        };
        // Measured wall time inside the driver, in microseconds: in all, and by call kind.
        let mut by_call = serde_json::Map::new();
        let mut driver_us = 0.0;
        if let Some(a) = a {
            for t in a.driver().timings().0 {
                if t.calls > 0 {
                    let us = t.measured_ns as f64 / 1e3;
                    driver_us += us;
                    by_call.insert(t.op.name().to_string(), json!(us));
                }
            }
        }
        let mut frag = serde_json::to_value(&detailed).map_err(|e| e.to_string())?;
        if let Value::Object(m) = &mut frag {
            m.remove("stats");
        }
        let doc = json!({
            "version": env!("CARGO_PKG_VERSION"),
            "device": device,
            "backend": r.backend.name(),
            "initialized": a.is_some(),
            "init_device_count": self.init_count.load(Ordering::Relaxed),
            "conf": self.raw_conf,
            "capacity": capacity,
            "granularity": granularity,
            "driver_calls": stats.calls.total(),
            "vmm_calls": stats.calls.vmm_total(),
            "driver_time_us": driver_us,
            "driver_time_us_by_call": by_call,
            "torch": torch_stats(&stats, &detailed),
            "stats": stats,
            "fragmentation": frag,
        });
        Ok(doc.to_string())
    }
}

impl Ready {
    fn new(conf: CapiConfig) -> Result<Self, String> {
        let backend = match conf.backend {
            BackendKind::Host => Backend::Host,
            BackendKind::Sim => Backend::Sim,
            BackendKind::Cuda if CudaDriver::available() => Backend::Cuda,
            BackendKind::Cuda => {
                return Err(format!(
                    "backend cuda: no usable CUDA device ({})",
                    CudaDriver::unavailable_reason().unwrap_or_default()
                ))
            }
            BackendKind::Auto if CudaDriver::available() => Backend::Cuda,
            BackendKind::Auto => {
                tracing::warn!(
                    reason = CudaDriver::unavailable_reason().unwrap_or_default(),
                    "backend auto: no usable CUDA device; using host memory"
                );
                Backend::Host
            }
        };
        let n = match backend {
            Backend::Cuda => {
                let count = u32::try_from(CudaDriver::device_count()).unwrap_or(0);
                count.min(conf.devices.unwrap_or(MAX_DEVICES))
            }
            Backend::Host | Backend::Sim => conf.devices.unwrap_or(DEFAULT_DEVICES),
        };
        let slots = (0..n)
            .map(|_| Slot {
                alloc: OnceLock::new(),
                fraction: Mutex::new(None),
            })
            .collect();
        Ok(Ready {
            conf,
            backend,
            slots,
        })
    }

    fn create(&self, device: c_int, fraction: Option<f64>) -> Result<Alloc, String> {
        let c = &self.conf;
        let driver = match self.backend {
            Backend::Cuda => CudaDriver::new(device)
                .map(AnyDriver::Cuda)
                .map_err(|e| format!("could not open CUDA device {device}: {e}"))?,
            Backend::Host => {
                HostDriver::with_capacity(c.capacity_bytes.unwrap_or(HOST_DEFAULT_CAPACITY))
                    .map(AnyDriver::Host)
                    .map_err(|e| format!("could not open the host backend: {e}"))?
            }
            Backend::Sim => AnyDriver::Sim(SimDriver::with_capacity(
                c.capacity_bytes.unwrap_or(H200_CAPACITY),
            )),
        };
        let total = driver
            .mem_info()
            .map_err(|e| format!("device {device}: {e}"))?
            .total;
        let cfg = c.allocator_config(total, fraction);
        let a =
            Allocator::new(Timed::new(driver), cfg).map_err(|e| format!("device {device}: {e}"))?;
        tracing::info!(
            device,
            backend = self.backend.name(),
            capacity = a.capacity(),
            "stitch-alloc: allocator created"
        );
        Ok(a)
    }
}

/// PyTorch's `memory_stats()` names for what this allocator counts.
fn torch_stats(s: &Stats, d: &DetailedStats) -> Map<String, Value> {
    let mut m = Map::new();
    let mut put = |k: &str, v: u64| {
        m.insert(k.to_string(), Value::from(v));
    };
    put("allocated_bytes.all.current", s.allocated.current);
    put("allocated_bytes.all.peak", s.allocated.peak);
    put("requested_bytes.all.current", s.requested.current);
    put("requested_bytes.all.peak", s.requested.peak);
    put("reserved_bytes.all.current", s.reserved.current);
    put("reserved_bytes.all.peak", s.reserved.peak);
    // Torch's "active" also holds blocks freed but still waiting for other streams.
    put(
        "active_bytes.all.current",
        s.allocated.current + s.pending_free,
    );
    put("allocation.all.current", s.live_allocations.current);
    put("allocation.all.peak", s.live_allocations.peak);
    put("allocation.all.allocated", s.allocs);
    put("allocation.all.freed", s.frees);
    put("segment.all.current", s.handles);
    put("segment.all.allocated", s.handles_created);
    put("segment.all.freed", s.handles_released);
    // Free bytes that cannot be given back because they share a handle with live bytes.
    put("inactive_split_bytes.all.current", d.stranded_bytes);
    put("num_ooms", s.ooms);
    // Torch: a failed cudaMalloc followed by a cache flush and a retry. Here: a slow path
    // that blocked on outstanding frees before trying again.
    put("num_alloc_retries", s.event_waits);
    put("num_device_alloc", s.calls.get(DriverOp::Map));
    put("num_device_free", s.calls.get(DriverOp::Unmap));
    m
}

static RUNTIME: OnceLock<Runtime> = OnceLock::new();

/// The process's runtime, configured from `STITCH_ALLOC_CONF` on first use.
fn runtime() -> &'static Runtime {
    RUNTIME.get_or_init(|| {
        let raw = std::env::var(CONF_ENV).unwrap_or_default();
        // The log level first, so that backend selection can already log.
        let level = CapiConfig::parse(&raw).map_or(LogLevel::Warn, |c| c.log);
        init_logging(level);
        let rt = Runtime::new(&raw);
        if let Err(e) = &rt.state {
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

// ---------------------------------------------------------------------------------------
// Errors and panics.

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
    static STATS_BUF: RefCell<CString> = RefCell::new(CString::default());
}

fn to_cstring(s: &str) -> CString {
    CString::new(s.replace('\0', "\\0")).unwrap_or_default()
}

/// WARN the first time a standing condition (an invalid configuration, a device that could
/// not be opened, a device out of range) is met, DEBUG after: torch allocates thousands of
/// times a second, and one line says it all. Every call still sets the last error.
fn first_time(condition: &str) -> tracing::Level {
    static SEEN: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let mut seen = SEEN.lock();
    if seen.iter().any(|s| s == condition) {
        return tracing::Level::DEBUG;
    }
    if seen.len() < 64 {
        seen.push(condition.to_string());
    }
    tracing::Level::WARN
}

/// Log `msg` at `level` and keep it as this thread's last error.
fn report(level: tracing::Level, msg: &str) {
    match level {
        tracing::Level::ERROR => tracing::error!("{msg}"),
        tracing::Level::WARN => tracing::warn!("{msg}"),
        tracing::Level::INFO => tracing::info!("{msg}"),
        _ => tracing::debug!("{msg}"),
    }
    let c = to_cstring(msg);
    let _ = LAST_ERROR.try_with(|e| *e.borrow_mut() = c);
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic payload".to_string()
    }
}

/// Run `f`; a panic becomes an error report and `fallback`.
fn guard<T>(func: &'static str, fallback: T, f: impl FnOnce() -> T) -> T {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(v) => v,
        Err(p) => {
            let _ = catch_unwind(AssertUnwindSafe(|| {
                report(
                    tracing::Level::ERROR,
                    &format!("{func}: internal error (panic): {}", panic_message(&*p)),
                )
            }));
            fallback
        }
    }
}

/// An allocation error in words, led by its kind.
fn describe(e: &AllocError) -> String {
    match e {
        AllocError::TooLarge { .. } => format!("request too large: {e}"),
        _ => e.to_string(),
    }
}

fn ptr_to_u64(p: *const c_void) -> u64 {
    p.addr() as u64
}

/// The stream torch passed (a `cudaStream_t`).
fn torch_stream(p: *const c_void) -> Stream {
    // SAFETY: torch passes 0 or a live stream of the device's current (primary) context,
    // which the caching-allocator contract keeps alive while memory allocated or freed on it
    // is in use; the CPU backends take any value.
    unsafe { Stream::from_raw(ptr_to_u64(p)) }
}

fn u64_to_ptr(a: u64) -> *mut c_void {
    std::ptr::with_exposed_provenance_mut(a as usize)
}

// ---------------------------------------------------------------------------------------
// The exports.

/// Allocate `size` bytes on `device` for use on `stream` (a `cudaStream_t`, NULL for the
/// default stream). The `CUDAPluggableAllocator` allocation function.
///
/// Returns NULL on failure (zero size, too large, out of memory, device out of range, invalid
/// configuration); [`stitch_last_error`] says why. With `on_oom:abort` in the configuration,
/// running out of memory prints the diagnosis and aborts the process instead.
///
/// Torch 2.11 does not check this pointer: after a NULL, `torch.empty` succeeds with an
/// unallocated storage and the tensor's first use raises `RuntimeError` ("... its data is
/// not allocated yet"), not `torch.cuda.OutOfMemoryError`.
#[no_mangle]
pub extern "C" fn stitch_malloc(size: usize, device: c_int, stream: *mut c_void) -> *mut c_void {
    guard("stitch_malloc", std::ptr::null_mut(), || {
        let fail = |level, m: &str| {
            report(
                level,
                &format!("stitch_malloc(size={size}, device={device}): {m}"),
            );
            std::ptr::null_mut()
        };
        let rt = runtime();
        let a = match rt.allocator(device) {
            Ok(a) => a,
            Err(m) => return fail(first_time(&m), &m),
        };
        match a.alloc(size as u64, torch_stream(stream)) {
            Ok(p) => u64_to_ptr(p.addr()),
            // Torch asks for zero bytes for every empty tensor: not worth a warning.
            Err(AllocError::ZeroSize) => fail(tracing::Level::DEBUG, "zero-size allocation"),
            Err(e) => {
                let oom = matches!(e, AllocError::OutOfMemory(_) | AllocError::TooLarge { .. });
                let abort = oom && rt.ready().is_ok_and(|r| r.conf.on_oom == OnOom::Abort);
                if abort {
                    eprintln!(
                        "stitch-alloc: stitch_malloc(size={size}, device={device}): {}; \
                         aborting (on_oom:abort)",
                        describe(&e)
                    );
                    std::process::abort();
                }
                fail(tracing::Level::WARN, &describe(&e))
            }
        }
    })
}

/// Free `ptr`, returned by [`stitch_malloc`] on `device`, whose last use was queued on
/// `stream`. `size` is the size asked for (0 = unknown). The `CUDAPluggableAllocator` free
/// function (torch 2.11 passes all four arguments).
///
/// NULL, a pointer this library never returned, a pointer inside an allocation, a pointer
/// freed already, or one of another device: nothing is freed, the error is logged and kept
/// for [`stitch_last_error`].
#[no_mangle]
pub extern "C" fn stitch_free(ptr: *mut c_void, size: usize, device: c_int, stream: *mut c_void) {
    guard("stitch_free", (), || {
        let addr = ptr_to_u64(ptr);
        let report_at = |level, m: &str| {
            report(
                level,
                &format!("stitch_free(ptr={addr:#x}, size={size}, device={device}): {m}"),
            )
        };
        let fail = |m: &str| report_at(tracing::Level::WARN, m);
        if ptr.is_null() {
            return fail("null pointer");
        }
        let rt = runtime();
        let a = match rt.allocator(device) {
            Ok(a) => a,
            Err(m) => return report_at(first_time(&m), &m),
        };
        if size != 0 {
            if let Some(usable) = a.usable_size(DevicePtr(addr)) {
                if size as u64 > usable {
                    fail(&format!(
                        "size {size} exceeds the allocation's {usable} bytes (freed anyway)"
                    ));
                }
            }
        }
        match a.free(DevicePtr(addr), torch_stream(stream)) {
            Ok(()) => {}
            Err(e @ AllocError::InvalidPointer { .. }) => match rt.owner_of(addr) {
                Some(other) => fail(&format!(
                    "the pointer belongs to device {other}, not {device}; not freed"
                )),
                None => fail(&describe(&e)),
            },
            Err(e) => fail(&describe(&e)),
        }
    })
}

/// Torch's init hook: called once CUDA is initialised, with the number of devices. Reads the
/// configuration (reporting an invalid one at once). Allocators are still created lazily.
#[no_mangle]
pub extern "C" fn stitch_init(device_count: c_int) {
    guard("stitch_init", (), || {
        let rt = runtime();
        rt.init_count.store(device_count, Ordering::Relaxed);
        match rt.ready() {
            Ok(r) => tracing::debug!(
                device_count,
                backend = r.backend.name(),
                served = r.slots.len(),
                "stitch_init"
            ),
            // Already printed to stderr when the configuration was read.
            Err(e) => report(tracing::Level::DEBUG, &format!("stitch_init: {e}")),
        }
    })
}

/// Torch's reset hook (`torch.cuda.empty_cache()`): release the physical memory of free
/// handles on every device back to the driver.
#[no_mangle]
pub extern "C" fn stitch_reset() {
    guard("stitch_reset", (), || {
        let rt = runtime();
        let n = rt.state.as_ref().map_or(0, |r| r.slots.len());
        for d in 0..n {
            if let Some(a) = rt.existing(d) {
                if let Err(e) = a.empty_cache() {
                    report(
                        tracing::Level::WARN,
                        &format!("stitch_reset: device {d}: {e}"),
                    );
                }
            }
        }
    })
}

/// Release the physical memory of free handles on `device`. Returns 0, or -1 on error
/// ([`stitch_last_error`]). A device not used yet has nothing to release (0).
#[no_mangle]
pub extern "C" fn stitch_empty_cache(device: c_int) -> c_int {
    guard("stitch_empty_cache", -1, || {
        let rt = runtime();
        let fail = |m: &str| {
            report(
                tracing::Level::WARN,
                &format!("stitch_empty_cache(device={device}): {m}"),
            );
            -1
        };
        if let Err(m) = rt.slot(device) {
            return fail(&m);
        }
        match rt.existing(device as usize).map(|a| a.empty_cache()) {
            None | Some(Ok(_)) => 0,
            Some(Err(e)) => fail(&e.to_string()),
        }
    })
}

/// Torch's memory-fraction hook (`torch.cuda.set_per_process_memory_fraction`): limit
/// `device` to `fraction` of its memory (and to any capacity in the configuration). Takes
/// effect only before the device's first allocation; later, the call is reported as an
/// error and changes nothing.
#[no_mangle]
pub extern "C" fn stitch_memory_fraction(fraction: c_double, device: c_int) {
    guard("stitch_memory_fraction", (), || {
        if let Err(m) = runtime().set_fraction(fraction, device) {
            report(
                tracing::Level::WARN,
                &format!("stitch_memory_fraction(fraction={fraction}, device={device}): {m}"),
            );
        }
    })
}

/// Torch's record-stream hook (`Tensor.record_stream`): the live allocation at `ptr` is also
/// used on `stream`, so its free waits for that stream's queued work too.
#[no_mangle]
pub extern "C" fn stitch_record_stream(ptr: *mut c_void, stream: *mut c_void) {
    guard("stitch_record_stream", (), || {
        let addr = ptr_to_u64(ptr);
        let report_at =
            |level, m: &str| report(level, &format!("stitch_record_stream(ptr={addr:#x}): {m}"));
        let fail = |m: &str| report_at(tracing::Level::WARN, m);
        let rt = runtime();
        if let Err(m) = rt.ready() {
            return report_at(first_time(&m), &m);
        }
        let Some(d) = rt.owner_of(addr) else {
            return fail("not a live allocation of this library");
        };
        if let Some(a) = rt.existing(d) {
            if let Err(e) = a.record_stream(DevicePtr(addr), torch_stream(stream)) {
                fail(&describe(&e));
            }
        }
    })
}

/// The statistics of `device` as a JSON object (NUL-terminated UTF-8), or NULL on error
/// ([`stitch_last_error`]). The string belongs to the library: it stays valid until the
/// next `stitch_stats_json` call on the same thread. Do not free it.
#[no_mangle]
pub extern "C" fn stitch_stats_json(device: c_int) -> *const c_char {
    guard("stitch_stats_json", std::ptr::null(), || {
        match runtime().stats_json(device) {
            Ok(s) => {
                let c = to_cstring(&s);
                STATS_BUF
                    .try_with(|b| {
                        *b.borrow_mut() = c;
                        b.borrow().as_ptr()
                    })
                    .unwrap_or(std::ptr::null())
            }
            Err(m) => {
                report(
                    tracing::Level::WARN,
                    &format!("stitch_stats_json(device={device}): {m}"),
                );
                std::ptr::null()
            }
        }
    })
}

/// The calling thread's last error message, or `""` if none since the thread started or
/// since [`stitch_clear_error`]. Owned by the library; valid until the next `stitch_*` call
/// on the same thread. Never NULL.
#[no_mangle]
pub extern "C" fn stitch_last_error() -> *const c_char {
    static EMPTY: &CStr = c"";
    guard("stitch_last_error", EMPTY.as_ptr(), || {
        LAST_ERROR
            .try_with(|e| e.borrow().as_ptr())
            .unwrap_or(EMPTY.as_ptr())
    })
}

/// Forget the calling thread's last error.
#[no_mangle]
pub extern "C" fn stitch_clear_error() {
    guard("stitch_clear_error", (), || {
        let _ = LAST_ERROR.try_with(|e| *e.borrow_mut() = CString::default());
    })
}

/// The library's version (`"0.1.0"`), a static string.
#[no_mangle]
pub extern "C" fn stitch_version() -> *const c_char {
    VERSION.as_ptr()
}

// ---------------------------------------------------------------------------------------

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn parse_defaults_and_keys() {
        assert_eq!(CapiConfig::parse("").unwrap(), CapiConfig::default());
        assert_eq!(CapiConfig::parse(" , ").unwrap(), CapiConfig::default());
        let c = CapiConfig::parse(
            "backend:host, capacity_bytes:1GiB,small_threshold:512KiB,max_handle:64MiB,\
             min_handle:4M,stitching:False,reserve_slack:0.05,log:debug,devices:2,on_oom:abort,\
             reserve_slack_min:64MiB,medium_threshold:8MiB,medium_page:32MiB",
        )
        .unwrap();
        assert_eq!(c.backend, BackendKind::Host);
        assert_eq!(c.capacity_bytes, Some(1 << 30));
        assert_eq!(c.small_threshold, Some(512 << 10));
        assert_eq!(c.max_handle, Some(64 * MIB));
        assert_eq!(c.min_handle, Some(4 * MIB));
        assert_eq!(c.stitching, Some(false));
        assert_eq!(c.reserve_slack, Some(0.05));
        assert_eq!(c.reserve_slack_min, Some(64 << 20));
        assert_eq!(
            (c.medium_threshold, c.medium_page),
            (Some(8 << 20), Some(32 << 20))
        );
        assert_eq!(c.log, LogLevel::Debug);
        assert_eq!(c.devices, Some(2));
        assert_eq!(c.on_oom, OnOom::Abort);
        let c = CapiConfig::parse("BACKEND:SIM,capacity_fraction:0.9").unwrap();
        assert_eq!(c.backend, BackendKind::Sim);
        assert_eq!(c.capacity_fraction, Some(0.9));
    }

    #[test]
    fn parse_rejects_loudly() {
        for (conf, needle) in [
            ("bogus:1", "unknown key \"bogus\""),
            ("backend", "not of the form key:value"),
            ("backend:tpu", "backend"),
            ("backend:host,backend:sim", "given twice"),
            ("capacity_fraction:0", "(0, 1]"),
            ("capacity_fraction:1.5", "(0, 1]"),
            ("capacity_fraction:nan", "(0, 1]"),
            ("capacity_bytes:0", "above zero"),
            ("capacity_bytes:12XB", "unit"),
            ("capacity_bytes:1GB", "ambiguous"),
            ("capacity_bytes:99999999999999999999", "64 bits"),
            ("capacity_bytes:20000000TiB", "64 bits"),
            ("max_handle:MiB", "byte count"),
            ("stitching:maybe", "true or false"),
            ("reserve_slack:-1", ">= 0"),
            ("log:loud", "off, error"),
            ("devices:0", "1 to 1024"),
            ("on_oom:retry", "null or abort"),
            (
                "capacity_fraction:0.5,capacity_bytes:1GiB",
                "exclude each other",
            ),
        ] {
            let e = CapiConfig::parse(conf).unwrap_err();
            assert!(e.contains(needle), "{conf}: {e}");
        }
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("2b").unwrap(), 2);
        assert_eq!(parse_size("3 KiB").unwrap(), 3 << 10);
        assert_eq!(parse_size("128MiB").unwrap(), 128 * MIB);
        assert_eq!(parse_size("1g").unwrap(), 1 << 30);
        assert_eq!(parse_size("2TiB").unwrap(), 2 << 40);
        assert!(parse_size("-1").is_err());
        assert!(parse_size("1.5GiB").is_err());
    }

    #[test]
    fn config_maps_onto_allocator_config() {
        let c =
            CapiConfig::parse("capacity_fraction:0.5,max_handle:64MiB,stitching:false").unwrap();
        let cfg = c.allocator_config(1000 * MIB, None);
        assert_eq!(cfg.capacity, Capacity::Bytes(500 * MIB));
        assert_eq!(cfg.max_handle, 64 * MIB);
        assert!(!cfg.stitching);
        // A memory fraction only lowers the capacity.
        assert_eq!(
            c.allocator_config(1000 * MIB, Some(0.25)).capacity,
            Capacity::Bytes(250 * MIB)
        );
        assert_eq!(
            c.allocator_config(1000 * MIB, Some(0.75)).capacity,
            Capacity::Bytes(500 * MIB)
        );
        let d = CapiConfig::default().allocator_config(1000 * MIB, None);
        assert_eq!(d.capacity, Capacity::Bytes(1000 * MIB));
    }

    fn host_rt(extra: &str) -> Runtime {
        let rt = Runtime::new(&format!(
            "backend:host,capacity_bytes:64MiB,devices:2{extra}"
        ));
        assert!(rt.state.is_ok(), "{:?}", rt.state.as_ref().err());
        rt
    }

    #[test]
    fn runtime_devices_are_independent_and_checked() {
        let rt = host_rt("");
        let a0 = rt.allocator(0).unwrap();
        let a1 = rt.allocator(1).unwrap();
        assert!(!std::ptr::eq(a0, a1));
        assert!(std::ptr::eq(a0, rt.allocator(0).unwrap()), "created once");
        for bad in [-1, 2, c_int::MAX] {
            let e = rt.allocator(bad).unwrap_err();
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
        let rt = Runtime::new("backend:host,nonsense:3");
        let e = rt.allocator(0).unwrap_err();
        assert!(
            e.contains("STITCH_ALLOC_CONF") && e.contains("nonsense"),
            "{e}"
        );
        assert!(rt.stats_json(0).is_err());
        assert!(rt.set_fraction(0.5, 0).is_err());
        assert_eq!(rt.owner_of(0x1000), None);
    }

    #[test]
    fn runtime_fraction_only_before_creation() {
        let rt = host_rt("");
        rt.set_fraction(0.5, 1).unwrap();
        assert!(rt.set_fraction(1.5, 1).unwrap_err().contains("(0, 1]"));
        assert!(rt.set_fraction(f64::NAN, 1).is_err());
        assert_eq!(rt.allocator(1).unwrap().capacity(), 32 * MIB);
        assert!(rt
            .set_fraction(0.25, 1)
            .unwrap_err()
            .contains("already has its allocator"));
        assert_eq!(rt.allocator(0).unwrap().capacity(), 64 * MIB);
    }

    #[test]
    fn runtime_bad_allocator_config_is_kept() {
        // 3 MiB is not a multiple of the 2 MiB granularity: Allocator::new refuses.
        let rt = host_rt(",max_handle:3MiB");
        let e = rt.allocator(0).unwrap_err();
        assert!(e.contains("max_handle"), "{e}");
        assert_eq!(rt.allocator(0).unwrap_err(), e);
    }

    #[test]
    fn stats_document() {
        let rt = host_rt("");
        let v: Value = serde_json::from_str(&rt.stats_json(1).unwrap()).unwrap();
        assert_eq!(v["initialized"], false);
        assert_eq!(v["torch"]["allocated_bytes.all.current"], 0);
        let a = rt.allocator(0).unwrap();
        let p = a.alloc(3 * MIB, Stream::DEFAULT).unwrap();
        let v: Value = serde_json::from_str(&rt.stats_json(0).unwrap()).unwrap();
        assert_eq!(v["initialized"], true);
        assert_eq!(v["backend"], "host");
        assert_eq!(v["capacity"], 64 * MIB);
        assert_eq!(v["torch"]["allocated_bytes.all.current"], 3 * MIB);
        assert_eq!(v["torch"]["requested_bytes.all.peak"], 3 * MIB);
        assert!(v["torch"]["reserved_bytes.all.current"].as_u64().unwrap() >= 3 * MIB);
        assert_eq!(v["stats"]["live_allocations"]["current"], 1);
        assert!(v["fragmentation"]["stranded_bytes"].is_u64());
        assert!(v["fragmentation"].get("stats").is_none());
        assert!(v["driver_calls"].as_u64().unwrap() > 0);
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
    fn guard_turns_panics_into_errors() {
        let r = guard("test_fn", 7, || -> i32 { panic!("boom") });
        assert_eq!(r, 7);
        let msg = LAST_ERROR.with(|e| e.borrow().to_string_lossy().into_owned());
        assert!(msg.contains("test_fn") && msg.contains("boom"), "{msg}");
        stitch_clear_error();
        assert!(LAST_ERROR.with(|e| e.borrow().is_empty()));
    }

    #[test]
    fn describe_names_too_large() {
        let e = AllocError::TooLarge {
            requested: u64::MAX,
            limit: 1,
        };
        assert!(describe(&e).starts_with("request too large"));
        assert!(to_cstring("a\0b").to_str().unwrap().contains("a\\0b"));
    }

    #[test]
    fn version_is_the_crate_version() {
        assert_eq!(VERSION.to_str().unwrap(), env!("CARGO_PKG_VERSION"));
    }
}
