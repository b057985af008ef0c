//! Allocator configuration: [`Config`], the one place its values are checked, the one byte
//! count parser ([`parse_size`]), and the reader of `key:value` lists (`STITCH_ALLOC_CONF`).
//!
//! A `Config` comes from Rust (`Config::default()` and the `with_*` methods, or serde), from
//! `STITCH_ALLOC_CONF` (the C ABI, `crate::capi`) and from the `stitch` command's flags alike:
//! every source sets the same fields, every value is checked by [`Config::validate`] (and,
//! against the device, by the resolution in `Allocator::new`), and the defaults are those of
//! [`Config::default`] only.
#![forbid(unsafe_code)]

use crate::driver::MemInfo;
use crate::error::{AllocError, Result};
use serde::de::{self, DeserializeOwned, IntoDeserializer, MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize};
use std::fmt;
use std::str::FromStr;

/// The largest byte count any setting may take: 1 PiB, far above any device, low enough that
/// no sum or product the allocator forms from its settings can overflow 64 bits.
pub const MAX_BYTES: u64 = 1 << 50;

/// The largest growth slack ([`Config::reserve_slack`]): 1000 times the peak of live bytes
/// is a plain cache long before.
pub const MAX_RESERVE_SLACK: f64 = 1000.0;

/// How much physical memory the allocator may hold.
///
/// In serde's data model (JSON, ...): `{"bytes": 8589934592}` (or `{"bytes": "8GiB"}`, see
/// [`parse_size`]) or `{"fraction": 0.5}`.
///
/// ```
/// use stitch_alloc::Capacity;
/// let c: Capacity = serde_json::from_str(r#"{"bytes": "8GiB"}"#).unwrap();
/// assert_eq!(c, Capacity::Bytes(8 << 30));
/// let f: Capacity = serde_json::from_str(r#"{"fraction": 0.5}"#).unwrap();
/// assert_eq!(f, Capacity::Fraction(0.5));
/// ```
#[derive(Copy, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Capacity {
    /// A fixed number of bytes (rounded down to the granularity).
    Bytes(#[serde(deserialize_with = "de_size")] u64),
    /// A fraction of the device's total memory, in (0, 1].
    Fraction(#[serde(deserialize_with = "de_number")] f64),
}

/// Allocator settings. Build with `Config::default()` and the `with_*` methods, or
/// deserialize with serde (missing fields take their defaults, unknown fields are refused;
/// byte counts may be numbers or strings such as `"128MiB"`, see [`parse_size`]).
///
/// `None` in an optional field means "derived from the device or the other fields", as each
/// field says. Every value is checked by [`Config::validate`] when the allocator is created.
///
/// ```
/// use stitch_alloc::{Capacity, Config};
/// let c = Config::default()
///     .with_capacity(Capacity::Bytes(8 << 30))
///     .with_small_threshold(1 << 20)
///     .with_stitching(false);
/// assert!(!c.stitching);
/// let j: Config = serde_json::from_str(r#"{"max_handle": "64MiB", "stitching": false}"#).unwrap();
/// assert_eq!(j, Config::default().with_handle_sizes(0, 64 << 20).with_stitching(false));
/// assert!(serde_json::from_str::<Config>(r#"{"max_handel": 1}"#).is_err());
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct Config {
    /// Physical memory limit (default: the whole device; a fraction is capped at the memory
    /// free when the allocator starts).
    pub capacity: Capacity,
    /// Requests up to this many bytes are packed into small pages (default 256 KiB: larger
    /// ones pack better side by side in the large pool, since a small page is a run of its
    /// own; design/zoo.md "Twenty-fifth session"); at most half a small page.
    #[serde(deserialize_with = "de_size")]
    pub small_threshold: u64,
    /// Size of one small page, a multiple of the granularity (`None`: the granularity).
    #[serde(deserialize_with = "de_opt_size")]
    pub small_page: Option<u64>,
    /// Requests above the small threshold and up to this many bytes are packed into medium
    /// pages, so that they never pin a large handle (`None`, or a value at or below the
    /// small threshold: off). Capped at half a medium page. Measured trade-off
    /// (design/ARCHITECTURE.md 4.5): it lowers stranding when medium tensors outlive the
    /// large ones around them, but a checkerboard of medium tensors strands half-used pages
    /// (92.7% of free memory in one piece instead of 100%).
    #[serde(deserialize_with = "de_opt_size")]
    pub medium_threshold: Option<u64>,
    /// Size of one medium page (default 64 MiB; rounded up to the granularity, capped at
    /// `max_handle`).
    #[serde(deserialize_with = "de_size")]
    pub medium_page: u64,
    /// Smallest handle created for a large request, a multiple of the granularity (`None`:
    /// the granularity). Larger values make fewer, larger handles for mid-sized requests.
    #[serde(deserialize_with = "de_opt_size")]
    pub min_handle: Option<u64>,
    /// Largest handle created to grow the pool, a multiple of the granularity; a larger need
    /// is built from several (default 8 MiB since 2026-12-02, 20 MiB, the page of PyTorch's
    /// expandable segments, before). A
    /// stitch by re-creation, which builds one allocation's span, creates handles of up to
    /// 128 MiB (or this, if larger). Smaller values strand less memory but cost more driver
    /// calls (see `design/ARCHITECTURE.md`, section 4.4, and design/zoo.md for the measured
    /// trade-off).
    #[serde(deserialize_with = "de_size")]
    pub max_handle: u64,
    /// New large-pool memory is created in handles of about `request / handle_divisor`
    /// bytes (a power of two times the granularity, between `split_min` and `max_handle`),
    /// so that a later, smaller request reusing the memory can be cut at a handle boundary
    /// and strands little (default 128 since 2026-12-07, 64 from 2026-12-02, 32 before, 16
    /// before that; 1 = handles of `max_handle`, the fewest driver calls). The zoo of real
    /// PyTorch workloads (design/zoo.md) measures the trade-off.
    #[serde(deserialize_with = "de_parsed")]
    pub handle_divisor: u64,
    /// The smallest handle `handle_divisor` splits down to, a multiple of the granularity
    /// (default 2 MiB, one granule, since 2026-12-02; 4 MiB before): the floor under the
    /// number of driver calls per byte created.
    #[serde(deserialize_with = "de_size")]
    pub split_min: u64,
    /// When stitching moves two or more clean free handles, release them and create the
    /// span's memory anew instead of remapping each (default on): a release costs less than
    /// an unmap plus a SetAccess, and the span ends up with few handles. Memory released to
    /// the driver can be taken by another process before it is created again: turn it off
    /// when several processes share the device and one must never see an OOM it would not
    /// have seen with remapping.
    #[serde(deserialize_with = "de_flag")]
    pub recreate: bool,
    /// Contiguous growth (default on): a new large span (created or stitched) is mapped
    /// right after the end of a mapped run and linked into it, as expandable segments grow
    /// one segment at its end: a free tail grows with the new memory into one free block
    /// instead of staying stranded beside a span placed elsewhere, free blocks on either
    /// side of each join merge when they are freed, and an allocation takes the start of
    /// its free block, except that a large request skips a piece of at most 1/50 of its
    /// size to start at a handle boundary when that piece shares a handle with a live
    /// neighbour (so freeing either frees whole handles: the checkerboard's largest tensor
    /// stays 99.8% of free memory). The run chosen is the one with the largest clean free
    /// tail, else the one that ends highest. On the zoo of real workloads it lowers peak
    /// reserved / peak live (geometric mean 1.0324 -> 1.0195 at `--gpu-lag 1000`) at 29%
    /// less modeled driver time (design/zoo.md). Off places each new span alone in the
    /// middle of the largest free address range, and places a large allocation inside a
    /// larger free block where it strands the fewest free handle bytes.
    pub contiguous: bool,
    /// Remap free handles into contiguous spans when no free span fits (default on). Off
    /// gives a plain caching allocator on VMM that releases and re-creates instead.
    #[serde(deserialize_with = "de_flag")]
    pub stitching: bool,
    /// Growth slack: while the physical memory held stays within `(1 + reserve_slack)` times
    /// the peak of live bytes, a miss creates new memory (one or a few driver calls) instead
    /// of remapping free handles, and a large request avoids pinning a free block four or
    /// more times its size. Past that budget, free handles are reused (stitched) first.
    /// 0 = always reuse first (lowest memory, most remapping); large = a plain cache.
    /// Default 0 (the zoo: 0.01 with a 64 MiB floor cost up to 0.05 of peak on small
    /// workloads and saved little driver time); at most [`MAX_RESERVE_SLACK`].
    #[serde(deserialize_with = "de_number")]
    pub reserve_slack: f64,
    /// A floor under the growth slack in bytes (default 0), so that a small working set
    /// is not remapped on every miss to save a few megabytes.
    #[serde(deserialize_with = "de_size")]
    pub reserve_slack_min: u64,
    /// Size of each virtual address reservation, rounded up to the granularity (`None`: four
    /// times the capacity).
    #[serde(deserialize_with = "de_opt_size")]
    pub va_chunk: Option<u64>,
    /// Upper bound on all reservations together (default 32 TiB; the process limit is 128).
    #[serde(deserialize_with = "de_size")]
    pub va_limit: u64,
    /// Pre-allocation: bytes of physical memory created and mapped when the allocator starts
    /// (rounded up to the granularity; default 0), as one free span. A loop whose peak fits
    /// in it then makes no driver call after warm-up: its allocations are carved out of the
    /// span and its frees coalesce back (the lecture's memory pool). Reported as
    /// `Stats::preallocated`; at most the capacity.
    #[serde(deserialize_with = "de_size")]
    pub prealloc: u64,
    /// The loop region (default on): once a loop stitches again in a state it stitched in before
    /// (same request, same live bytes), its large requests are placed in one run that only grows,
    /// within 2% above the peak of live bytes (raised by doubling, up to 8%, when the mode ends for
    /// want of budget and 8% holds what was needed), so that a loop stops remapping memory every
    /// step; the mode ends by itself when shapes change (`engine/region.rs`, design/zoo.md
    /// "Fifteenth session": the batch-2 training loop settles for 0-0.4% more memory; "Thirty-first
    /// session": a loop whose shapes drift in a twelve-step cycle settles at 1.05). Off: such a
    /// loop keeps stitching, and [`Config::prealloc`] is the remedy.
    #[serde(deserialize_with = "de_flag")]
    pub loop_region: bool,
    /// Growing chains placed by next fit (default on): a large request up to 64 KiB larger
    /// than a live one, where such requests' smaller neighbours have mostly been freed right
    /// after them (a KV cache grown by `torch.cat` each token), is placed in the free block at
    /// the lowest address after where the last such copy ended instead of the best-fitting
    /// one, so that the copies of a step fill the holes of the step before in order
    /// (`engine/chains.rs`; design/zoo.md "Nineteenth session": a synthetic serving loop
    /// 1.05-1.09 -> 1.034-1.066 of peak live, the zoo unchanged or lower). Off: every request
    /// takes the best fit.
    #[serde(deserialize_with = "de_flag")]
    pub chain_fit: bool,
    /// Spare pieces of live handles when stitching (default off; an experiment to decide
    /// through torch): among free handles of one size, a stitch takes first those whose
    /// removal strands no piece of a handle that a live block shares (the first whole
    /// handle of a free block that starts inside a handle, the last of one that ends inside
    /// one). Such a piece, beside a live block, is what most of the excess at the peak is
    /// made of. On the simulator it is level with the default within each set's spread
    /// (zoo, holdouts, synthetic serving loops) and lowers serve's recorded history from
    /// 1.0333 to 1.0251; through torch it is level on nine zoo workloads (1.0074 against
    /// 1.0071-1.0076), serve not yet measured (design/zoo.md, "Twenty-eighth session").
    #[serde(deserialize_with = "de_flag")]
    pub spare_pieces: bool,
    /// Check every invariant after each operation (slow; for tests and fuzzing).
    #[serde(deserialize_with = "de_flag")]
    pub paranoid: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            capacity: Capacity::Fraction(1.0),
            small_threshold: 256 << 10,
            small_page: None,
            medium_threshold: None,
            medium_page: 64 << 20,
            min_handle: None,
            max_handle: 8 << 20,
            handle_divisor: 128,
            split_min: 2 << 20,
            recreate: true,
            contiguous: true,
            stitching: true,
            reserve_slack: 0.0,
            reserve_slack_min: 0,
            va_chunk: None,
            va_limit: 32 << 40,
            prealloc: 0,
            loop_region: true,
            chain_fit: true,
            spare_pieces: false,
            paranoid: false,
        }
    }
}

