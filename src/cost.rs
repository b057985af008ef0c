//! The driver cost model: what each CUDA VMM call costs on an H200, in microseconds, by the
//! size of the handle (or mapping) it touches. It is the crate's only price list: the
//! metering driver ([`crate::driver::Metered`] / [`crate::driver::Timed`]), replays
//! ([`crate::replay`]), the C ABI's statistics and the examples all price calls through
//! [`CostModel::price`] (or [`price`], the same with the H200 table).
//!
//! # Sources
//! [`CostModel::h200`] is the table of medians in `../shared/anchors.md` section 1 (one
//! H200, driver 580, CUDA 13.0, measured 2026-11-29): each size-dependent cost is the middle
//! of the measured range at 2 MiB, 64 MiB and 1 GiB, interpolated linearly in log2(size)
//! between them and held flat outside ([`SizedCost::at`]).
//!
//! * `cuMemSetAccess` over a range costs the per-handle price for each mapping the range
//!   covers (the anchors found one SetAccess spanning N mappings costs the same as N calls),
//!   plus a small term fitted to the anchors' measurement that N adjacent handles cost more
//!   per handle as N grows (48 us at N = 1 to 65 us at N = 512 for map, SetAccess and
//!   unmap): `q * N * min(N, 512)`, quadratic up to 512 mappings and linear beyond, since
//!   `scripts/vmm-setaccess.cpp` measured one SetAccess over 64 / 512 / 2,048 / 8,192 mapped
//!   2 MiB handles at 35.0 / 37.4 / 34.7 / 36.4 us per handle (H200, 2026-12-02,
//!   design/gpu-results.md run 59), where a quadratic would give 29-297 us:
//!   [`CostModel::price_set_access`]. Each peer device granted access in the
//!   same call adds the one-device price again (an assumption, not measured:
//!   [`CostModel::price_set_access_devices`]).
//! * Events and `cuMemGetInfo` were not measured in the anchors; their costs here (2 us per
//!   record, 1 us per query or destroy, 5 us per wait not counting the GPU work waited for)
//!   are stated assumptions, as is `cuMemAddressFree` (priced like a reserve). Host/device
//!   copies are not priced at all ([`CostModel::price`] gives `None`).
//!
//! ```
//! use stitch_alloc::cost::{price, CostModel};
//! use stitch_alloc::driver::DriverOp;
//! assert_eq!(price(DriverOp::Map, 2 << 20), Some(1.0));
//! assert!(price(DriverOp::Create, 2 << 20) < price(DriverOp::Create, 1 << 30));
//! assert_eq!(price(DriverOp::Copy, 4096), None);
//! assert_eq!(CostModel::h200().price(DriverOp::Unmap, 64 << 20), Some(25.5));
//! ```
#![forbid(unsafe_code)]

use crate::driver::{CallCounts, DriverOp};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

const MIB: f64 = (1u64 << 20) as f64;

/// A cost that depends on the handle size: microseconds at 2 MiB, 64 MiB and 1 GiB.
#[derive(Copy, Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SizedCost {
    /// Cost for a 2 MiB handle (and anything smaller).
    pub at_2mib: f64,
    /// Cost for a 64 MiB handle.
    pub at_64mib: f64,
    /// Cost for a 1 GiB handle (and anything larger).
    pub at_1gib: f64,
}

impl SizedCost {
    /// The same cost at every size.
    pub const fn flat(us: f64) -> Self {
        SizedCost {
            at_2mib: us,
            at_64mib: us,
            at_1gib: us,
        }
    }

    /// The cost for a handle of `bytes`, interpolated linearly in log(size).
    ///
    /// ```
    /// use stitch_alloc::cost::SizedCost;
    /// let c = SizedCost { at_2mib: 10.0, at_64mib: 20.0, at_1gib: 60.0 };
    /// assert_eq!(c.at(1 << 20), 10.0);
    /// assert_eq!(c.at(64 << 20), 20.0);
    /// assert_eq!(c.at(4 << 30), 60.0);
    /// assert!((c.at(256 << 20) - 40.0).abs() < 1e-9);
    /// ```
    pub fn at(&self, bytes: u64) -> f64 {
        let mib = bytes as f64 / MIB;
        if mib <= 2.0 {
            self.at_2mib
        } else if mib <= 64.0 {
            let t = (mib / 2.0).log2() / 5.0;
            self.at_2mib + t * (self.at_64mib - self.at_2mib)
        } else if mib < 1024.0 {
            let t = (mib / 64.0).log2() / 4.0;
            self.at_64mib + t * (self.at_1gib - self.at_64mib)
        } else {
            self.at_1gib
        }
    }

