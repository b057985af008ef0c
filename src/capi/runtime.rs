//! The per-process state behind the exports: the configuration (or why it is invalid), the
//! backend, and one lazily created allocator per device.
#![forbid(unsafe_code)]

use super::conf::{Conf, LogLevel, DEFAULT_DEVICES, MAX_DEVICES};
use super::stats::StatsDoc;
use super::CONF_ENV;
use crate::driver::host::HOST_DEFAULT_CAPACITY;
use crate::driver::sim::H200_CAPACITY;
use crate::driver::{HostDriver, SimDriver, Timed};
use crate::{Allocator, AnyDriver, Backend, CudaDriver, DevicePtr, Driver};
use parking_lot::Mutex;
use std::ffi::c_int;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::OnceLock;

/// Every driver call is timed (two clock reads per call, on the slow path only), so that the
/// statistics can say how much wall time the allocator spent inside the driver.
pub(super) type Alloc = Allocator<Timed<AnyDriver>>;

struct Slot {
    /// Created on first use; a failure to create is kept and reported on every later use.
    alloc: OnceLock<Result<Alloc, String>>,
    /// A fraction set before creation (held locked while creating).
    fraction: Mutex<Option<f64>>,
}

/// A valid configuration and the devices it serves.
pub(super) struct Ready {
    pub conf: Conf,
    /// The backend in use: `conf.abi.backend` with `auto` resolved (never `Auto`).
    pub backend: Backend,
    slots: Vec<Slot>,
}

/// Everything the exports share: the configuration (or why it is invalid) and the devices.
pub(super) struct Runtime {
    raw_conf: String,
    pub state: Result<Ready, String>,
    /// The device count torch passed to `stitch_init` (-1 before).
    pub init_count: AtomicI32,
}

impl Runtime {
    pub fn new(raw_conf: &str) -> Self {
        let state = Conf::parse(raw_conf)
            .map_err(|e| format!("invalid {CONF_ENV} {raw_conf:?}: {e}"))
            .and_then(Ready::new);
        Runtime {
            raw_conf: raw_conf.to_string(),
            state,
            init_count: AtomicI32::new(-1),
        }
    }

    pub fn ready(&self) -> Result<&Ready, String> {
        self.state.as_ref().map_err(Clone::clone)
    }

    /// The number of device slots (0 with an invalid configuration).
    pub fn devices(&self) -> usize {
        self.state.as_ref().map_or(0, |r| r.slots.len())
    }

    /// The slot of `device`, checked.
    fn slot(&self, device: c_int) -> Result<(&Ready, &Slot), String> {
        let r = self.ready()?;
        match usize::try_from(device).ok().and_then(|d| r.slots.get(d)) {
            Some(s) => Ok((r, s)),
            None if r.slots.is_empty() => Err(format!(
                "device {device} is out of range: the {} backend found no device",
                r.backend
            )),
            None => Err(format!(
                "device {device} is out of range: the {} backend serves devices 0 to {}",
                r.backend,
                r.slots.len() - 1
            )),
        }
    }

    /// Check that `device` is served.
    pub fn check_device(&self, device: c_int) -> Result<(), String> {
        self.slot(device).map(|_| ())
    }

