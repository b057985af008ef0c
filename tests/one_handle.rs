//! `Allocator::alloc_one_handle` (issue #14: buffers for NCCL registration or RDMA need one
//! physical allocation behind the whole range). The oracle is a driver wrapper that records
//! every map the driver is asked to make, not the allocator's own figures.

use parking_lot::Mutex;
use std::sync::Arc;
use stitch_alloc::driver::{Call, DriverOp, FaultyDriver, Forward, SimDriver};
use stitch_alloc::{AllocError, Allocator, Config, Stream};

const MIB: u64 = 1 << 20;

/// Every successful map, as (address, size) = one handle each.
#[derive(Clone, Default)]
struct Maps(Arc<Mutex<Vec<(u64, u64)>>>);

struct Recording<D> {
    inner: D,
    maps: Maps,
}

impl<D: stitch_alloc::driver::Driver> Forward for Recording<D> {
    type Inner = D;
    fn inner(&self) -> &D {
        &self.inner
    }
    fn after(
        &self,
        call: &Call,
        result: Result<stitch_alloc::driver::Done, &stitch_alloc::driver::DriverError>,
        _ns: u64,
    ) {
        if let (Call::Map { addr, size, .. }, Ok(_)) = (call, result) {
            self.maps.0.lock().push((*addr, *size));
        }
        if let (Call::Unmap { addr, .. }, Ok(_)) = (call, result) {
            self.maps.0.lock().retain(|m| m.0 != *addr);
        }
    }
}

/// The mappings (handles) that overlap `[p, p + n)`.
fn covering(maps: &Maps, p: u64, n: u64) -> Vec<(u64, u64)> {
    let mut v: Vec<(u64, u64)> = maps
        .0
        .lock()
        .iter()
        .copied()
        .filter(|&(a, s)| a < p + n && p < a + s)
        .collect();
    v.sort();
    v
}

fn allocator(capacity: u64) -> (Allocator<Recording<SimDriver>>, Maps) {
    let maps = Maps::default();
    let a = Allocator::new(
        Recording {
            inner: SimDriver::with_capacity(capacity),
            maps: maps.clone(),
        },
        Config::default(),
    )
    .unwrap();
    (a, maps)
}

#[test]
fn each_buffer_lies_in_one_handle_even_after_stitching_and_above_max_handle() {
    let (a, maps) = allocator(4 << 30);
    // Fragment the pool so that ordinary large requests get stitched spans.
    let mut small: Vec<_> = (0..64)
        .map(|_| a.alloc(24 * MIB, Stream::DEFAULT).unwrap())
        .collect();
    for p in small.iter().step_by(2) {
        a.free(*p, Stream::DEFAULT).unwrap();
    }
    small = small.into_iter().skip(1).step_by(2).collect();
    let big = a.alloc(200 * MIB, Stream::DEFAULT).unwrap();
    assert!(
        covering(&maps, big.addr(), 200 * MIB).len() > 1,
        "the ordinary path gives a span of several handles here"
    );
    for size in [MIB + 7, 3 * MIB, 200 * MIB, 300 * MIB + 5] {
        let p = a.alloc_one_handle(size, Stream::DEFAULT).unwrap();
        let c = covering(&maps, p.addr(), size);
        assert_eq!(c.len(), 1, "{size} bytes over {c:?}");
        assert!(c[0].0 <= p.addr() && p.addr() + size <= c[0].0 + c[0].1);
        // Usable and freed like any allocation.
        a.free(p, Stream::DEFAULT).unwrap();
    }
    a.validate().unwrap();
    a.free(big, Stream::DEFAULT).unwrap();
    for p in small {
        a.free(p, Stream::DEFAULT).unwrap();
    }
    a.empty_cache().unwrap();
    assert_eq!(a.stats().reserved.current, 0);
}

#[test]
fn at_the_capacity_free_handles_are_released_to_make_room() {
    let (a, maps) = allocator(256 * MIB);
    let ps: Vec<_> = (0..8)
        .map(|_| a.alloc(30 * MIB, Stream::DEFAULT).unwrap())
        .collect();
    for p in ps {
        a.free(p, Stream::DEFAULT).unwrap();
    }
    let reserved = a.stats().reserved.current;
    assert!(
        reserved + 200 * MIB > 256 * MIB,
        "no headroom left: {reserved}"
    );
    let p = a.alloc_one_handle(200 * MIB, Stream::DEFAULT).unwrap();
    assert_eq!(covering(&maps, p.addr(), 200 * MIB).len(), 1);
    assert!(a.stats().reserved.current <= 256 * MIB);
    a.validate().unwrap();
    // Nothing left to release: a clear out-of-memory error, and the allocator goes on.
    let e = a.alloc_one_handle(200 * MIB, Stream::DEFAULT).unwrap_err();
    assert!(matches!(e, AllocError::OutOfMemory(_)), "{e}");
    a.validate().unwrap();
    a.free(p, Stream::DEFAULT).unwrap();
    assert!(a.alloc(200 * MIB, Stream::DEFAULT).is_ok());
}

#[test]
fn bad_sizes_are_refused() {
    let (a, _) = allocator(256 * MIB);
    assert!(matches!(
        a.alloc_one_handle(0, Stream::DEFAULT),
        Err(AllocError::ZeroSize)
    ));
    assert!(matches!(
        a.alloc_one_handle(1 << 40, Stream::DEFAULT),
        Err(AllocError::TooLarge { .. })
    ));
    a.validate().unwrap();
}

#[test]
fn a_driver_failure_at_each_step_leaks_nothing() {
    for (op, n) in [
        (DriverOp::Create, 1),
        (DriverOp::Map, 1),
        (DriverOp::SetAccess, 1),
    ] {
        let d = FaultyDriver::new(SimDriver::with_capacity(1 << 30));
        d.fail_nth(op, n);
        let a = Allocator::new(d, Config::default()).unwrap();
        assert!(
            a.alloc_one_handle(64 * MIB, Stream::DEFAULT).is_err(),
            "{op:?}"
        );
        a.validate().unwrap();
        let s = a.stats();
        assert_eq!(s.allocated.current, 0, "{op:?}");
        // The next one works, and after it is freed everything can be given back.
        let p = a.alloc_one_handle(64 * MIB, Stream::DEFAULT).unwrap();
        a.free(p, Stream::DEFAULT).unwrap();
        a.empty_cache().unwrap();
        assert_eq!(a.stats().reserved.current, 0, "{op:?}");
        assert_eq!(a.driver().inner().leak_report().handles, 0, "{op:?}");
    }
}