    /// The cost used when only call counts are known: the mean of the 2 MiB and 64 MiB points.
    pub fn midpoint(&self) -> f64 {
        (self.at_2mib + self.at_64mib) / 2.0
    }
}

/// Per-call driver costs in microseconds (see the module docs for sources). Every field can
/// be overridden; [`CostModel::h200`] (the default) is the measured H200 table. It reads from
/// JSON with missing fields taken from the default (`stitch replay --cost-model FILE`):
///
/// ```
/// use stitch_alloc::cost::CostModel;
/// let c: CostModel = serde_json::from_str(r#"{"set_access_quadratic": 0.0, "map": {"at_2mib": 2, "at_64mib": 2, "at_1gib": 2}}"#).unwrap();
/// assert_eq!(c.set_access_quadratic, 0.0);
/// assert_eq!(c.map.at(1 << 30), 2.0);
/// assert_eq!(c.create, CostModel::h200().create);
/// ```
#[derive(Copy, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct CostModel {
    /// `cuMemAddressReserve` (0.3–3 µs at any size).
    pub reserve: f64,
    /// `cuMemAddressFree` (not measured; assumed like reserve).
    pub free_reservation: f64,
    /// `cuMemCreate` per handle (7–15 / 10–17 / 52–70 µs).
    pub create: SizedCost,
    /// `cuMemRelease` per handle (9–15 / 26–54 / 320–640 µs).
    pub release: SizedCost,
    /// `cuMemMap` per handle (0.8–1.1 µs).
    pub map: SizedCost,
    /// `cuMemUnmap` per mapping (17–19 / 25–26 / 33–34 µs).
    pub unmap: SizedCost,
    /// `cuMemSetAccess`, per handle the range covers (25–28 / 42–45 / 70–78 µs).
    pub set_access: SizedCost,
    /// Extra SetAccess cost of `q * N * min(N, set_access_linear_from)` µs for a range
    /// covering N handles (fitted to the anchors up to N = 512: 0.033).
    pub set_access_quadratic: f64,
    /// Past this many mappings in one SetAccess the extra cost per handle stops growing
    /// (measured flat from 64 to 8,192 mappings: 512, the anchors' largest N).
    pub set_access_linear_from: u64,
    /// What each peer device in a SetAccess adds, as a fraction of the owner's price (a
    /// stated assumption, 1.0: each device's page tables are written; the anchors measured
    /// one device only). A SetAccess for the owner and P peers costs `1 + P *` this.
    pub set_access_per_peer: f64,
    /// `cuEventCreate` + `cuEventRecord` (assumed).
    pub record_event: f64,
    /// `cuEventQuery` (assumed).
    pub query_event: f64,
    /// `cuEventSynchronize`, call overhead only (assumed).
    pub wait_event: f64,
    /// `cuEventDestroy` (assumed).
    pub destroy_event: f64,
    /// `cuMemGetInfo` (assumed).
    pub mem_info: f64,
}

impl Default for CostModel {
    fn default() -> Self {
        Self::h200()
    }
}

/// The H200 table, for [`price`].
const H200: CostModel = CostModel::h200();

/// What one call of `op` on a handle (or mapping) of `size` bytes costs on an H200, in
/// microseconds ([`CostModel::price`] of [`CostModel::h200`]); `None` for host/device copies,
/// which the model does not price.
///
/// ```
/// use stitch_alloc::cost::price;
/// use stitch_alloc::driver::DriverOp;
/// assert_eq!(price(DriverOp::SetAccess, 2 << 20), Some(26.5));
/// ```
pub fn price(op: DriverOp, size: u64) -> Option<f64> {
    H200.price(op, size)
}

