//! `STITCH_ALLOC_CONF`: the allocator's [`Config`] plus the C ABI's own keys
//! ([`AbiConfig`]), read from one `key:value` list.
#![forbid(unsafe_code)]

use super::CONF_KEYS;
use crate::config::{
    de_opt_number, de_opt_parsed, de_opt_size, de_parsed, field_names, from_pairs, split_pairs,
    MAX_BYTES,
};
use crate::driver::MemInfo;
use crate::{AllocError, Backend, Capacity, Config};
use serde::{Deserialize, Deserializer, Serialize};
use std::str::FromStr;

/// Device ordinals served by the host and simulated backends when `devices` is not given.
pub(super) const DEFAULT_DEVICES: u32 = 8;
/// The most device ordinals `devices` may ask for.
pub(super) const MAX_DEVICES: u32 = 1024;

/// The level of the stderr log (`log:`).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum LogLevel {
    Off,
    Error,
    #[default]
    Warn,
    Info,
    Debug,
    Trace,
}

impl FromStr for LogLevel {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s.trim().to_ascii_lowercase().as_str() {
            "off" | "none" => LogLevel::Off,
            "error" => LogLevel::Error,
            "warn" | "warning" => LogLevel::Warn,
            "info" => LogLevel::Info,
            "debug" => LogLevel::Debug,
            "trace" => LogLevel::Trace,
            _ => return Err("expected one of off, error, warn, info, debug, trace".into()),
        })
    }
}

impl<'de> Deserialize<'de> for LogLevel {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        de_parsed(d)
    }
}

/// What `stitch_malloc` does when out of memory (`on_oom:`).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum OnOom {
    /// Return NULL.
    #[default]
    Null,
    /// Print the diagnosis and abort the process.
    Abort,
}

impl FromStr for OnOom {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "null" => Ok(OnOom::Null),
            "abort" => Ok(OnOom::Abort),
            _ => Err("expected null or abort".into()),
        }
    }
}

impl<'de> Deserialize<'de> for OnOom {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        de_parsed(d)
    }
}

/// The C ABI's keys of `STITCH_ALLOC_CONF`: which devices, how much of each, the log and the
/// out-of-memory policy. Every other key is a field of [`Config`].
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub(crate) struct AbiConfig {
    /// Auto: CUDA when usable, else an initialisation error (host and sim only by name).
    pub backend: Backend,
    /// The capacity per device as a fraction of its memory, in (0, 1]; excludes
    /// `capacity_bytes`.
    #[serde(deserialize_with = "de_opt_number")]
    pub capacity_fraction: Option<f64>,
    /// The capacity per device in bytes, in (0, `MAX_BYTES`]; on host and sim also the
    /// device's size. Excludes `capacity_fraction`.
    #[serde(deserialize_with = "de_opt_size")]
    pub capacity_bytes: Option<u64>,
    /// The stderr log's level.
    pub log: LogLevel,
    /// Device ordinals served (host, sim: default [`DEFAULT_DEVICES`]; cuda: a cap on the
    /// devices found), in `1..=MAX_DEVICES`.
    #[serde(deserialize_with = "de_opt_parsed")]
    pub devices: Option<u32>,
    /// Which other devices get read-write access to every mapping of a device (CUDA only):
    /// `all` (default: every device that can access it, `cuDeviceCanAccessPeer`), `none`, or
    /// ordinals joined by `+` (`0+1`; the list's commas separate keys). Set once per mapping,
    /// spans built by stitching and growth included.
    #[serde(deserialize_with = "crate::config::de_parsed")]
    pub peers: Peers,
    /// The out-of-memory policy.
    pub on_oom: OnOom,
}

/// The `peers` key (see [`AbiConfig::peers`]).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Peers {
    /// Every device that can access the memory.
    #[default]
    All,
    /// No peer access.
    None,
    /// These ordinals (those equal to the device itself are ignored).
    List(Vec<u32>),
}

impl std::str::FromStr for Peers {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "all" => Ok(Peers::All),
            "none" => Ok(Peers::None),
            list => list
                .split('+')
                .map(|x| {
                    x.trim().parse::<u32>().ok().filter(|&d| d < MAX_DEVICES).ok_or_else(|| {
                        format!(
                            "expected all, none or device ordinals below {MAX_DEVICES} joined by                              '+' (0+1), not {s:?}"
                        )
                    })
                })
                .collect::<Result<Vec<_>, _>>()
                .map(Peers::List),
        }
    }
}