impl Config {
    /// Set the capacity.
    ///
    /// ```
    /// use stitch_alloc::{Capacity, Config};
    /// let c = Config::default().with_capacity(Capacity::Bytes(8 << 30));
    /// assert_eq!(c.capacity, Capacity::Bytes(8 << 30));
    /// assert_eq!(Config::default().capacity, Capacity::Fraction(1.0));
    /// ```
    pub fn with_capacity(mut self, c: Capacity) -> Self {
        self.capacity = c;
        self
    }
    /// Set the small-request threshold.
    ///
    /// ```
    /// use stitch_alloc::Config;
    /// let c = Config::default().with_small_threshold(256 << 10);
    /// assert_eq!(c.small_threshold, 256 << 10);
    /// assert!(c.validate().is_ok());
    /// ```
    pub fn with_small_threshold(mut self, bytes: u64) -> Self {
        self.small_threshold = bytes;
        self
    }
    /// Set the medium threshold (0 = off) and page size (see [`Config::medium_threshold`]).
    ///
    /// ```
    /// use stitch_alloc::Config;
    /// let c = Config::default().with_medium(8 << 20, 64 << 20);
    /// assert_eq!((c.medium_threshold, c.medium_page), (Some(8 << 20), 64 << 20));
    /// assert_eq!(Config::default().with_medium(0, 64 << 20).medium_threshold, None);
    /// ```
    pub fn with_medium(mut self, threshold: u64, page: u64) -> Self {
        self.medium_threshold = (threshold > 0).then_some(threshold);
        self.medium_page = page;
        self
    }
    /// Set the smallest (0 = the granularity) and largest handle sizes.
    ///
    /// ```
    /// use stitch_alloc::Config;
    /// let c = Config::default().with_handle_sizes(0, 64 << 20);
    /// assert_eq!((c.min_handle, c.max_handle), (None, 64 << 20));
    /// assert!(Config::default().with_handle_sizes(8 << 20, 4 << 20).validate().is_err());
    /// ```
    pub fn with_handle_sizes(mut self, min: u64, max: u64) -> Self {
        self.min_handle = (min > 0).then_some(min);
        self.max_handle = max;
        self
    }
    /// Turn contiguous growth ([`Config::contiguous`]) on or off.
    ///
    /// ```
    /// use stitch_alloc::Config;
    /// assert!(Config::default().contiguous);
    /// assert!(!Config::default().with_contiguous(false).contiguous);
    /// ```
    pub fn with_contiguous(mut self, on: bool) -> Self {
        self.contiguous = on;
        self
    }
    /// Turn stitching on or off.
    ///
    /// ```
    /// use stitch_alloc::Config;
    /// assert!(Config::default().stitching);
    /// let c = Config::default().with_stitching(false);
    /// assert!(!c.stitching && c.validate().is_ok());
    /// ```
    pub fn with_stitching(mut self, on: bool) -> Self {
        self.stitching = on;
        self
    }
    /// Set the growth slack and its floor in bytes (see [`Config::reserve_slack`]).
    ///
    /// ```
    /// use stitch_alloc::Config;
    /// let c = Config::default().with_reserve_slack(0.1, 64 << 20);
    /// assert_eq!((c.reserve_slack, c.reserve_slack_min), (0.1, 64 << 20));
    /// assert!(Config::default().with_reserve_slack(-1.0, 0).validate().is_err());
    /// ```
    pub fn with_reserve_slack(mut self, slack: f64, min_bytes: u64) -> Self {
        self.reserve_slack = slack;
        self.reserve_slack_min = min_bytes;
        self
    }
    /// Turn the per-operation invariant check on or off.
    ///
    /// ```
    /// use stitch_alloc::{Allocator, Config, Stream};
    /// use stitch_alloc::driver::SimDriver;
    /// let cfg = Config::default().with_paranoid(true);
    /// let a = Allocator::new(SimDriver::with_capacity(1 << 30), cfg).unwrap();
    /// let p = a.alloc(3 << 20, Stream::DEFAULT).unwrap(); // each call re-checks every invariant
    /// a.free(p, Stream::DEFAULT).unwrap();
    /// ```
    pub fn with_paranoid(mut self, on: bool) -> Self {
        self.paranoid = on;
        self
    }

