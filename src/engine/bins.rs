//! Segregated free lists with two-level bitmaps (TLSF-style) over free blocks.
//!
//! Sizes are counted in 512-byte units. Classes: units below 16 map linearly to class
//! `(0, units)`; larger sizes map to `(log2(units) - 3, next 4 bits)`, 16 classes per power of
//! two, so a class spans at most 1/16 of its lower bound. `find` returns the best block of the
//! request's own class (scanning a few entries) or else the head of the first non-empty
//! larger class, whose every block fits: a good fit in O(1).
#![forbid(unsafe_code)]

use super::arena::{Block, NIL};

const SL: usize = 16;
const FL: usize = 48;
/// Entries of the request's own class examined for a best fit before moving up a class.
const SCAN: usize = 16;

/// One set of free lists.
#[derive(Clone, Debug)]
pub(crate) struct Bins {
    /// Bit `f` is set iff some `sl[f]` bit is set.
    fl: u64,
    /// Bit `s` of `sl[f]` is set iff `heads[f][s] != NIL`.
    sl: [u32; FL],
    /// Head of each class's doubly linked list (through `Block::fprev/fnext`), or `NIL`.
    heads: [[u32; SL]; FL],
    /// Number of blocks in all lists.
    pub(crate) count: usize,
    /// Bytes in all lists.
    pub(crate) bytes: u64,
}

impl Default for Bins {
    fn default() -> Self {
        Bins {
            fl: 0,
            sl: [0; FL],
            heads: [[NIL; SL]; FL],
            count: 0,
            bytes: 0,
        }
    }
}

/// The class of a block of `units` 512-byte units.
#[inline]
fn class(units: u64) -> (usize, usize) {
    debug_assert!(units > 0);
    if units < SL as u64 {
        (0, units as usize)
    } else {
        let l = 63 - units.leading_zeros() as usize;
        (l - 3, ((units >> (l - 4)) & (SL as u64 - 1)) as usize)
    }
}

impl Bins {
    /// Add free block `i` (its size decides the class).
    #[inline]
    pub(crate) fn insert(&mut self, blocks: &mut [Block], i: u32) {
        let (f, s) = class(blocks[i as usize].size >> 9);
        let head = self.heads[f][s];
        {
            let b = &mut blocks[i as usize];
            b.fprev = NIL;
            b.fnext = head;
        }
        if head != NIL {
            blocks[head as usize].fprev = i;
        }
        self.heads[f][s] = i;
        self.sl[f] |= 1 << s;
        self.fl |= 1 << f;
        self.count += 1;
        self.bytes += blocks[i as usize].size;
    }

    /// Remove free block `i`, which must be in these lists.
    #[inline]
    pub(crate) fn remove(&mut self, blocks: &mut [Block], i: u32) {
        let (prev, next, size) = {
            let b = &blocks[i as usize];
            (b.fprev, b.fnext, b.size)
        };
        if prev != NIL {
            blocks[prev as usize].fnext = next;
        } else {
            let (f, s) = class(size >> 9);
            debug_assert_eq!(self.heads[f][s], i);
            self.heads[f][s] = next;
            if next == NIL {
                self.sl[f] &= !(1 << s);
                if self.sl[f] == 0 {
                    self.fl &= !(1 << f);
                }
            }
        }
        if next != NIL {
            blocks[next as usize].fprev = prev;
        }
        self.count -= 1;
        self.bytes -= size;
    }

    /// A free block of at least `size` bytes (a multiple of 512), close to the smallest.
    #[inline]
    pub(crate) fn find(&self, blocks: &[Block], size: u64) -> Option<u32> {
        if self.fl == 0 {
            return None;
        }
        let (f, s) = class(size >> 9);
        // Best fit among the first entries of the request's own class.
        let mut best = NIL;
        let mut best_size = u64::MAX;
        let mut i = self.heads[f][s];
        let mut n = 0;
        while i != NIL && n < SCAN {
            let b = &blocks[i as usize];
            if b.size >= size && b.size < best_size {
                best = i;
                best_size = b.size;
                if b.size == size {
                    break;
                }
            }
            i = b.fnext;
            n += 1;
        }
        if best != NIL {
            return Some(best);
        }
        // Otherwise the first non-empty larger class: all its blocks fit.
        let above = if s + 1 < SL {
            self.sl[f] & (!0u32 << (s + 1))
        } else {
            0
        };
        let (f2, s2) = if above != 0 {
            (f, above.trailing_zeros() as usize)
        } else {
            let fls = if f + 1 < 64 {
                self.fl & (!0u64 << (f + 1))
            } else {
                0
            };
            if fls == 0 {
                return None;
            }
            let f2 = fls.trailing_zeros() as usize;
            (f2, self.sl[f2].trailing_zeros() as usize)
        };
        Some(self.heads[f2][s2])
    }

    /// The largest free block's size (0 if none): scans the top non-empty class.
    pub(crate) fn largest(&self, blocks: &[Block]) -> u64 {
        if self.fl == 0 {
            return 0;
        }
        let f = 63 - self.fl.leading_zeros() as usize;
        let s = 31 - self.sl[f].leading_zeros() as usize;
        let mut i = self.heads[f][s];
        let mut m = 0;
        while i != NIL {
            m = m.max(blocks[i as usize].size);
            i = blocks[i as usize].fnext;
        }
        m
    }

    /// Call `f` with every block of the request's own class and above: every block of at
    /// least `size` bytes, and some smaller ones of its class (the caller checks).
    pub(crate) fn for_each_fitting(&self, blocks: &[Block], size: u64, f: impl FnMut(u32)) {
        self.for_each_from(blocks, class((size >> 9).max(1)), f);
    }

