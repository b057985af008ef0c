//! Allocator configuration.
#![forbid(unsafe_code)]

use crate::driver::MemInfo;
use crate::error::{AllocError, Result};
use serde::Serialize;

/// How much physical memory the allocator may hold.
#[derive(Copy, Clone, Debug, PartialEq, Serialize)]
pub enum Capacity {
    /// A fixed number of bytes (rounded down to the granularity).
    Bytes(u64),
    /// A fraction of the device's total memory, in (0, 1].
    Fraction(f64),
}

/// Allocator settings. Build with `Config::default()` and the `with_*` methods.
///
/// ```
/// use stitch_alloc::{Capacity, Config};
/// let c = Config::default()
///     .with_capacity(Capacity::Bytes(8 << 30))
///     .with_small_threshold(1 << 20)
///     .with_stitching(false);
/// assert!(!c.stitching);
/// ```
#[derive(Clone, Debug, PartialEq, Serialize)]
#[non_exhaustive]
pub struct Config {
    /// Physical memory limit (default: the whole device; a fraction is capped at the memory
    /// free when the allocator starts).
    pub capacity: Capacity,
    /// Requests up to this many bytes are packed into small pages (default 1 MiB).
    pub small_threshold: u64,
    /// Size of one small page, a multiple of the granularity (default: the granularity).
    pub small_page: u64,
    /// Requests above the small threshold and up to this many bytes are packed into medium
    /// pages, so that they never pin a large handle (default: off, i.e. equal to the small
    /// threshold). Measured trade-off (design/ARCHITECTURE.md 4.5): it lowers stranding when
    /// medium tensors outlive the large ones around them, but a checkerboard of medium
    /// tensors strands half-used pages (92.7% of free memory in one piece instead of 100%).
    pub medium_threshold: u64,
    /// Size of one medium page (default 64 MiB, capped at `max_handle`).
    pub medium_page: u64,
    /// Smallest handle created for a large request (default: the granularity). Larger values
    /// make fewer, larger handles for mid-sized requests.
    pub min_handle: u64,
    /// Largest single handle; a larger need is built from several (default 128 MiB). Smaller
    /// values strand less memory but cost more driver calls per stitch (see
    /// `design/ARCHITECTURE.md`, section 4.4, for the measured trade-off).
    pub max_handle: u64,
    /// Remap free handles into contiguous spans when no free span fits (default on). Off
    /// gives a plain caching allocator on VMM that releases and re-creates instead.
    pub stitching: bool,
    /// Growth slack: while the physical memory held stays within `(1 + reserve_slack)` times
    /// the peak of live bytes, a miss creates new memory (one or a few driver calls) instead
    /// of remapping free handles, and a large request avoids pinning a free block four or
    /// more times its size. Past that budget, free handles are reused (stitched) first.
    /// 0 = always reuse first (lowest memory, most remapping); large = a plain cache.
    pub reserve_slack: f64,
    /// A floor under the growth slack in bytes (default 64 MiB), so that a small working set
    /// is not remapped on every miss to save a few megabytes.
    pub reserve_slack_min: u64,
    /// Size of each virtual address reservation (0 = four times the capacity).
    pub va_chunk: u64,
    /// Upper bound on all reservations together (default 32 TiB; the process limit is 128).
    pub va_limit: u64,
    /// Check every invariant after each operation (slow; for tests and fuzzing).
    pub paranoid: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            capacity: Capacity::Fraction(1.0),
            small_threshold: 1 << 20,
            small_page: 0,
            medium_threshold: 0,
            medium_page: 64 << 20,
            min_handle: 0,
            max_handle: 128 << 20,
            stitching: true,
            reserve_slack: 0.01,
            reserve_slack_min: 64 << 20,
            va_chunk: 0,
            va_limit: 32 << 40,
            paranoid: false,
        }
    }
}