    /// Turn the loop region ([`Config::loop_region`]) on or off.
    ///
    /// ```
    /// use stitch_alloc::Config;
    /// assert!(Config::default().loop_region);
    /// assert!(!Config::default().with_loop_region(false).loop_region);
    /// ```
    pub fn with_loop_region(mut self, on: bool) -> Self {
        self.loop_region = on;
        self
    }

    /// Turn next-fit placement of growing chains ([`Config::chain_fit`]) on or off.
    ///
    /// ```
    /// use stitch_alloc::Config;
    /// assert!(Config::default().chain_fit);
    /// assert!(!Config::default().with_chain_fit(false).chain_fit);
    /// ```
    pub fn with_chain_fit(mut self, on: bool) -> Self {
        self.chain_fit = on;
        self
    }

    /// Turn sparing pieces of live handles when stitching ([`Config::spare_pieces`]) on or
    /// off.
    ///
    /// ```
    /// use stitch_alloc::Config;
    /// assert!(!Config::default().spare_pieces);
    /// assert!(Config::default().with_spare_pieces(true).spare_pieces);
    /// ```
    pub fn with_spare_pieces(mut self, on: bool) -> Self {
        self.spare_pieces = on;
        self
    }

    /// Check every value that does not depend on the device: byte counts at most
    /// [`MAX_BYTES`], sizes that must be positive, a fraction in (0, 1], a growth slack that
    /// is a finite number in [0, [`MAX_RESERVE_SLACK`]], `min_handle <= max_handle`.
    /// `Allocator::new` calls it, then checks the rest against the device's granularity.
    ///
    /// ```
    /// use stitch_alloc::{AllocError, Config};
    /// assert!(Config::default().validate().is_ok());
    /// let e = Config::default().with_reserve_slack(f64::NAN, 0).validate().unwrap_err();
    /// assert!(matches!(e, AllocError::Config(m) if m.contains("reserve_slack")));
    /// ```
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(AllocError::Config(m));
        match self.capacity {
            Capacity::Bytes(b) if b > MAX_BYTES => {
                return bad(format!("capacity {b} exceeds {MAX_BYTES} bytes (1 PiB)"))
            }
            Capacity::Fraction(f) if !(f > 0.0 && f <= 1.0) => {
                return bad(format!("capacity fraction {f} is not in (0, 1]"))
            }
            _ => {}
        }
        let sizes = [
            ("small_threshold", Some(self.small_threshold)),
            ("small_page", self.small_page),
            ("medium_threshold", self.medium_threshold),
            ("medium_page", Some(self.medium_page)),
            ("min_handle", self.min_handle),
            ("max_handle", Some(self.max_handle)),
            ("split_min", Some(self.split_min)),
            ("handle_divisor", Some(self.handle_divisor)),
            ("prealloc", Some(self.prealloc)),
            ("reserve_slack_min", Some(self.reserve_slack_min)),
            ("va_chunk", self.va_chunk),
            ("va_limit", Some(self.va_limit)),
        ];
        for (name, v) in sizes {
            if let Some(v) = v.filter(|&v| v > MAX_BYTES) {
                return bad(format!("{name} {v} exceeds {MAX_BYTES} bytes (1 PiB)"));
            }
        }
        // Sizes of things that exist: zero is not a size (leave an optional one unset).
        for (name, v) in [
            ("small_page", self.small_page),
            ("min_handle", self.min_handle),
            ("max_handle", Some(self.max_handle)),
            ("split_min", Some(self.split_min)),
            ("handle_divisor", Some(self.handle_divisor)),
            ("va_chunk", self.va_chunk),
        ] {
            if v == Some(0) {
                return bad(format!("{name} must be above zero"));
            }
        }
        if !(self.reserve_slack >= 0.0 && self.reserve_slack <= MAX_RESERVE_SLACK) {
            return bad(format!(
                "reserve_slack {} must be a finite number >= 0 and at most {MAX_RESERVE_SLACK}",
                self.reserve_slack
            ));
        }
        if let Some(min) = self.min_handle.filter(|&m| m > self.max_handle) {
            return bad(format!(
                "min_handle {min} exceeds max_handle {}",
                self.max_handle
            ));
        }
        Ok(())
    }

    /// Check the values ([`Config::validate`]) and resolve the defaults against a driver's
    /// granularity and memory: the engine's settings, derived here only.
    pub(crate) fn resolve(&self, granularity: u64, device: MemInfo) -> Result<Resolved> {
        self.validate()?;
        let g = granularity;
        let bad = |m: String| Err(AllocError::Config(m));
        if g == 0 || g > MAX_BYTES {
            return bad(format!("the driver's granularity {g} is unusable"));
        }
        let capacity = match self.capacity {
            Capacity::Bytes(b) => b,
            // A fraction of the device, but never more than is free when the allocator starts
            // (the CUDA context and other processes hold some).
            Capacity::Fraction(f) => ((device.total as f64 * f) as u64).min(device.free),
        } / g
            * g;
        if capacity == 0 {
            return bad(format!("capacity is below one {g}-byte granule"));
        }
        if capacity > MAX_BYTES {
            return bad(format!(
                "capacity {capacity} exceeds {MAX_BYTES} bytes (1 PiB)"
            ));
        }
        let small_page = self.small_page.unwrap_or(g);
        let min_handle = self.min_handle.unwrap_or(g);
        let max_handle = self.max_handle;
        let split_min = self.split_min.max(g).min(max_handle);
        for (name, v) in [
            ("small_page", small_page),
            ("min_handle", min_handle),
            ("max_handle", max_handle),
            ("split_min", split_min),
        ] {
            if v % g != 0 {
                return bad(format!(
                    "{name} {v} is not a multiple of the granularity {g}"
                ));
            }
        }
        if min_handle > max_handle {
            return bad(format!(
                "min_handle {min_handle} exceeds max_handle {max_handle}"
            ));
        }
        if self.small_threshold > small_page / 2 {
            return bad(format!(
                "small_threshold {} must be at most half a small page ({small_page})",
                self.small_threshold
            ));
        }
        if max_handle < small_page {
            return bad(format!(
                "max_handle {max_handle} is below the small page {small_page}"
            ));
        }
        // The medium page is one handle at most (max_handle is a multiple of g, so rounding
        // the capped value up cannot pass it); its threshold at most half a page.
        let medium_page = self.medium_page.min(max_handle).div_ceil(g).max(1) * g;
        let medium_threshold = self
            .medium_threshold
            .unwrap_or(0)
            .max(self.small_threshold)
            .min(medium_page / 2)
            .max(self.small_threshold);
        let va_chunk = match self.va_chunk {
            None => capacity * 4,
            Some(v) => v.div_ceil(g) * g,
        };
        Ok(Resolved {
            granularity: g,
            capacity,
            small_threshold: self.small_threshold,
            small_page,
            medium_threshold,
            medium_page,
            min_handle,
            max_handle,
            handle_divisor: self.handle_divisor.max(1),
            split_min,
            recreate: self.recreate,
            loop_region: self.loop_region,
            chain_fit: self.chain_fit,
            spare_pieces: self.spare_pieces,
            contiguous: self.contiguous,
            stitching: self.stitching,
            reserve_slack: self.reserve_slack,
            reserve_slack_min: self.reserve_slack_min,
            va_chunk,
            va_limit: self.va_limit,
            prealloc: {
                let p = self.prealloc.div_ceil(g) * g;
                if p > capacity {
                    return bad(format!(
                        "prealloc {} exceeds the capacity {capacity}",
                        self.prealloc
                    ));
                }
                p
            },
            paranoid: self.paranoid,
        })
    }
}