impl CostModel {
    /// The H200 medians of `../shared/anchors.md` section 1 (middle of each measured range).
    pub const fn h200() -> Self {
        CostModel {
            reserve: 1.65,
            free_reservation: 1.65,
            create: SizedCost {
                at_2mib: 11.0,
                at_64mib: 13.5,
                at_1gib: 61.0,
            },
            release: SizedCost {
                at_2mib: 12.0,
                at_64mib: 40.0,
                at_1gib: 480.0,
            },
            map: SizedCost::flat(1.0),
            unmap: SizedCost {
                at_2mib: 18.0,
                at_64mib: 25.5,
                at_1gib: 33.5,
            },
            set_access: SizedCost {
                at_2mib: 26.5,
                at_64mib: 43.5,
                at_1gib: 74.0,
            },
            set_access_quadratic: 0.033,
            set_access_linear_from: 512,
            set_access_per_peer: 1.0,
            record_event: 2.0,
            query_event: 1.0,
            wait_event: 5.0,
            destroy_event: 1.0,
            mem_info: 1.0,
        }
    }

    /// What one call of `op` costs, in microseconds, for a handle (or mapping) of `size`
    /// bytes; sizes do not matter for the calls priced flat (reserve, events, `mem_info`).
    /// `set_access` is priced as a range holding one mapping of `size` bytes
    /// ([`CostModel::price_set_access`] prices a range of several). `None` for
    /// [`DriverOp::Copy`] and [`DriverOp::Share`], which the model does not price.
    pub fn price(&self, op: DriverOp, size: u64) -> Option<f64> {
        Some(match op {
            DriverOp::Reserve => self.reserve,
            DriverOp::FreeReservation => self.free_reservation,
            DriverOp::Create => self.create.at(size),
            DriverOp::Release => self.release.at(size),
            DriverOp::Map => self.map.at(size),
            DriverOp::Unmap => self.unmap.at(size),
            DriverOp::SetAccess => self.set_access.at(size),
            DriverOp::RecordEvent => self.record_event,
            DriverOp::QueryEvent => self.query_event,
            DriverOp::WaitEvent => self.wait_event,
            DriverOp::DestroyEvent => self.destroy_event,
            DriverOp::MemInfo => self.mem_info,
            DriverOp::Copy | DriverOp::Share => return None,
        })
    }

    /// One `cuMemSetAccess` over a range covering mappings of the given sizes: the
    /// per-handle price of each plus `set_access_quadratic * N * min(N,
    /// set_access_linear_from)` for N mappings. An empty list (a range the caller could not
    /// resolve into mappings) is priced as one handle of `range_size` bytes.
    ///
    /// ```
    /// use stitch_alloc::cost::CostModel;
    /// let c = CostModel::h200();
    /// let g = 2 << 20;
    /// assert_eq!(c.price_set_access([g], g), 26.5 + 0.033);
    /// assert_eq!(c.price_set_access([], 64 << 20), 43.5);
    /// // Past 512 mappings each handle costs the same: 26.5 + 0.033 * 512 us.
    /// let per = c.price_set_access(vec![g; 8192], 8192 * g) / 8192.0;
    /// assert!((per - (26.5 + 0.033 * 512.0)).abs() < 1e-9);
    /// ```
    pub fn price_set_access(
        &self,
        mapping_sizes: impl IntoIterator<Item = u64>,
        range_size: u64,
    ) -> f64 {
        let mut n = 0u64;
        let mut us = 0.0;
        for len in mapping_sizes {
            n += 1;
            us += self.set_access.at(len);
        }
        if n == 0 {
            return self.set_access.at(range_size);
        }
        us + self.set_access_quadratic * (n * n.min(self.set_access_linear_from)) as f64
    }

    /// [`CostModel::price_set_access`] for a SetAccess that grants `devices` devices (the
    /// owner and its peers) access: each peer adds [`CostModel::set_access_per_peer`] of the
    /// one-device price.
    ///
    /// ```
    /// use stitch_alloc::cost::CostModel;
    /// let c = CostModel::h200();
    /// let g = 2 << 20;
    /// let one = c.price_set_access([g], g);
    /// assert_eq!(c.price_set_access_devices([g], g, 1), one);
    /// assert_eq!(c.price_set_access_devices([g], g, 3), 3.0 * one);
    /// ```
    pub fn price_set_access_devices(
        &self,
        mapping_sizes: impl IntoIterator<Item = u64>,
        range_size: u64,
        devices: u32,
    ) -> f64 {
        let peers = devices.saturating_sub(1) as f64;
        self.price_set_access(mapping_sizes, range_size) * (1.0 + peers * self.set_access_per_peer)
    }