impl Config {
    /// Set the capacity.
    pub fn with_capacity(mut self, c: Capacity) -> Self {
        self.capacity = c;
        self
    }
    /// Set the small-request threshold.
    pub fn with_small_threshold(mut self, bytes: u64) -> Self {
        self.small_threshold = bytes;
        self
    }
    /// Set the medium threshold and page size (see [`Config::medium_threshold`]).
    pub fn with_medium(mut self, threshold: u64, page: u64) -> Self {
        self.medium_threshold = threshold;
        self.medium_page = page;
        self
    }
    /// Set the smallest and largest handle sizes (0 = the granularity).
    pub fn with_handle_sizes(mut self, min: u64, max: u64) -> Self {
        self.min_handle = min;
        self.max_handle = max;
        self
    }
    /// Turn stitching on or off.
    pub fn with_stitching(mut self, on: bool) -> Self {
        self.stitching = on;
        self
    }
    /// Set the growth slack and its floor in bytes (see [`Config::reserve_slack`]).
    pub fn with_reserve_slack(mut self, slack: f64, min_bytes: u64) -> Self {
        self.reserve_slack = slack;
        self.reserve_slack_min = min_bytes;
        self
    }
    /// Turn the per-operation invariant check on or off.
    pub fn with_paranoid(mut self, on: bool) -> Self {
        self.paranoid = on;
        self
    }

    /// Resolve defaults against a driver's granularity and total memory, and check the values.
    pub(crate) fn resolve(&self, granularity: u64, device: MemInfo) -> Result<Resolved> {
        let g = granularity;
        let bad = |m: String| Err(AllocError::Config(m));
        let capacity = match self.capacity {
            Capacity::Bytes(b) => b,
            // A fraction of the device, but never more than is free when the allocator starts
            // (the CUDA context and other processes hold some).
            Capacity::Fraction(f) if f > 0.0 && f <= 1.0 => {
                ((device.total as f64 * f) as u64).min(device.free)
            }
            Capacity::Fraction(f) => return bad(format!("capacity fraction {f} is not in (0, 1]")),
        } / g
            * g;
        if capacity == 0 {
            return bad(format!("capacity is below one {g}-byte granule"));
        }
        let pick = |v: u64| if v == 0 { g } else { v };
        let small_page = pick(self.small_page);
        let min_handle = pick(self.min_handle);
        let max_handle = pick(self.max_handle);
        for (name, v) in [
            ("small_page", small_page),
            ("min_handle", min_handle),
            ("max_handle", max_handle),
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
        if !(self.reserve_slack >= 0.0 && self.reserve_slack.is_finite()) {
            return bad(format!(
                "reserve_slack {} must be finite and >= 0",
                self.reserve_slack
            ));
        }
        if max_handle < small_page {
            return bad(format!(
                "max_handle {max_handle} is below the small page {small_page}"
            ));
        }
        // The medium page is one handle at most; its threshold at most half a page.
        let medium_page = self.medium_page.div_ceil(g).max(1) * g;
        let medium_page = medium_page.min(max_handle);
        let medium_threshold = self
            .medium_threshold
            .max(self.small_threshold)
            .min(medium_page / 2)
            .max(self.small_threshold);
        let va_chunk = if self.va_chunk == 0 {
            capacity.saturating_mul(4)
        } else {
            self.va_chunk.div_ceil(g) * g
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
            stitching: self.stitching,
            reserve_slack: self.reserve_slack,
            reserve_slack_min: self.reserve_slack_min,
            va_chunk,
            va_limit: self.va_limit,
            paranoid: self.paranoid,
        })
    }
}

/// A checked configuration with every default filled in.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct Resolved {
    pub granularity: u64,
    pub capacity: u64,
    pub small_threshold: u64,
    pub small_page: u64,
    pub medium_threshold: u64,
    pub medium_page: u64,
    pub min_handle: u64,
    pub max_handle: u64,
    pub stitching: bool,
    pub reserve_slack: f64,
    pub reserve_slack_min: u64,
    pub va_chunk: u64,
    pub va_limit: u64,
    pub paranoid: bool,
}