/// The engine's form of a [`Config`]: checked, with every default filled in, every byte
/// count at most [`MAX_BYTES`]. Made by `Config::resolve` only.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct Resolved {
    /// The device's granularity; every size below that must be aligned is a multiple of it.
    pub granularity: u64,
    /// A multiple of the granularity, above zero.
    pub capacity: u64,
    /// At most half of `small_page`.
    pub small_threshold: u64,
    /// A multiple of the granularity, at most `max_handle`.
    pub small_page: u64,
    /// In `[small_threshold, max(small_threshold, medium_page / 2)]`; equal to
    /// `small_threshold` when the medium pool is off.
    pub medium_threshold: u64,
    /// A multiple of the granularity in `[granularity, max_handle]`.
    pub medium_page: u64,
    /// A multiple of the granularity, at most `max_handle`.
    pub min_handle: u64,
    /// A multiple of the granularity.
    pub max_handle: u64,
    /// At least 1.
    pub handle_divisor: u64,
    /// A multiple of the granularity in `[granularity, max_handle]`.
    pub split_min: u64,
    pub recreate: bool,
    pub loop_region: bool,
    pub chain_fit: bool,
    pub spare_pieces: bool,
    pub contiguous: bool,
    pub stitching: bool,
    /// Finite, in `[0, MAX_RESERVE_SLACK]`.
    pub reserve_slack: f64,
    pub reserve_slack_min: u64,
    /// A multiple of the granularity.
    pub va_chunk: u64,
    pub va_limit: u64,
    /// A multiple of the granularity, at most `capacity`.
    pub prealloc: u64,
    pub paranoid: bool,
}

