//! The host backend names the OS limit it hits. Its own test binary: it lowers this process's
//! open-file limit.

use stitch_alloc::driver::{code, Driver, HostDriver};

#[test]
fn hitting_the_open_file_limit_is_a_clear_error() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we pass.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0);
    let low = libc::rlimit {
        rlim_cur: 64,
        rlim_max: lim.rlim_max,
    };
    // SAFETY: lowering the soft limit of this test process only.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &low) }, 0);
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
    assert_eq!(err.code, code::OS_LIMIT, "{err}");
    assert!(err.message.contains("ulimit"), "{err}");
    // The driver stays usable: release everything, then creating works again.
    for h in handles {
        d.release(h).unwrap();
    }
    let h = d.create(g).unwrap();
    d.release(h).unwrap();
    // SAFETY: restoring the limit read above.
    unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) };
}
