//! Choosing a driver at run time: [`AnyDriver`] is one of the backends behind one type.
#![forbid(unsafe_code)]

use crate::driver::{CudaDriver, Driver, DriverError, Forward, HostDriver, SimDriver};
use serde::{Deserialize, Deserializer, Serialize};
use std::fmt;
use std::str::FromStr;

/// The crate's backends by name: the one list, used by [`AnyDriver::open`], the C ABI
/// (`backend:` in `STITCH_ALLOC_CONF`) and the `stitch` command (`--backend`). Parsed
/// case-insensitively from `auto`, `cuda`, `host`, `sim` ([`FromStr`], serde).
///
/// **The rule: memory that is not GPU memory is never handed out silently.** `Auto` means
/// "a usable CUDA device, else an error that says why" everywhere: [`AnyDriver::auto`]
/// returns [`BackendError::NoCuda`], the C ABI fails its initialisation (every allocation
/// returns NULL, the error names the reason), `stitch replay`, `map` and `info` exit with
/// that error. Host memory (`Host`) and the simulator (`Sim`) are used only when named. Two
/// places name one for you, and say so: `stitch replay`, `map` and `info` default to `sim`
/// (a replay is a model: it hands out no memory), and `stitch demo` runs on `host` when no
/// GPU is present and prints that it does.
///
/// ```
/// use stitch_alloc::Backend;
/// assert_eq!(" SIM ".parse::<Backend>().unwrap(), Backend::Sim);
/// assert_eq!(Backend::Host.to_string(), "host");
/// assert!("tpu".parse::<Backend>().is_err());
/// ```
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// A CUDA device when one is usable, else an error ([`BackendError::NoCuda`]).
    #[default]
    Auto,
    /// A real GPU through the CUDA driver ([`CudaDriver`]).
    Cuda,
    /// Operating-system virtual memory ([`HostDriver`]).
    Host,
    /// The accounting-only simulator ([`SimDriver`]).
    Sim,
}

impl Backend {
    /// Every backend, in the order of [`AnyDriver::NAMES`].
    pub const ALL: [Backend; 4] = [Backend::Auto, Backend::Sim, Backend::Host, Backend::Cuda];

    /// The backend's name, as parsed.
    ///
    /// ```
    /// use stitch_alloc::Backend;
    /// assert_eq!(Backend::Sim.name(), "sim");
    /// for b in Backend::ALL {
    ///     assert_eq!(b.name().parse::<Backend>().unwrap(), b);
    /// }
    /// ```
    pub const fn name(self) -> &'static str {
        match self {
            Backend::Auto => "auto",
            Backend::Cuda => "cuda",
            Backend::Host => "host",
            Backend::Sim => "sim",
        }
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Backend {
    type Err = BackendError;
    fn from_str(s: &str) -> Result<Self, BackendError> {
        let name = s.trim().to_ascii_lowercase();
        Backend::ALL
            .into_iter()
            .find(|b| b.name() == name)
            .ok_or_else(|| BackendError::UnknownName(s.to_string()))
    }
}

impl<'de> Deserialize<'de> for Backend {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        crate::config::de_parsed(d)
    }
}

/// Any of the crate's backends, chosen at run time (for command-line tools, benchmarks and
/// tests that run on a GPU when there is one and on a named CPU backend otherwise).
///
/// ```
/// use stitch_alloc::{Allocator, AnyDriver, Backend, Config, Driver, Stream};
/// // CUDA device 0 if usable; without a GPU, the simulator, asked for by name.
/// let d = AnyDriver::auto().or_else(|e| {
///     eprintln!("{e}");
///     AnyDriver::open(Backend::Sim)
/// }).unwrap();
/// println!("running on {}", d.name());
/// let a = Allocator::new(d, Config::default()).unwrap();
/// let p = a.alloc(64 << 20, Stream::DEFAULT).unwrap();
/// a.free(p, Stream::DEFAULT).unwrap();
/// ```
#[derive(Debug)]
pub enum AnyDriver {
    /// The accounting-only simulator.
    Sim(SimDriver),
    /// Operating-system virtual memory.
    Host(HostDriver),
    /// A real CUDA device.
    Cuda(CudaDriver),
}