    /// Price call counts alone (no sizes): size-dependent calls at the 2–64 MiB midpoint,
    /// SetAccess once per mapped handle (per map call, since the engine grants access once
    /// per span of handles it has just mapped). Returns (total, per kind).
    ///
    /// ```
    /// use stitch_alloc::cost::CostModel;
    /// use stitch_alloc::driver::{CallCounts, DriverOp};
    /// let mut c = CallCounts::default();
    /// c.add(DriverOp::Map);
    /// let (total, by) = CostModel::h200().cost_of_counts(&c);
    /// assert_eq!(total, 1.0 + (26.5 + 43.5) / 2.0);
    /// assert_eq!(by["set_access"], 35.0);
    /// ```
    pub fn cost_of_counts(&self, c: &CallCounts) -> (f64, BTreeMap<&'static str, f64>) {
        let mut by = BTreeMap::new();
        let mut total = 0.0;
        for op in DriverOp::ALL {
            let us = match op {
                DriverOp::Copy | DriverOp::Share => continue,
                // Access is granted once per handle mapped.
                DriverOp::SetAccess => c.get(DriverOp::Map) as f64 * self.set_access.midpoint(),
                DriverOp::Create => c.get(op) as f64 * self.create.midpoint(),
                DriverOp::Release => c.get(op) as f64 * self.release.midpoint(),
                DriverOp::Map => c.get(op) as f64 * self.map.midpoint(),
                DriverOp::Unmap => c.get(op) as f64 * self.unmap.midpoint(),
                _ => c.get(op) as f64 * self.price(op, 0).unwrap_or(0.0),
            };
            total += us;
            by.insert(op.name(), us);
        }
        (total, by)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn interpolates_and_clamps() {
        let m = |op, s| price(op, s).unwrap();
        assert_eq!(m(DriverOp::Create, 4096), 11.0);
        assert_eq!(m(DriverOp::Create, 2 * MIB), 11.0);
        assert_eq!(m(DriverOp::Create, 64 * MIB), 13.5);
        assert_eq!(m(DriverOp::Create, 1 << 30), 61.0);
        assert_eq!(m(DriverOp::Create, 8 << 30), 61.0);
        let mid = m(DriverOp::Release, 256 * MIB);
        assert!(mid > 40.0 && mid < 480.0, "{mid}");
        assert_eq!(m(DriverOp::Reserve, 1 << 40), 1.65);
        assert_eq!(price(DriverOp::Copy, MIB), None);
        for op in DriverOp::ALL {
            let unpriced = matches!(op, DriverOp::Copy | DriverOp::Share);
            assert_eq!(price(op, MIB).is_some(), !unpriced, "{op}");
        }
    }

    /// Run 59 (scripts/vmm-setaccess.cpp, H200, 2026-12-02): one SetAccess over 8,192 mapped
    /// 2 MiB handles took 36.4 us per handle, as over 64 (35.0). The model may price it a
    /// little higher (the anchors' fit to 512) but not the 297 us a quadratic gives.
    #[test]
    fn set_access_over_many_mappings_costs_no_more_per_handle_than_at_512() {
        let c = CostModel::h200();
        let per = |n: u64| c.price_set_access(vec![2 * MIB; n as usize], n * 2 * MIB) / n as f64;
        assert!(per(512) < per(8192) + 1e-9);
        assert!(
            (per(8192) - per(512)).abs() < 1e-9,
            "{} vs {}",
            per(8192),
            per(512)
        );
        assert!(per(8192) < 2.0 * 36.4, "{}", per(8192));
        assert!(per(64) < per(512), "the fitted growth up to 512 stays");
    }

    #[test]
    fn counts_price_every_priced_kind_in_order() {
        let mut c = CallCounts::default();
        for op in DriverOp::ALL {
            c.add(op);
        }
        let m = CostModel::h200();
        let (total, by) = m.cost_of_counts(&c);
        assert_eq!(
            by.len(),
            DriverOp::ALL.len() - 2,
            "copies and shares are not priced"
        );
        assert_eq!(by["reserve"], 1.65);
        assert_eq!(by["create"], (11.0 + 13.5) / 2.0);
        assert_eq!(by["wait_event"], 5.0);
        assert!((total - by.values().sum::<f64>()).abs() < 1e-9);
    }
}