impl Peers {
    /// The peers of `device` among `accessible` (the devices that can access it).
    pub(crate) fn of(&self, device: i32, accessible: impl FnOnce() -> Vec<i32>) -> Vec<i32> {
        match self {
            Peers::All => accessible(),
            Peers::None => Vec::new(),
            Peers::List(l) => l
                .iter()
                .map(|&d| d as i32)
                .filter(|&d| d != device)
                .collect(),
        }
    }
}

impl AbiConfig {
    fn validate(&self) -> Result<(), String> {
        if let Some(f) = self.capacity_fraction.filter(|f| !(*f > 0.0 && *f <= 1.0)) {
            return Err(format!(
                "bad value {f} for capacity_fraction: expected a number in (0, 1]"
            ));
        }
        if let Some(b) = self.capacity_bytes.filter(|b| !(1..=MAX_BYTES).contains(b)) {
            return Err(format!(
                "bad value {b} for capacity_bytes: expected a byte count above zero and at \
                 most {MAX_BYTES} (1 PiB)"
            ));
        }
        if let Some(n) = self.devices.filter(|n| !(1..=MAX_DEVICES).contains(n)) {
            return Err(format!(
                "bad value {n} for devices: expected an integer from 1 to {MAX_DEVICES}"
            ));
        }
        if self.capacity_fraction.is_some() && self.capacity_bytes.is_some() {
            return Err("capacity_fraction and capacity_bytes exclude each other".into());
        }
        Ok(())
    }
}

/// `STITCH_ALLOC_CONF`, parsed and checked.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Conf {
    /// The C ABI's keys.
    pub abi: AbiConfig,
    /// The allocator's keys; its capacity is set per device from `abi`
    /// ([`Conf::allocator_config`]), so `capacity` itself is not a key.
    pub alloc: Config,
}

impl Conf {
    /// Parse a `key:value,key:value` list (keys case-insensitive); an empty string gives the
    /// defaults. Unknown keys, bad values and values [`Config::validate`] refuses are errors.
    pub fn parse(s: &str) -> Result<Self, String> {
        let pairs = split_pairs(s)?;
        let abi_keys = field_names::<AbiConfig>();
        let (abi, alloc): (Vec<_>, Vec<_>) = pairs
            .into_iter()
            .partition(|(k, _)| abi_keys.contains(&k.as_str()));
        if let Some((k, _)) = alloc.iter().find(|(k, _)| !CONF_KEYS.contains(&k.as_str())) {
            return Err(format!(
                "unknown key {k:?}; known keys: {}",
                CONF_KEYS.join(", ")
            ));
        }
        let abi: AbiConfig = from_pairs(&abi)?;
        abi.validate()?;
        let alloc: Config = from_pairs(&alloc)?;
        alloc.validate().map_err(|e| match e {
            AllocError::Config(m) => m,
            e => e.to_string(),
        })?;
        Ok(Conf { abi, alloc })
    }

    /// The allocator configuration for a device whose memory the driver reports as `mem`
    /// when its allocator is created, with a memory fraction set through
    /// `stitch_memory_fraction` (if any) as a further limit.
    ///
    /// The capacity is what the configuration asks for (`capacity_bytes`, or
    /// `capacity_fraction` of the total, or the whole total), lowered by the fraction, and
    /// never more than the memory free at creation (issue #13, item 11): memory that another
    /// process, or this process's CUDA context and other allocations, already holds cannot be
    /// handed out, and counting it would only move the out-of-memory error from this
    /// allocator's diagnosis to a failed `cuMemCreate`. Memory freed by others later is not
    /// added. On host and sim the whole device is free at creation, so nothing changes there.
    pub fn allocator_config(&self, mem: MemInfo, fraction: Option<f64>) -> Config {
        let cap = self.capacity_limit(mem.total, fraction).min(mem.free);
        self.alloc.clone().with_capacity(Capacity::Bytes(cap))
    }