/// Why [`AnyDriver::from_name`] or [`AnyDriver::open`] could not give a driver.
///
/// ```
/// use stitch_alloc::{AnyDriver, Backend, BackendError};
/// let e = "tpu".parse::<Backend>().unwrap_err();
/// assert_eq!(e, BackendError::UnknownName("tpu".into()));
/// assert!(e.to_string().contains("expected one of auto, sim, host, cuda"), "{e}");
/// assert!(matches!(AnyDriver::from_name("gpu"), Err(BackendError::UnknownName(_))));
/// ```
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BackendError {
    /// The name is none of `auto`, `sim`, `host`, `cuda`.
    #[error("unknown backend {0:?}: expected one of auto, sim, host, cuda")]
    UnknownName(String),
    /// `auto` found no usable CUDA device; the CPU backends are used only when named.
    #[error(
        "backend auto found no usable CUDA device ({source}); name a CPU backend to run \
         without a GPU: host (host memory) or sim (the accounting-only simulator)"
    )]
    NoCuda {
        /// Why CUDA device 0 could not be opened.
        #[source]
        source: DriverError,
    },
    /// The backend exists but could not be opened (no GPU, no libcuda, host limits, ...).
    #[error("backend {name} is unavailable: {source}")]
    Unavailable {
        /// The backend asked for.
        name: &'static str,
        /// The driver's error.
        #[source]
        source: DriverError,
    },
}

impl AnyDriver {
    /// The names [`AnyDriver::from_name`] accepts (those of [`Backend::ALL`]).
    pub const NAMES: [&'static str; 4] = [
        Backend::ALL[0].name(),
        Backend::ALL[1].name(),
        Backend::ALL[2].name(),
        Backend::ALL[3].name(),
    ];

    /// CUDA device 0, or [`BackendError::NoCuda`] saying why it is unusable (no libcuda,
    /// no device, no virtual memory management). Never a CPU backend: those are opened only
    /// by name (see [`Backend`]).
    ///
    /// ```
    /// use stitch_alloc::{AnyDriver, BackendError, Driver};
    /// match AnyDriver::auto() {
    ///     Ok(d) => assert_eq!(d.name(), "cuda"),
    ///     Err(e) => {
    ///         assert!(matches!(e, BackendError::NoCuda { .. }));
    ///         eprintln!("{e}"); // names the reason and the backends to name instead
    ///     }
    /// }
    /// ```
    pub fn auto() -> Result<Self, BackendError> {
        CudaDriver::new(0)
            .map(AnyDriver::Cuda)
            .map_err(|source| BackendError::NoCuda { source })
    }

    /// The backend called `name` (case-insensitive): `"auto"` ([`AnyDriver::auto`]: CUDA or
    /// an error),
    /// `"sim"` ([`SimDriver::new`]), `"host"` ([`HostDriver::new`]) or `"cuda"` (device 0).
    ///
    /// ```
    /// use stitch_alloc::{AnyDriver, BackendError, Driver};
    /// assert_eq!(AnyDriver::from_name("sim").unwrap().name(), "sim");
    /// assert!(matches!(AnyDriver::from_name("tpu"), Err(BackendError::UnknownName(_))));
    /// match AnyDriver::from_name("cuda") {
    ///     Ok(d) => assert_eq!(d.name(), "cuda"),
    ///     Err(e) => eprintln!("{e}"), // no GPU here
    /// }
    /// ```
    pub fn from_name(name: &str) -> Result<Self, BackendError> {
        Self::open(name.parse()?)
    }

    /// The driver of `backend`: [`AnyDriver::auto`], [`SimDriver::new`], [`HostDriver::new`]
    /// or CUDA device 0.
    ///
    /// ```
    /// use stitch_alloc::{AnyDriver, Backend, Driver};
    /// assert_eq!(AnyDriver::open(Backend::Sim).unwrap().name(), "sim");
    /// ```
    pub fn open(backend: Backend) -> Result<Self, BackendError> {
        let unavailable = |name| move |source| BackendError::Unavailable { name, source };
        match backend {
            Backend::Auto => Self::auto(),
            Backend::Sim => Ok(AnyDriver::Sim(SimDriver::new())),
            Backend::Host => HostDriver::new()
                .map(AnyDriver::Host)
                .map_err(unavailable("host")),
            Backend::Cuda => CudaDriver::new(0)
                .map(AnyDriver::Cuda)
                .map_err(unavailable("cuda")),
        }
    }

