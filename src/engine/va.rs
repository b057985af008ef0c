//! Virtual address space: the reservations and the unmapped ranges inside them.
#![forbid(unsafe_code)]

use std::collections::{BTreeMap, BTreeSet};

/// Reserved virtual address space, as free (unmapped) ranges.
#[derive(Debug, Default)]
pub(crate) struct VaSpace {
    /// base -> size of each reservation.
    pub(crate) reservations: BTreeMap<u64, u64>,
    /// start -> length of each unmapped range; ranges never overlap, never cross a
    /// reservation boundary, and two ranges touching inside one reservation are merged.
    free: BTreeMap<u64, u64>,
    /// The same ranges ordered by (length, start), for best fit.
    by_size: BTreeSet<(u64, u64)>,
}

impl VaSpace {
    /// Total bytes reserved.
    pub(crate) fn reserved(&self) -> u64 {
        self.reservations.values().sum()
    }

    /// Total bytes not mapped.
    pub(crate) fn free_bytes(&self) -> u64 {
        self.free.values().sum()
    }

    /// Add a new reservation, all of it free.
    pub(crate) fn add_reservation(&mut self, base: u64, size: u64) {
        self.reservations.insert(base, size);
        self.insert(base, size);
    }

    fn insert(&mut self, start: u64, len: u64) {
        self.free.insert(start, len);
        self.by_size.insert((len, start));
    }

    fn remove(&mut self, start: u64) -> u64 {
        let len = self.free.remove(&start).expect("range exists");
        self.by_size.remove(&(len, start));
        len
    }

    fn reservation_of(&self, addr: u64) -> Option<(u64, u64)> {
        self.reservations
            .range(..=addr)
            .next_back()
            .map(|(&b, &s)| (b, s))
            .filter(|&(b, s)| addr < b + s)
    }

    /// Take the smallest free range of at least `len` bytes; returns its start.
    pub(crate) fn alloc(&mut self, len: u64) -> Option<u64> {
        let &(flen, start) = self.by_size.range((len, 0)..).next()?;
        self.remove(start);
        if flen > len {
            self.insert(start + len, flen - len);
        }
        Some(start)
    }

    /// Take `len` bytes from the middle of the largest free range, aligned to `align`, so
    /// that runs placed there can later grow in place at either end. `None` if the largest
    /// range is shorter than `2 * len` (the caller then reserves more space, or falls back to
    /// `alloc`).
    pub(crate) fn alloc_spread(&mut self, len: u64, align: u64) -> Option<u64> {
        let &(flen, fstart) = self.by_size.iter().next_back()?;
        if flen < len.checked_mul(2)? {
            return None;
        }
        let start = (fstart + (flen - len) / 2) / align * align;
        debug_assert!(start >= fstart && start + len <= fstart + flen);
        self.take_exact(start, len).then_some(start)
    }

    /// Whether `[start, start+len)` is entirely free.
    pub(crate) fn is_free(&self, start: u64, len: u64) -> bool {
        self.free
            .range(..=start)
            .next_back()
            .is_some_and(|(&s, &l)| start + len <= s + l)
    }

    /// Take exactly `[start, start+len)` if it is entirely free.
    pub(crate) fn take_exact(&mut self, start: u64, len: u64) -> bool {
        let Some((&s, &l)) = self.free.range(..=start).next_back() else {
            return false;
        };
        if start + len > s + l {
            return false;
        }
        self.remove(s);
        if start > s {
            self.insert(s, start - s);
        }
        if s + l > start + len {
            self.insert(start + len, s + l - (start + len));
        }
        true
    }

    /// Return `[start, start+len)`, which must be mapped space inside one reservation.
    pub(crate) fn free(&mut self, start: u64, len: u64) {
        let (rb, rs) = self.reservation_of(start).expect("range is reserved");
        debug_assert!(start + len <= rb + rs);
        let (mut s, mut l) = (start, len);
        if let Some((&ps, &pl)) = self.free.range(..s).next_back() {
            if ps + pl == s && ps >= rb {
                self.remove(ps);
                s = ps;
                l += pl;
            }
        }
        if let Some(&nl) = self.free.get(&(start + len)) {
            if start + len < rb + rs {
                self.remove(start + len);
                l += nl;
            }
        }
        self.insert(s, l);
    }

    /// Whether `[start, start+len)` overlaps a free range.
    pub(crate) fn overlaps_free(&self, start: u64, len: u64) -> bool {
        self.free
            .range(..start + len)
            .next_back()
            .is_some_and(|(&s, &l)| s + l > start)
    }

    /// Whether `[start, start+len)` lies inside one reservation.
    pub(crate) fn is_reserved(&self, start: u64, len: u64) -> bool {
        self.reservation_of(start)
            .is_some_and(|(b, s)| start + len <= b + s)
    }

    /// Remove everything, returning the reservations to free.
    pub(crate) fn take_reservations(&mut self) -> Vec<(u64, u64)> {
        self.free.clear();
        self.by_size.clear();
        std::mem::take(&mut self.reservations).into_iter().collect()
    }

    /// Check the structure's own invariants.
    pub(crate) fn validate(&self) -> Result<(), String> {
        if self.free.len() != self.by_size.len() {
            return Err("VA indexes disagree".into());
        }
        let mut last_end = 0;
        for (&s, &l) in &self.free {
            if !self.by_size.contains(&(l, s)) || l == 0 {
                return Err(format!("VA range {s:#x}+{l} badly indexed"));
            }
            if s < last_end {
                return Err(format!("VA ranges overlap at {s:#x}"));
            }
            if !self.is_reserved(s, l) {
                return Err(format!("VA range {s:#x}+{l} is not inside one reservation"));
            }
            if s > 0 && s == last_end && self.reservation_of(s) == self.reservation_of(s - 1) {
                return Err(format!("VA ranges touching at {s:#x} are not merged"));
            }
            last_end = s + l;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn best_fit_and_merge_within_reservation_only() {
        let mut v = VaSpace::default();
        v.add_reservation(0, 100);
        v.add_reservation(100, 100);
        let a = v.alloc(60).unwrap();
        let b = v.alloc(40).unwrap();
        assert_eq!((a, b), (0, 60));
        let c = v.alloc(100).unwrap();
        assert_eq!(c, 100);
        v.free(60, 40);
        v.free(100, 100);
        v.validate().unwrap();
        assert!(
            v.alloc(140).is_none(),
            "ranges must not merge across reservations"
        );
        v.free(0, 60);
        v.validate().unwrap();
        assert_eq!(v.free_bytes(), 200);
        assert_eq!(v.alloc(100), Some(0));
        // Spread placement takes the middle of the largest range.
        assert_eq!(v.alloc_spread(20, 10), Some(140));
        assert!(v.is_free(160, 40) && !v.is_free(150, 20));
        assert!(v.take_exact(160, 10));
        assert!(!v.take_exact(165, 10));
        assert!(v.alloc_spread(60, 10).is_none(), "needs twice the length");
        v.validate().unwrap();
    }
}