impl Resolved {
    /// Fit the handles to a backend that can hold at most `limit` handles at once
    /// ([`crate::driver::Driver::handle_limit`]): when the whole capacity in handles of
    /// `split_min` would need more than `limit`, `split_min` and `min_handle` rise to the
    /// smallest power-of-two number of granules that fills the capacity within the limit,
    /// never above `max_handle` (an explicit small `max_handle` is kept, and the limit may
    /// then be hit: the backend's error says so). Returns the new `split_min` when it rose.
    pub(crate) fn fit_handle_limit(&mut self, limit: u64) -> Option<u64> {
        let g = self.granularity;
        let granules = self.capacity / g;
        let per = granules.div_ceil(limit.max(1)).max(1);
        let floor = per
            .checked_next_power_of_two()
            .and_then(|p| p.checked_mul(g))
            .unwrap_or(self.max_handle)
            .min(self.max_handle);
        if floor <= self.split_min {
            return None;
        }
        self.split_min = floor;
        self.min_handle = self.min_handle.max(floor);
        Some(floor)
    }
}

// ---------------------------------------------------------------------------------------
// Byte counts.

/// Parse a byte count. The one size parser: `STITCH_ALLOC_CONF`, the `stitch` command's
/// flags and serde's reading of a [`Config`] all use it, so a size means the same everywhere.
///
/// A number, then an optional unit (case-insensitive; spaces allowed around and between):
///
/// * no unit or `B`: bytes;
/// * binary units, powers of 1024: `K`/`KiB`, `M`/`MiB`, `G`/`GiB`, `T`/`TiB`;
/// * SI units, powers of 1000 (their standard meaning): `kB`, `MB`, `GB`, `TB`.
///
/// The number may have `_` separators and a fractional part (`1.5GiB`); the result is rounded
/// down to a whole byte. Negative numbers, other units and results above `u64::MAX` are
/// refused; the message says what was expected.
///
/// ```
/// use stitch_alloc::parse_size;
/// assert_eq!(parse_size("4096"), Ok(4096));
/// assert_eq!(parse_size("128MiB"), Ok(128 << 20));
/// assert_eq!(parse_size("128M"), Ok(128 << 20));
/// assert_eq!(parse_size("1MB"), Ok(1_000_000));
/// assert_eq!(parse_size("1.5 GiB"), Ok(3 << 29));
/// assert!(parse_size("12 parsecs").is_err());
/// ```
pub fn parse_size(s: &str) -> std::result::Result<u64, String> {
    const EXAMPLE: &str = "a byte count such as 4096, 512KiB, 1.5GiB or 129GB";
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '_'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let num = num.replace('_', "");
    let (int, frac) = num.split_once('.').unwrap_or((&num, ""));
    if (int.is_empty() && frac.is_empty()) || frac.contains('.') {
        return Err(format!("expected {EXAMPLE}"));
    }
    let mult: u128 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        u => {
            return Err(format!(
                "expected a unit B, KiB, MiB, GiB, TiB (powers of 1024) or kB, MB, GB, TB \
                 (powers of 1000), not {u:?}"
            ))
        }
    };
    const MAX_FRACTION_DIGITS: usize = 20;
    if frac.len() > MAX_FRACTION_DIGITS {
        return Err(format!(
            "expected {EXAMPLE}, with at most {MAX_FRACTION_DIGITS} digits after the point"
        ));
    }
    let too_large = || "expected a byte count that fits in 64 bits".to_string();
    // Exact integer arithmetic: the integral part (at most 39 digits fit), times the unit,
    // plus the fractional part times the unit, rounded down.
    let whole = if int.is_empty() {
        0
    } else {
        int.parse::<u128>().map_err(|_| too_large())?
    };
    let mut bytes = whole.checked_mul(mult).ok_or_else(too_large)?;
    if !frac.is_empty() {
        let digits: u128 = frac.parse().map_err(|_| format!("expected {EXAMPLE}"))?;
        bytes += digits * mult / 10u128.pow(frac.len() as u32);
    }
    u64::try_from(bytes).map_err(|_| too_large())
}

// ---------------------------------------------------------------------------------------
// serde helpers: every value may also be given as a string (a `key:value` list has nothing
// else), read by the same parser as everywhere else.

