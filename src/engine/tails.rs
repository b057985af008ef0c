//! Small requests in the free ends of large handles (`Config::small_in_tails`).
//!
//! A large allocation is rounded to the granularity only by the handle it ends in: the rest
//! of that handle, up to a granule, is a free block of the large pool that no large request
//! of the handle's size can use and no stitch can move while the allocation lives. The
//! small pool meanwhile makes a new page whenever its own pages have no fitting block. With
//! this mechanism on, a small request that fits none of its pool's blocks takes such a free
//! end first (the smallest that fits): the handle then serves as a small page does.
//!
//! Only handles of one granule qualify, so what a small block can pin after the large
//! allocation beside it is freed is one granule, the size of the small page it saved.
//! Measured on the simulator over the zoo, the holdouts and the serving traces, and through
//! torch: design/zoo.md, "Twenty-second session".
#![forbid(unsafe_code)]

use super::arena::{Arena, Pool};
use super::fences::OwnerId;
use super::handles::Handles;

/// The free block of the large pool, clean or `own`'s, of at least `rsize` bytes, that lies
/// inside one mapped handle of at most `granularity` bytes and is smaller than that handle
/// (so the handle holds other blocks): the smallest such, the lowest id on a tie.
///
/// Examines only the free lists' classes from `rsize` up to a granule: on the allocation's
/// fast path once the small pool has nothing that fits.
pub(crate) fn find(
    arena: &Arena,
    handles: &Handles,
    granularity: u64,
    rsize: u64,
    own: Option<OwnerId>,
) -> Option<u32> {
    if rsize >= granularity {
        return None;
    }
    let mut best: Option<(u64, u32)> = None;
    let mut consider = |i: u32| {
        let b = &arena.blocks[i as usize];
        if b.size < rsize || b.size >= granularity {
            return;
        }
        let Some((start, id)) = handles.containing(b.addr) else {
            return;
        };
        let hsize = handles.size(id);
        if hsize <= granularity
            && b.addr + b.size <= start + hsize
            && best.is_none_or(|(s, _)| b.size < s)
        {
            best = Some((b.size, i));
        }
    };
    let p = Pool::Large as usize;
    let clean = &arena.bins[OwnerId::CLEAN.index()][p];
    clean.for_each_between(&arena.blocks, rsize, granularity - 1, &mut consider);
    if let Some(o) = own {
        arena.bins[o.index()][p].for_each_between(&arena.blocks, rsize, granularity - 1, consider);
    }
    best.map(|(_, i)| i)
}

#[cfg(test)]
mod tests {
    use crate::driver::{SimDriver, Stream};
    use crate::{Allocator, Capacity, Config};

    const MIB: u64 = 1 << 20;

    fn allocator(cfg: Config) -> Allocator<SimDriver> {
        let cfg = cfg.with_paranoid(true).with_capacity(Capacity::Bytes(1 << 30));
        Allocator::new(SimDriver::new(), cfg).unwrap()
    }

    /// A large allocation of 2.5 MiB ends 0.5 MiB into its second 2 MiB handle: with the
    /// mechanism on, small requests take the rest of that handle and no small page is made;
    /// off, the first one makes a page.
    #[test]
    fn small_requests_fill_the_end_of_a_large_handle() {
        for on in [false, true] {
            let a = allocator(Config::default().with_small_in_tails(on));
            let s = Stream::DEFAULT;
            let big = a.alloc(5 * MIB / 2, s).unwrap();
            let smalls: Vec<_> = (0..3).map(|_| a.alloc(128 << 10, s).unwrap()).collect();
            let small_pages = a.detailed_stats().small_pages;
            if on {
                assert_eq!(a.stats().small_in_tails, 3);
                assert_eq!(small_pages, 0, "no small page made");
                for p in &smalls {
                    let d = p.addr() - big.addr();
                    assert!((5 * MIB / 2..4 * MIB).contains(&d), "{d} bytes past the large block");
                }
            } else {
                assert_eq!(a.stats().small_in_tails, 0);
                assert_eq!(small_pages, 1);
            }
            // Everything frees back and the allocator stays consistent.
            for p in smalls {
                a.free(p, s).unwrap();
            }
            a.free(big, s).unwrap();
            a.validate().unwrap();
            assert_eq!(a.stats().requested.current, 0);
        }
    }

    /// The end of a handle larger than a granule does not serve small requests: a small
    /// block there would pin the whole handle once the large allocation beside it is freed.
    #[test]
    fn ends_of_handles_larger_than_a_granule_stay_large() {
        let mut cfg = Config::default().with_small_in_tails(true);
        cfg.handle_divisor = 1;
        let a = allocator(cfg);
        let s = Stream::DEFAULT;
        // One 8 MiB handle: 7.5 MiB live, a free end of 0.5 MiB.
        let big = a.alloc(15 * MIB / 2, s).unwrap();
        let sizes: Vec<u64> = a.snapshot().handles.iter().map(|h| h.size >> 20).collect();
        assert_eq!(sizes, [8], "MiB");
        let small = a.alloc(64 << 10, s).unwrap();
        assert_eq!(a.stats().small_in_tails, 0);
        assert_eq!(a.detailed_stats().small_pages, 1);
        a.free(small, s).unwrap();
        a.free(big, s).unwrap();
        a.validate().unwrap();
    }

    /// Freed, a small block in a handle's end merges back with the large pool's free memory:
    /// the handle is whole again and a stitch can move it.
    #[test]
    fn a_freed_small_block_gives_the_handle_back() {
        let a = allocator(Config::default().with_small_in_tails(true));
        let s = Stream::DEFAULT;
        let big = a.alloc(5 * MIB / 2, s).unwrap();
        let small = a.alloc(4096, s).unwrap();
        assert_eq!(a.stats().small_in_tails, 1);
        a.free(big, s).unwrap();
        assert!(a.snapshot().handles.iter().any(|h| h.holds_live), "the small block pins one");
        a.free(small, s).unwrap();
        assert!(a.snapshot().handles.iter().all(|h| !h.holds_live));
        // Both handles serve one 4 MiB request in place: no new memory.
        let reserved = a.stats().reserved.current;
        let whole = a.alloc(4 * MIB, s).unwrap();
        assert_eq!(a.stats().reserved.current, reserved);
        a.free(whole, s).unwrap();
        a.validate().unwrap();
    }
}