    /// Every block in the lists.
    pub(crate) fn collect(&self, blocks: &[Block], out: &mut Vec<u32>) {
        self.for_each_from(blocks, (0, 0), |i| out.push(i));
    }

    /// Call `f` with every block of class `(f0, s0)` and above, class by class.
    fn for_each_from(&self, blocks: &[Block], (f0, s0): (usize, usize), mut f: impl FnMut(u32)) {
        let mut fl = self.fl & (!0u64 << f0);
        while fl != 0 {
            let fi = fl.trailing_zeros() as usize;
            fl &= fl - 1;
            let mut sl = self.sl[fi];
            if fi == f0 {
                sl &= !0u32 << s0;
            }
            while sl != 0 {
                let si = sl.trailing_zeros() as usize;
                sl &= sl - 1;
                let mut i = self.heads[fi][si];
                while i != NIL {
                    f(i);
                    i = blocks[i as usize].fnext;
                }
            }
        }
    }

    /// Check the bitmaps against the lists and that every listed block has the right class.
    pub(crate) fn validate(&self, blocks: &[Block]) -> Result<(), String> {
        let mut count = 0;
        let mut bytes = 0;
        for f in 0..FL {
            if (self.fl >> f & 1 == 1) != (self.sl[f] != 0) {
                return Err(format!(
                    "first-level bit {f} disagrees with its second level"
                ));
            }
            for s in 0..SL {
                let head = self.heads[f][s];
                if (self.sl[f] >> s & 1 == 1) != (head != NIL) {
                    return Err(format!("bit ({f},{s}) disagrees with its list"));
                }
                let mut prev = NIL;
                let mut i = head;
                while i != NIL {
                    let b = &blocks[i as usize];
                    if b.fprev != prev {
                        return Err(format!("block {i}: broken free-list back link"));
                    }
                    if class(b.size >> 9) != (f, s) {
                        return Err(format!(
                            "block {i} of {} bytes is in class ({f},{s})",
                            b.size
                        ));
                    }
                    count += 1;
                    bytes += b.size;
                    prev = i;
                    i = b.fnext;
                }
            }
        }
        if count != self.count || bytes != self.bytes {
            return Err(format!(
                "bins count {}/{} bytes {}/{} disagree with their lists",
                self.count, count, self.bytes, bytes
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_are_monotone_and_bounded() {
        let mut last = (0, 0);
        for u in 1..100_000u64 {
            let c = class(u);
            assert!(c >= last, "class must not decrease at {u}");
            last = c;
        }
        assert!(class(1 << 44).0 < FL);
    }

    /// Blocks of the given sizes in 512-byte units, all listed in one `Bins`.
    fn listed(units: &[u64]) -> (Vec<Block>, Bins) {
        let mut blocks: Vec<Block> = units
            .iter()
            .enumerate()
            .map(|(i, &u)| Block {
                addr: (i as u64) << 40,
                size: u << 9,
                prev: NIL,
                next: NIL,
                fprev: NIL,
                fnext: NIL,
                pool: super::super::Pool::Large,
                state: super::super::arena::State::Vacant,
            })
            .collect();
        let mut b = Bins::default();
        for i in 0..units.len() {
            b.insert(&mut blocks, i as u32);
        }
        (blocks, b)
    }

    #[test]
    fn find_is_a_best_fit_within_the_class_else_the_next_class() {
        // 100 and 101 units share a class (16 per power of two above 16 units).
        assert_eq!(class(100), class(101));
        let (blocks, b) = listed(&[101, 100, 400, 3]);
        b.validate(&blocks).unwrap();
        assert_eq!((b.count, b.bytes), (4, (101 + 100 + 400 + 3) << 9));
        assert_eq!(b.find(&blocks, 100 << 9), Some(1), "exact fit in the class");
        assert_eq!(b.find(&blocks, 101 << 9), Some(0));
        assert_eq!(b.find(&blocks, 102 << 9), Some(2), "next non-empty class");
        assert_eq!(b.find(&blocks, 2 << 9), Some(3));
        assert_eq!(b.find(&blocks, 401 << 9), None);
        assert_eq!(b.largest(&blocks), 400 << 9);
    }

    #[test]
    fn for_each_fitting_visits_every_block_that_fits() {
        let units = [1, 3, 15, 16, 17, 40, 100, 1000, 5000];
        let (blocks, bins) = listed(&units);
        for want in [1u64, 2, 16, 17, 41, 999, 1000, 5000, 5001] {
            let mut seen = Vec::new();
            bins.for_each_fitting(&blocks, want << 9, |i| {
                seen.push(blocks[i as usize].size >> 9)
            });
            for u in units {
                // Every block that fits is visited; one that does not only from its class.
                assert_eq!(
                    seen.contains(&u),
                    u >= want || class(u) == class(want),
                    "{want} units: {u}"
                );
            }
        }
    }

    #[test]
    fn remove_clears_the_bitmaps_and_collect_lists_the_rest() {
        let (mut blocks, mut b) = listed(&[101, 100, 400]);
        b.remove(&mut blocks, 2);
        b.validate(&blocks).unwrap();
        assert_eq!(b.find(&blocks, 102 << 9), None);
        assert_eq!(b.largest(&blocks), 101 << 9);
        b.remove(&mut blocks, 0);
        b.remove(&mut blocks, 1);
        assert_eq!((b.count, b.bytes, b.fl), (0, 0, 0));
        let (mut blocks, mut b) = listed(&[5, 500, 50]);
        b.remove(&mut blocks, 1);
        let mut all = Vec::new();
        b.collect(&blocks, &mut all);
        all.sort();
        assert_eq!(all, vec![0, 2]);
        b.count += 1;
        assert!(b.validate(&blocks).is_err(), "a wrong count is caught");
    }
}