    /// The capacity this configuration and a memory fraction (torch's
    /// `set_per_process_memory_fraction`) allow on a device of `total` bytes.
    pub fn capacity_limit(&self, total: u64, fraction: Option<f64>) -> u64 {
        let mut cap = match (self.abi.capacity_bytes, self.abi.capacity_fraction) {
            (Some(b), _) => b,
            (None, Some(f)) => (total as f64 * f) as u64,
            (None, None) => total,
        };
        if let Some(f) = fraction {
            cap = cap.min((total as f64 * f) as u64);
        }
        cap
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn keys_are_the_fields() {
        let abi = field_names::<AbiConfig>();
        let cfg = field_names::<Config>();
        let mut want: Vec<&str> = abi
            .iter()
            .chain(cfg.iter().filter(|k| **k != "capacity"))
            .copied()
            .collect();
        let mut have = CONF_KEYS.to_vec();
        want.sort_unstable();
        have.sort_unstable();
        assert_eq!(have, want);
    }

    #[test]
    fn peers_all_none_or_a_list() {
        assert_eq!(Conf::parse("").unwrap().abi.peers, Peers::All);
        assert_eq!(Conf::parse("peers:none").unwrap().abi.peers, Peers::None);
        let c = Conf::parse("peers:0+2, devices:3").unwrap();
        assert_eq!(c.abi.peers, Peers::List(vec![0, 2]));
        // The device itself is never its own peer; `all` asks which devices can access it.
        assert_eq!(c.abi.peers.of(0, || unreachable!()), vec![2]);
        assert_eq!(Peers::All.of(1, || vec![0, 2]), vec![0, 2]);
        assert!(Peers::None.of(1, || unreachable!()).is_empty());
        for bad in ["peers:0,1", "peers:x", "peers:0+100000", "peers:"] {
            let e = Conf::parse(bad).unwrap_err();
            assert!(e.contains("peers") || e.contains("key:value"), "{bad}: {e}");
        }
    }

    #[test]
    fn parse_defaults_and_keys() {
        assert_eq!(Conf::parse("").unwrap(), Conf::default());
        assert_eq!(Conf::parse(" , ").unwrap(), Conf::default());
        let c = Conf::parse(
            "backend:host, capacity_bytes:1GiB,small_threshold:512KiB,max_handle:64MiB,\
             min_handle:4M,stitching:False,reserve_slack:0.05,log:debug,devices:2,on_oom:abort,\
             reserve_slack_min:64MiB,medium_threshold:8MiB,medium_page:32MiB",
        )
        .unwrap();
        assert_eq!(c.abi.backend, Backend::Host);
        assert_eq!(c.abi.capacity_bytes, Some(1 << 30));
        assert_eq!(c.abi.log, LogLevel::Debug);
        assert_eq!(c.abi.devices, Some(2));
        assert_eq!(c.abi.on_oom, OnOom::Abort);
        let want = Config::default()
            .with_small_threshold(512 << 10)
            .with_handle_sizes(4 * MIB, 64 * MIB)
            .with_stitching(false)
            .with_reserve_slack(0.05, 64 << 20)
            .with_medium(8 << 20, 32 << 20);
        assert_eq!(c.alloc, want);
        let c = Conf::parse("BACKEND:SIM,capacity_fraction:0.9").unwrap();
        assert_eq!(c.abi.backend, Backend::Sim);
        assert_eq!(c.abi.capacity_fraction, Some(0.9));
        // The keys of Config beyond the C ABI's original ones.
        let c = Conf::parse("small_page:4MiB,va_chunk:1TiB,va_limit:2TiB,paranoid:yes").unwrap();
        assert_eq!(c.alloc.small_page, Some(4 * MIB));
        assert_eq!(c.alloc.va_chunk, Some(1 << 40));
        assert_eq!(c.alloc.va_limit, 2 << 40);
        assert!(c.alloc.paranoid);
        // SI units are powers of 1000, here as in the stitch command.
        let c = Conf::parse("capacity_bytes:1MB,max_handle:1.5GiB").unwrap();
        assert_eq!(c.abi.capacity_bytes, Some(1_000_000));
        assert_eq!(c.alloc.max_handle, 3 << 29);
    }

    #[test]
    fn parse_rejects_loudly() {
        for (conf, needle) in [
            ("bogus:1", "unknown key \"bogus\""),
            ("capacity:1GiB", "unknown key \"capacity\""),
            ("backend", "not of the form key:value"),
            ("backend:tpu", "for backend: unknown backend \"tpu\""),
            ("backend:host,backend:sim", "given twice"),
            ("capacity_fraction:0", "(0, 1]"),
            ("capacity_fraction:1.5", "(0, 1]"),
            ("capacity_fraction:nan", "(0, 1]"),
            ("capacity_fraction:half", "expected a number"),
            ("capacity_bytes:0", "above zero"),
            ("capacity_bytes:12XB", "unit"),
            ("capacity_bytes:2PiB", "unit"),
            ("capacity_bytes:2048TiB", "1 PiB"),
            ("capacity_bytes:99999999999999999999", "64 bits"),
            ("capacity_bytes:20000000TiB", "64 bits"),
            ("max_handle:MiB", "byte count"),
            ("max_handle:0", "max_handle must be above zero"),
            ("medium_page:18446744073709551615", "medium_page"),
            ("min_handle:64MiB,max_handle:8MiB", "exceeds max_handle"),
            ("stitching:maybe", "true or false"),
            ("reserve_slack:-1", ">= 0"),
            ("reserve_slack:1e300", "reserve_slack"),
            ("reserve_slack:NaN", "reserve_slack"),
            ("reserve_slack:inf", "reserve_slack"),
            ("log:loud", "off, error"),
            ("devices:0", "1 to 1024"),
            ("devices:-3", "for devices"),
            ("on_oom:retry", "null or abort"),
            (
                "capacity_fraction:0.5,capacity_bytes:1GiB",
                "exclude each other",
            ),
        ] {
            let e = Conf::parse(conf).unwrap_err();
            assert!(e.contains(needle), "{conf}: {e}");
        }
        let e = Conf::parse("max_handle:12XB").unwrap_err();
        assert!(
            e.starts_with("bad value \"12XB\" for max_handle: expected"),
            "{e}"
        );
    }

    /// All of `total` free.
    fn idle(total: u64) -> MemInfo {
        MemInfo { free: total, total }
    }

    #[test]
    fn config_maps_onto_allocator_config() {
        let c = Conf::parse("capacity_fraction:0.5,max_handle:64MiB,stitching:false").unwrap();
        let cfg = c.allocator_config(idle(1000 * MIB), None);
        assert_eq!(cfg.capacity, Capacity::Bytes(500 * MIB));
        assert_eq!(cfg.max_handle, 64 * MIB);
        assert!(!cfg.stitching);
        // A memory fraction only lowers the capacity.
        assert_eq!(
            c.allocator_config(idle(1000 * MIB), Some(0.25)).capacity,
            Capacity::Bytes(250 * MIB)
        );
        assert_eq!(
            c.allocator_config(idle(1000 * MIB), Some(0.75)).capacity,
            Capacity::Bytes(500 * MIB)
        );
        let d = Conf::default().allocator_config(idle(1000 * MIB), None);
        assert_eq!(
            d,
            Config::default().with_capacity(Capacity::Bytes(1000 * MIB))
        );
    }

    #[test]
    fn capacity_never_counts_memory_held_by_others() {
        // Another process holds 600 of 1000 MiB: the default capacity is what is free.
        let busy = MemInfo {
            free: 400 * MIB,
            total: 1000 * MIB,
        };
        let cap = |c: &str, f| Conf::parse(c).unwrap().allocator_config(busy, f).capacity;
        assert_eq!(cap("", None), Capacity::Bytes(400 * MIB));
        assert_eq!(
            cap("capacity_fraction:0.9", None),
            Capacity::Bytes(400 * MIB)
        );
        assert_eq!(
            cap("capacity_bytes:800MiB", None),
            Capacity::Bytes(400 * MIB)
        );
        // Limits below the free memory are kept.
        assert_eq!(
            cap("capacity_fraction:0.25", None),
            Capacity::Bytes(250 * MIB)
        );
        assert_eq!(cap("", Some(0.1)), Capacity::Bytes(100 * MIB));
    }
}
