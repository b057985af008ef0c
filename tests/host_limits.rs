//! The host backend names the OS limit it hits. Its own test binary: it lowers this process's
//! open-file limit.

use std::sync::{Mutex, MutexGuard};
use stitch_alloc::driver::{code, Driver, HostDriver};
use stitch_alloc::{AllocError, Allocator, Capacity, Config, Stream};

/// The tests of this binary change the process's open-file limit, which every thread of the
/// process shares: one test at a time, for its whole body. Holding the lock only while the
/// limit is low was not enough: another test's allocator, still alive, created or released
/// memfds meanwhile and took the file the low-limit test had just freed (8 failures in 300
/// runs of this binary, and one CI run).
static LIMIT: Mutex<()> = Mutex::new(());

/// Taken first by every test of this binary, so that it is dropped after everything else the
/// test holds (allocators and drivers included).
fn one_at_a_time() -> MutexGuard<'static, ()> {
    LIMIT.lock().unwrap_or_else(|e| e.into_inner())
}

/// Run `f` with the soft open-file limit at `n`, then restore it. The caller holds
/// [`one_at_a_time`].
fn with_open_file_limit<T>(n: u64, f: impl FnOnce() -> T) -> T {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we pass.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0);
    let low = libc::rlimit {
        rlim_cur: n,
        rlim_max: lim.rlim_max,
    };
    // SAFETY: lowering the soft limit of this test process only.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &low) }, 0);
    let r = f();
    // SAFETY: restoring the limit read above.
    unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) };
    r
}

/// Running out of file descriptors is out of memory to the allocator (each handle is one
/// memfd): it falls back to stitching the free handles it has, as on a full GPU.
#[test]
fn out_of_file_descriptors_falls_back_to_stitching() {
    let _one = one_at_a_time();
    let g = 64 << 10;
    let d = HostDriver::with_config(g, 1 << 30).unwrap();
    let cfg = Config::default()
        .with_capacity(Capacity::Bytes(1 << 30))
        .with_small_threshold(512)
        .with_handle_sizes(g, g)
        .with_paranoid(true);
    let a = Allocator::new(d, cfg).unwrap();
    let (ptrs, err) = with_open_file_limit(64, || {
        let mut ptrs = Vec::new();
        let err = loop {
            match a.alloc(g, Stream::DEFAULT) {
                Ok(p) => ptrs.push(p),
                Err(e) => break e,
            }
            assert!(ptrs.len() < 100, "the limit of 64 files was not hit");
        };
        // Half the handles free, none adjacent: two of them stitched make room for 2g.
        for p in ptrs.iter().step_by(2) {
            a.free(*p, Stream::DEFAULT).unwrap();
        }
        let big = a.alloc(2 * g, Stream::DEFAULT);
        (ptrs, (err, big))
    });
    let (err, big) = err;
    assert!(matches!(err, AllocError::OutOfMemory(_)), "{err}");
    let big = big.expect("stitching free handles needs no new file");
    assert!(a.stats().stitches >= 1);
    a.free(big, Stream::DEFAULT).unwrap();
    for p in ptrs.iter().skip(1).step_by(2) {
        a.free(*p, Stream::DEFAULT).unwrap();
    }
    a.validate().unwrap();
}

#[test]
fn hitting_the_open_file_limit_is_a_clear_error() {
    let _one = one_at_a_time();
    with_open_file_limit(64, || {
        let g = 64 << 10;
        let d = HostDriver::with_config(g, 1 << 30).unwrap();
        let mut handles = Vec::new();
        let err = loop {
            match d.create(g) {
                Ok(h) => handles.push(h),
                Err(e) => break e,
            }
            assert!(handles.len() < 100, "the limit of 64 files was not hit");
        };
        // Out of memory to the allocator (no more handles), with the limit named.
        assert_eq!(err.code, code::OUT_OF_MEMORY, "{err}");
        assert!(err.message.contains("ulimit"), "{err}");
        // The driver stays usable: release everything, then creating works again.
        for h in handles {
            d.release(h).unwrap();
        }
        let h = d.create(g).unwrap();
        d.release(h).unwrap();
    });
}

/// The host backend reports three quarters of the open-file limit as its handle limit, and
/// an allocator created under it sizes its handles so that the whole capacity fits: filling
/// it hits no file limit (before, handles of request / 64 ran out of files at 591 MiB of the
/// 1 GiB).
#[test]
fn an_allocator_fills_its_capacity_under_a_low_open_file_limit() {
    let _one = one_at_a_time();
    let g = 64 << 10;
    with_open_file_limit(400, || {
        let d = HostDriver::with_config(g, 1 << 30).unwrap();
        assert_eq!(d.handle_limit(), Some(300));
        let cfg = Config::default()
            .with_capacity(Capacity::Bytes(1 << 30))
            .with_small_threshold(512)
            .with_paranoid(true);
        let a = Allocator::new(d, cfg).unwrap();
        let mut ptrs = Vec::new();
        let mut live = 0u64;
        // 3 MiB requests until the capacity is full (the last one may not fit).
        while live + (3 << 20) <= 1 << 30 {
            match a.alloc(3 << 20, Stream::DEFAULT) {
                Ok(p) => {
                    ptrs.push(p);
                    live += 3 << 20;
                }
                Err(e) => panic!("after {live} bytes of 1 GiB: {e}"),
            }
        }
        assert!(a.stats().reserved.current <= 1 << 30);
        for p in ptrs {
            a.free(p, Stream::DEFAULT).unwrap();
        }
        a.validate().unwrap();
    });
}