/// What a string or number visitor reads: the value as text, and a description of it.
struct TextVisitor(&'static str);

impl<'de> Visitor<'de> for TextVisitor {
    type Value = String;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(self.0)
    }
    fn visit_str<E: de::Error>(self, v: &str) -> std::result::Result<String, E> {
        Ok(v.to_string())
    }
    fn visit_bool<E: de::Error>(self, v: bool) -> std::result::Result<String, E> {
        Ok(v.to_string())
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> std::result::Result<String, E> {
        Ok(v.to_string())
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> std::result::Result<String, E> {
        Ok(v.to_string())
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> std::result::Result<String, E> {
        Ok(v.to_string())
    }
}

/// An optional value: `null` (or a missing field) is `None`, anything else as `T` reads it.
struct OptVisitor<T>(fn(String) -> std::result::Result<T, String>, &'static str);

impl<'de, T> Visitor<'de> for OptVisitor<T> {
    type Value = Option<T>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "{} or null", self.1)
    }
    fn visit_none<E: de::Error>(self) -> std::result::Result<Option<T>, E> {
        Ok(None)
    }
    fn visit_unit<E: de::Error>(self) -> std::result::Result<Option<T>, E> {
        Ok(None)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> std::result::Result<Option<T>, D::Error> {
        let text = d.deserialize_any(TextVisitor(self.1))?;
        (self.0)(text).map(Some).map_err(de::Error::custom)
    }
    fn visit_str<E: de::Error>(self, v: &str) -> std::result::Result<Option<T>, E> {
        (self.0)(v.to_string()).map(Some).map_err(E::custom)
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> std::result::Result<Option<T>, E> {
        (self.0)(v.to_string()).map(Some).map_err(E::custom)
    }
}

fn text<'de, D: Deserializer<'de>>(
    d: D,
    what: &'static str,
) -> std::result::Result<String, D::Error> {
    d.deserialize_any(TextVisitor(what))
}

const SIZE: &str = "a byte count such as 4096 or \"128MiB\"";

fn size_of_text(s: String) -> std::result::Result<u64, String> {
    parse_size(&s)
}

/// A byte count: a number, or a string read by [`parse_size`].
pub(crate) fn de_size<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<u64, D::Error> {
    parse_size(&text(d, SIZE)?).map_err(de::Error::custom)
}

/// An optional byte count (`null` = unset).
pub(crate) fn de_opt_size<'de, D: Deserializer<'de>>(
    d: D,
) -> std::result::Result<Option<u64>, D::Error> {
    d.deserialize_option(OptVisitor(size_of_text, SIZE))
}

/// An optional number (`null` = unset).
pub(crate) fn de_opt_number<'de, D: Deserializer<'de>>(
    d: D,
) -> std::result::Result<Option<f64>, D::Error> {
    d.deserialize_option(OptVisitor(
        |s| {
            s.trim()
                .parse::<f64>()
                .map_err(|_| "expected a number".to_string())
        },
        "a number",
    ))
}

/// An optional value with a [`FromStr`] (`null` = unset).
pub(crate) fn de_opt_parsed<'de, D, T>(d: D) -> std::result::Result<Option<T>, D::Error>
where
    D: Deserializer<'de>,
    T: FromStr,
    T::Err: fmt::Display,
{
    d.deserialize_option(OptVisitor(
        |s: String| s.trim().parse::<T>().map_err(|e| e.to_string()),
        "a value",
    ))
}

/// A number (a string is parsed as one; NaN and infinities are read and left to the checks).
pub(crate) fn de_number<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<f64, D::Error> {
    let t = text(d, "a number")?;
    t.trim()
        .parse::<f64>()
        .map_err(|_| de::Error::custom("expected a number"))
}

/// A flag: a boolean, or `true`/`1`/`yes`/`on`, `false`/`0`/`no`/`off` (case-insensitive).
pub(crate) fn de_flag<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<bool, D::Error> {
    let t = text(d, "true or false")?;
    match t.trim().to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "on" => Ok(true),
        "false" | "0" | "no" | "off" => Ok(false),
        _ => Err(de::Error::custom("expected true or false")),
    }
}

/// Any value with a [`FromStr`] (a number is read as its decimal text).
pub(crate) fn de_parsed<'de, D, T>(d: D) -> std::result::Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: FromStr,
    T::Err: fmt::Display,
{
    text(d, "a value")?
        .trim()
        .parse()
        .map_err(de::Error::custom)
}

// ---------------------------------------------------------------------------------------
// `key:value` lists.

/// Split a `key:value,key:value` list (the format of `STITCH_ALLOC_CONF` and
/// `PYTORCH_CUDA_ALLOC_CONF`) into its pairs: keys lower-cased, both sides trimmed, empty
/// items skipped. An item without `:` or a key given twice is refused.
pub(crate) fn split_pairs(s: &str) -> std::result::Result<Vec<(String, String)>, String> {
    let mut pairs: Vec<(String, String)> = Vec::new();
    for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let Some((k, v)) = item.split_once(':') else {
            return Err(format!("{item:?} is not of the form key:value"));
        };
        let key = k.trim().to_ascii_lowercase();
        if pairs.iter().any(|(seen, _)| *seen == key) {
            return Err(format!("key {:?} is given twice", k.trim()));
        }
        pairs.push((key, v.trim().to_string()));
    }
    Ok(pairs)
}

/// Deserialize a `T` (a struct with defaults) from `key:value` pairs given as strings. A bad
/// value is reported as `bad value "<v>" for <key>: <what was expected>`.
pub(crate) fn from_pairs<T: DeserializeOwned>(
    pairs: &[(String, String)],
) -> std::result::Result<T, String> {
    T::deserialize(Pairs {
        rest: pairs.iter(),
        current: None,
    })
    .map_err(|e| e.to_string())
}

/// The field names of a struct `T` as its `Deserialize` declares them (its keys).
pub(crate) fn field_names<T: DeserializeOwned>() -> &'static [&'static str] {
    let mut fields: &'static [&'static str] = &[];
    let _ = T::deserialize(FieldProbe(&mut fields));
    fields
}

/// A deserializer over `key:value` pairs, each value a string.
struct Pairs<'a> {
    rest: std::slice::Iter<'a, (String, String)>,
    /// The pair whose key was handed out last, until its value is.
    current: Option<&'a (String, String)>,
}

impl<'de> Deserializer<'de> for Pairs<'_> {
    type Error = de::value::Error;
    fn deserialize_any<V: Visitor<'de>>(self, v: V) -> std::result::Result<V::Value, Self::Error> {
        v.visit_map(self)
    }
    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        option unit unit_struct newtype_struct seq tuple tuple_struct map struct enum
        identifier ignored_any
    }
}

impl<'de> MapAccess<'de> for Pairs<'_> {
    type Error = de::value::Error;
    fn next_key_seed<K: de::DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> std::result::Result<Option<K::Value>, Self::Error> {
        let Some(pair) = self.rest.next() else {
            return Ok(None);
        };
        self.current = Some(pair);
        seed.deserialize(pair.0.as_str().into_deserializer())
            .map(Some)
    }
    fn next_value_seed<V: de::DeserializeSeed<'de>>(
        &mut self,
        seed: V,
    ) -> std::result::Result<V::Value, Self::Error> {
        let (k, v) = self.current.take().expect("a value follows its key");
        let d: de::value::StrDeserializer<'_, Self::Error> = v.as_str().into_deserializer();
        seed.deserialize(d)
            .map_err(|e| de::Error::custom(format!("bad value {v:?} for {k}: {e}")))
    }
}