    /// The allocator of `device`, created on first use.
    pub fn allocator(&self, device: c_int) -> Result<&Alloc, String> {
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
    pub fn existing(&self, device: usize) -> Option<&Alloc> {
        let r = self.state.as_ref().ok()?;
        r.slots.get(device)?.alloc.get()?.as_ref().ok()
    }

    /// The device whose allocator holds a live allocation at `addr`.
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
    pub fn stats_json(&self, device: c_int) -> Result<String, String> {
        let (r, _) = self.slot(device)?;
        let a = self.existing(device as usize);
        let init = self.init_count.load(Ordering::Relaxed);
        StatsDoc::new(device, r.backend, init, &self.raw_conf, a)?.to_json()
    }
}

impl Ready {
    fn new(conf: Conf) -> Result<Self, String> {
        let backend = match conf.abi.backend {
            Backend::Host => Backend::Host,
            Backend::Sim => Backend::Sim,
            Backend::Cuda if CudaDriver::available() => Backend::Cuda,
            Backend::Cuda => {
                return Err(format!(
                    "backend cuda: no usable CUDA device ({})",
                    CudaDriver::unavailable_reason().unwrap_or_default()
                ))
            }
            Backend::Auto if CudaDriver::available() => Backend::Cuda,
            // The one rule (`Backend`): host memory or the simulator only when named.
            Backend::Auto => {
                return Err(format!(
                    "backend auto: no usable CUDA device ({}); set backend:host or backend:sim \
                     to run without a GPU",
                    CudaDriver::unavailable_reason().unwrap_or_default()
                ))
            }
        };
        let n = match backend {
            Backend::Cuda => {
                let count = u32::try_from(CudaDriver::device_count()).unwrap_or(0);
                count.min(conf.abi.devices.unwrap_or(MAX_DEVICES))
            }
            _ => conf.abi.devices.unwrap_or(DEFAULT_DEVICES),
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
        let bytes = self.conf.abi.capacity_bytes;
        let driver = match self.backend {
            // `Auto` never gets here: `Ready::new` resolved it.
            Backend::Cuda | Backend::Auto => CudaDriver::new(device)
                .map(AnyDriver::Cuda)
                .map_err(|e| format!("could not open CUDA device {device}: {e}"))?,
            Backend::Host => HostDriver::with_capacity(bytes.unwrap_or(HOST_DEFAULT_CAPACITY))
                .map(AnyDriver::Host)
                .map_err(|e| format!("could not open the host backend: {e}"))?,
            Backend::Sim => {
                AnyDriver::Sim(SimDriver::with_capacity(bytes.unwrap_or(H200_CAPACITY)))
            }
        };
        let total = driver
            .mem_info()
            .map_err(|e| format!("device {device}: {e}"))?
            .total;
        let cfg = self.conf.allocator_config(total, fraction);
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

static RUNTIME: OnceLock<Runtime> = OnceLock::new();

/// The process's runtime, configured from `STITCH_ALLOC_CONF` on first use.
pub(super) fn runtime() -> &'static Runtime {
    RUNTIME.get_or_init(|| {
        let raw = std::env::var(CONF_ENV).unwrap_or_default();
        // The log level first, so that backend selection can already log.
        let level = Conf::parse(&raw).map_or(LogLevel::Warn, |c| c.abi.log);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Stream;
    use serde_json::Value;

    const MIB: u64 = 1 << 20;

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
        for (conf, needle) in [
            ("backend:host,nonsense:3", "nonsense"),
            ("backend:host,reserve_slack:1e300", "reserve_slack"),
        ] {
            let rt = Runtime::new(conf);
            let e = rt.allocator(0).unwrap_err();
            assert!(e.contains("STITCH_ALLOC_CONF") && e.contains(needle), "{e}");
            assert!(rt.stats_json(0).is_err());
            assert!(rt.set_fraction(0.5, 0).is_err());
            assert_eq!(rt.owner_of(0x1000), None);
            assert_eq!(rt.devices(), 0);
        }
    }

    /// The one backend rule: `auto` (also the default) is CUDA or an error, never host.
    #[test]
    fn runtime_auto_is_cuda_or_an_error() {
        for conf in ["backend:auto", ""] {
            let rt = Runtime::new(conf);
            match rt.ready() {
                Ok(r) => {
                    assert!(CudaDriver::available());
                    assert_eq!(r.backend, Backend::Cuda);
                }
                Err(e) => {
                    assert!(!CudaDriver::available());
                    assert!(e.contains("no usable CUDA device"), "{e}");
                    assert!(
                        e.contains("backend:host") && e.contains("backend:sim"),
                        "{e}"
                    );
                    assert!(rt.allocator(0).is_err());
                    assert_eq!(rt.devices(), 0);
                }
            }
        }
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
        let text = rt.stats_json(0).unwrap();
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["initialized"], true);
        assert_eq!(v["backend"], "host");
        assert_eq!(v["capacity"], 64 * MIB);
        assert_eq!(v["conf"], "backend:host,capacity_bytes:64MiB,devices:2");
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
}