    /// The driver as a trait object.
    ///
    /// ```
    /// use stitch_alloc::AnyDriver;
    /// assert_eq!(AnyDriver::from_name("sim").unwrap().as_dyn().name(), "sim");
    /// ```
    pub fn as_dyn(&self) -> &(dyn Driver + 'static) {
        match self {
            AnyDriver::Sim(d) => d,
            AnyDriver::Host(d) => d,
            AnyDriver::Cuda(d) => d,
        }
    }
}

impl From<SimDriver> for AnyDriver {
    fn from(d: SimDriver) -> Self {
        AnyDriver::Sim(d)
    }
}

impl From<HostDriver> for AnyDriver {
    fn from(d: HostDriver) -> Self {
        AnyDriver::Host(d)
    }
}

impl From<CudaDriver> for AnyDriver {
    fn from(d: CudaDriver) -> Self {
        AnyDriver::Cuda(d)
    }
}

/// Delegates every call to the chosen backend.
impl Forward for AnyDriver {
    type Inner = dyn Driver + 'static;
    fn inner(&self) -> &(dyn Driver + 'static) {
        self.as_dyn()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `auto` is CUDA or an error that says why, never a CPU backend.
    #[test]
    fn auto_is_cuda_or_an_error() {
        match AnyDriver::auto() {
            Ok(d) => {
                assert!(CudaDriver::available());
                assert_eq!(d.name(), "cuda");
            }
            Err(e) => {
                assert!(!CudaDriver::available());
                assert!(matches!(e, BackendError::NoCuda { .. }), "{e:?}");
                let text = e.to_string();
                assert!(text.contains("no usable CUDA device"), "{text}");
                assert!(text.contains("host") && text.contains("sim"), "{text}");
            }
        }
        // By name, as `auto`.
        match AnyDriver::from_name("auto") {
            Ok(d) => assert_eq!(d.name(), "cuda"),
            Err(e) => assert!(matches!(e, BackendError::NoCuda { .. }), "{e:?}"),
        }
    }

    #[test]
    fn names() {
        assert_eq!(AnyDriver::from_name("sim").unwrap().name(), "sim");
        assert_eq!(AnyDriver::from_name(" SIM ").unwrap().name(), "sim");
        assert!(!AnyDriver::from_name("sim").unwrap().has_data());
        let host = AnyDriver::from_name("host").unwrap();
        assert_eq!(host.name(), "host");
        assert!(host.has_data());
        match AnyDriver::from_name("gpu") {
            Err(BackendError::UnknownName(n)) => assert_eq!(n, "gpu"),
            other => panic!("expected UnknownName, got {other:?}"),
        }
        for n in AnyDriver::NAMES {
            if n != "cuda" && n != "auto" {
                assert!(AnyDriver::from_name(n).is_ok(), "{n}");
            }
        }
    }

    #[test]
    fn one_backend_enum() {
        for (b, n) in Backend::ALL.into_iter().zip(AnyDriver::NAMES) {
            assert_eq!(b.name(), n);
            assert_eq!(n.parse::<Backend>().unwrap(), b);
            assert_eq!(n.to_ascii_uppercase().parse::<Backend>().unwrap(), b);
            let j = serde_json::to_string(&b).unwrap();
            assert_eq!(j, format!("\"{n}\""));
            assert_eq!(serde_json::from_str::<Backend>(&j).unwrap(), b);
        }
        assert_eq!(Backend::default(), Backend::Auto);
        assert!(matches!(
            "gpu".parse::<Backend>(),
            Err(BackendError::UnknownName(n)) if n == "gpu"
        ));
        assert!(serde_json::from_str::<Backend>("\"gpu\"").is_err());
        assert_eq!(AnyDriver::open(Backend::Host).unwrap().name(), "host");
    }

    #[test]
    fn cuda_by_name_matches_availability() {
        match AnyDriver::from_name("cuda") {
            Ok(d) => {
                assert!(CudaDriver::available());
                assert_eq!(d.name(), "cuda");
            }
            Err(e) => {
                assert!(!CudaDriver::available());
                assert!(matches!(e, BackendError::Unavailable { name: "cuda", .. }));
                assert!(e.to_string().contains("cuda"), "{e}");
            }
        }
    }
}