/// A deserializer that only records the field list a struct's `Deserialize` passes it.
struct FieldProbe<'a>(&'a mut &'static [&'static str]);

impl<'de> Deserializer<'de> for FieldProbe<'_> {
    type Error = de::value::Error;
    fn deserialize_any<V: Visitor<'de>>(self, _: V) -> std::result::Result<V::Value, Self::Error> {
        Err(de::Error::custom("not a struct"))
    }
    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        fields: &'static [&'static str],
        _: V,
    ) -> std::result::Result<V::Value, Self::Error> {
        *self.0 = fields;
        Err(de::Error::custom("field names recorded"))
    }
    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        option unit unit_struct newtype_struct seq tuple tuple_struct map enum identifier
        ignored_any
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;
    const G: u64 = 2 * MIB;
    const DEV: MemInfo = MemInfo {
        free: 1 << 30,
        total: 1 << 30,
    };

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("2b"), Ok(2));
        assert_eq!(parse_size("3 KiB"), Ok(3 << 10));
        assert_eq!(parse_size("128MiB"), Ok(128 * MIB));
        assert_eq!(parse_size("4M"), Ok(4 * MIB));
        assert_eq!(parse_size("1g"), Ok(1 << 30));
        assert_eq!(parse_size("2TiB"), Ok(2 << 40));
        assert_eq!(parse_size("8GiB"), Ok(8 << 30));
        assert_eq!(parse_size("1.5 GiB"), Ok(3 << 29));
        assert_eq!(parse_size("0.5k"), Ok(512));
        assert_eq!(parse_size(".5KiB"), Ok(512));
        assert_eq!(parse_size("1_000"), Ok(1000));
        // SI units are powers of 1000.
        assert_eq!(parse_size("1kB"), Ok(1000));
        assert_eq!(parse_size("1MB"), Ok(1_000_000));
        assert_eq!(parse_size("129GB"), Ok(129_000_000_000));
        assert_eq!(parse_size("2tb"), Ok(2_000_000_000_000));
        // Rounded down to a byte, exactly (no floating point).
        assert_eq!(parse_size("1.0000000001KiB"), Ok(1024));
        assert_eq!(parse_size("0.9999999999999999999b"), Ok(0));
        assert_eq!(parse_size("18446744073709551615"), Ok(u64::MAX));
        for (bad, needle) in [
            ("", "byte count"),
            ("MiB", "byte count"),
            ("lots", "byte count"),
            ("-1", "byte count"),
            ("1.2.3", "byte count"),
            ("12 parsecs", "unit"),
            ("12XB", "unit"),
            ("18446744073709551616", "64 bits"),
            ("99999999999999999999", "64 bits"),
            ("99999999999999TiB", "64 bits"),
            ("9999999999999999999999999999999999999999", "64 bits"),
            ("1.000000000000000000001", "digits"),
        ] {
            let e = parse_size(bad).unwrap_err();
            assert!(e.contains(needle), "{bad:?}: {e}");
        }
    }

    #[test]
    fn defaults_resolve_as_documented() {
        let r = Config::default().resolve(G, DEV).unwrap();
        assert_eq!(r.capacity, 1 << 30);
        assert_eq!((r.small_page, r.min_handle, r.max_handle), (G, G, 8 * MIB));
        assert_eq!((r.handle_divisor, r.split_min), (128, G));
        assert_eq!(r.medium_threshold, r.small_threshold, "medium pool off");
        // The medium page (64 MiB asked) is one handle at most: max_handle.
        assert_eq!(r.medium_page, 8 * MIB);
        assert_eq!(r.va_chunk, 4 << 30);
        // A fraction is capped at the free memory.
        let half_free = MemInfo {
            free: 256 * MIB,
            total: 1 << 30,
        };
        let r = Config::default()
            .with_capacity(Capacity::Fraction(0.5))
            .resolve(G, half_free)
            .unwrap();
        assert_eq!(r.capacity, 256 * MIB);
        // Medium: the threshold is capped at half a page, the page at max_handle.
        let r = Config::default()
            .with_medium(64 * MIB, 32 * MIB)
            .resolve(G, DEV)
            .unwrap();
        assert_eq!((r.medium_threshold, r.medium_page), (4 * MIB, 8 * MIB));
        let r = Config::default()
            .with_medium(0, 0)
            .with_handle_sizes(0, 8 * MIB)
            .resolve(G, DEV)
            .unwrap();
        assert_eq!(
            (r.medium_threshold, r.medium_page),
            (r.small_threshold, G),
            "a threshold of 0 is the small threshold: no medium pool"
        );
        let mut c = Config {
            medium_page: u64::MAX,
            ..Config::default()
        };
        assert!(c.resolve(G, DEV).is_err(), "above 1 PiB");
        c.medium_page = MAX_BYTES;
        assert_eq!(c.resolve(G, DEV).unwrap().medium_page, 8 * MIB);
        c.va_chunk = Some(3 * MIB);
        assert_eq!(c.resolve(G, DEV).unwrap().va_chunk, 4 * MIB);
    }

    #[test]
    fn handles_grow_to_fit_a_backend_handle_limit() {
        let dev = MemInfo {
            free: 140 << 30,
            total: 140 << 30,
        };
        let r = Config::default().resolve(G, dev).unwrap();
        // 71,680 granules; 15,000 handles at most: 5 granules each, rounded up to 8 (16 MiB),
        // capped at max_handle (8 MiB).
        let mut a = r.clone();
        assert_eq!(a.fit_handle_limit(15_000), Some(8 * MIB));
        assert_eq!(
            (a.split_min, a.min_handle, a.max_handle),
            (8 * MIB, 8 * MIB, 8 * MIB)
        );
        let mut b = Config::default()
            .with_handle_sizes(0, 64 * MIB)
            .resolve(G, dev)
            .unwrap();
        assert_eq!(b.fit_handle_limit(15_000), Some(16 * MIB));
        // Enough handles for the capacity at the granule: nothing changes.
        let mut c = r.clone();
        assert_eq!(c.fit_handle_limit(80_000), None);
        assert_eq!((c.split_min, c.min_handle), (G, G));
        // A limit of zero or one asks for the largest handles allowed.
        let mut d = r.clone();
        assert_eq!(d.fit_handle_limit(0), Some(8 * MIB));
    }

    #[test]
    fn hostile_values_are_refused() {
        let d = Config::default;
        let mut cases: Vec<(Config, &str)> = vec![
            (d().with_capacity(Capacity::Fraction(1.5)), "(0, 1]"),
            (d().with_capacity(Capacity::Fraction(f64::NAN)), "(0, 1]"),
            (d().with_capacity(Capacity::Fraction(0.0)), "(0, 1]"),
            (d().with_capacity(Capacity::Bytes(u64::MAX)), "1 PiB"),
            (d().with_capacity(Capacity::Bytes(MIB)), "below one"),
            (d().with_reserve_slack(1e300, 0), "reserve_slack"),
            (d().with_reserve_slack(f64::NAN, 0), "reserve_slack"),
            (d().with_reserve_slack(f64::INFINITY, 0), "reserve_slack"),
            (d().with_reserve_slack(-0.5, 0), "reserve_slack"),
            (d().with_reserve_slack(0.0, u64::MAX), "reserve_slack_min"),
            (
                d().with_handle_sizes(3 * MIB, 0),
                "max_handle must be above zero",
            ),
            (
                d().with_handle_sizes(64 * MIB, 8 * MIB),
                "exceeds max_handle",
            ),
            (d().with_handle_sizes(u64::MAX, u64::MAX), "1 PiB"),
            (
                d().with_handle_sizes(0, 3 * MIB),
                "multiple of the granularity",
            ),
            (d().with_small_threshold(64 * MIB), "half a small page"),
            (d().with_medium(u64::MAX, 64 * MIB), "medium_threshold"),
        ];
        let mut c = d().with_handle_sizes(0, 4 * MIB);
        c.small_page = Some(8 * MIB);
        cases.push((c.clone(), "below the small page"));
        c.small_page = Some(0);
        cases.push((c.clone(), "small_page must be above zero"));
        c.small_page = Some(u64::MAX);
        cases.push((c, "small_page"));
        let mut c = d();
        c.va_chunk = Some(u64::MAX - 1);
        cases.push((c.clone(), "va_chunk"));
        c.va_chunk = Some(0);
        cases.push((c, "va_chunk must be above zero"));
        let mut c = d();
        c.va_limit = u64::MAX;
        cases.push((c, "va_limit"));
        for (c, needle) in cases {
            match c.resolve(G, DEV) {
                Err(AllocError::Config(m)) => assert!(m.contains(needle), "{c:?}: {m}"),
                other => panic!("{c:?}: expected a Config error, got {other:?}"),
            }
        }
        // A device no allocator can use.
        let e = d().resolve(0, DEV).unwrap_err();
        assert!(e.to_string().contains("granularity"), "{e}");
    }

    #[test]
    fn serde_round_trip_and_strings() {
        let c = Config::default()
            .with_capacity(Capacity::Bytes(8 << 30))
            .with_handle_sizes(4 * MIB, 64 * MIB)
            .with_medium(8 * MIB, 32 * MIB)
            .with_reserve_slack(0.05, 0)
            .with_paranoid(true);
        let j = serde_json::to_string(&c).unwrap();
        assert!(j.contains(r#""capacity":{"bytes":8589934592}"#), "{j}");
        assert!(j.contains(r#""va_chunk":null"#), "{j}");
        assert_eq!(serde_json::from_str::<Config>(&j).unwrap(), c);
        let s: Config = serde_json::from_str(
            r#"{"capacity": {"bytes": "8GiB"}, "min_handle": "4MiB", "max_handle": 67108864,
                "medium_threshold": "8M", "medium_page": "32MiB", "reserve_slack": "0.05",
                "reserve_slack_min": 0, "paranoid": "on"}"#,
        )
        .unwrap();
        assert_eq!(s, c);
        let f: Config = serde_json::from_str(r#"{"capacity": {"fraction": 0.5}}"#).unwrap();
        assert_eq!(f.capacity, Capacity::Fraction(0.5));
        assert_eq!(
            serde_json::from_str::<Config>("{}").unwrap(),
            Config::default()
        );
        for bad in [
            r#"{"bogus": 1}"#,
            r#"{"max_handle": "12XB"}"#,
            r#"{"max_handle": -1}"#,
            r#"{"stitching": "maybe"}"#,
        ] {
            assert!(serde_json::from_str::<Config>(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn pairs() {
        assert!(split_pairs(" , ").unwrap().is_empty());
        let p = split_pairs("Max_Handle: 64MiB ,stitching:off").unwrap();
        assert_eq!(
            p,
            [
                ("max_handle".to_string(), "64MiB".to_string()),
                ("stitching".to_string(), "off".to_string())
            ]
        );
        let c: Config = from_pairs(&p).unwrap();
        assert_eq!(
            c,
            Config::default()
                .with_handle_sizes(0, 64 * MIB)
                .with_stitching(false)
        );
        assert!(split_pairs("a:1,A:2").unwrap_err().contains("given twice"));
        assert!(split_pairs("max_handle").unwrap_err().contains("key:value"));
        let e = from_pairs::<Config>(&split_pairs("max_handle:12XB").unwrap()).unwrap_err();
        assert!(
            e.starts_with("bad value \"12XB\" for max_handle: expected a unit"),
            "{e}"
        );
        let e = from_pairs::<Config>(&split_pairs("stitching:maybe").unwrap()).unwrap_err();
        assert!(e.contains("true or false"), "{e}");
        let names = field_names::<Config>();
        assert_eq!(names.len(), 21);
        assert!(names.contains(&"contiguous") && names.contains(&"loop_region"));
        let c: Config = from_pairs(&split_pairs("loop_region:off").unwrap()).unwrap();
        assert!(!c.loop_region && Config::default().loop_region);
        let c: Config = from_pairs(&split_pairs("chain_fit:off").unwrap()).unwrap();
        assert!(!c.chain_fit && Config::default().chain_fit);
        let c: Config = from_pairs(&split_pairs("spare_pieces:on").unwrap()).unwrap();
        assert!(c.spare_pieces && !Config::default().spare_pieces);
        assert!(names.contains(&"reserve_slack_min") && names.contains(&"capacity"));
    }
}
