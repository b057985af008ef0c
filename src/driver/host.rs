//! `HostDriver`: real operating-system virtual memory with the GPU's remapping semantics.
//!
//! * a reservation is an `mmap(PROT_NONE, MAP_NORESERVE)` range;
//! * a physical handle is a `memfd` file of the handle's size;
//! * a map is `mmap(MAP_FIXED | MAP_SHARED)` of the whole file at the address, with no access
//!   until `set_access` (`mprotect(PROT_READ | PROT_WRITE)`), as on the GPU; the mapping is
//!   `MADV_DONTFORK`, so a forked child has no such range (a shared mapping would let the
//!   child's writes change the parent's memory; device memory is not inherited either);
//! * an unmap puts a fresh `PROT_NONE` placeholder back (`MAP_FIXED`), so the reservation
//!   stays whole and no other code in the process can take the hole; so does a failed map
//!   (a failed `MAP_FIXED` may already have removed the placeholder).
//!
//! A handle unmapped at one address and mapped at another keeps its bytes, exactly as a
//! `cuMemCreate` handle does: this backend proves data integrity across stitching.
//!
//! Every handle costs one file descriptor and every mapping one kernel VMA; the process
//! limits (`ulimit -n`, `vm.max_map_count`) bound how many exist at once. Hitting one gives
//! a [`DriverError`] that names the limit: out of file descriptors has code
//! [`code::OUT_OF_MEMORY`] (no more handles can be created, as on a full GPU, so the
//! allocator stitches the free handles it has), out of mappings [`code::OS_LIMIT`]. The
//! driver reports three quarters of the open-file limit as its [`Driver::handle_limit`], and
//! an allocator whose capacity would need more handles than that creates larger ones
//! (`Allocator::new`), so that a device-sized host backend (the demo's 139.8 GiB) is not
//! cut short by the file limit.
//!
//! Dropping the driver while it still holds resources gives them back to the OS and logs the
//! leak (it panics only when [`HostDriver::set_panic_on_leak`] asked for it).

use super::ledger::{LeakReport, Ledger};
use super::streams::WorkId;
use super::{
    code, DevAddr, Driver, DriverError, DriverOp, DriverResult, EventId, MemInfo, PhysHandle,
    Stream,
};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};

/// Default capacity of a host device: 16 GiB (memfd pages only cost RAM once touched).
pub const HOST_DEFAULT_CAPACITY: u64 = 16 << 30;

struct HostState {
    ledger: Ledger,
    /// handle id -> its memfd.
    fds: HashMap<u64, OwnedFd>,
    next_id: u64,
}

/// A device made of host memory with real remapping (see the module docs).
///
/// ```
/// use stitch_alloc::driver::{Driver, HostDriver};
/// let host = HostDriver::with_capacity(64 << 20).unwrap();
/// let g = host.granularity();
/// let va = host.reserve(4 * g).unwrap();
/// let h = host.create(g).unwrap();
/// host.map(va, g, h).unwrap();
/// host.set_access(va, g).unwrap();
/// host.write(va + 10, b"kept").unwrap();
/// // Move the handle to another address: the bytes move with it.
/// host.unmap(va, g).unwrap();
/// host.map(va + 2 * g, g, h).unwrap();
/// host.set_access(va + 2 * g, g).unwrap();
/// let mut buf = [0u8; 4];
/// host.read(va + 2 * g + 10, &mut buf).unwrap();
/// assert_eq!(&buf, b"kept");
/// host.unmap(va + 2 * g, g).unwrap();
/// host.release(h).unwrap();
/// host.free_reservation(va, 4 * g).unwrap();
/// ```
pub struct HostDriver {
    state: Mutex<HostState>,
    panic_on_leak: AtomicBool,
    /// Unit tests: make the next `map` fail the way `mmap(MAP_FIXED)` may, after the kernel
    /// already removed the placeholder.
    #[cfg(test)]
    fail_next_map: AtomicBool,
}

impl std::fmt::Debug for HostDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.state.lock();
        f.debug_struct("HostDriver")
            .field("granularity", &s.ledger.granularity)
            .field("capacity", &s.ledger.capacity)
            .field("used", &s.ledger.used)
            .finish()
    }
}

fn os_error(op: DriverOp, what: &str) -> DriverError {
    let e = std::io::Error::last_os_error();
    let errno = e.raw_os_error().unwrap_or(0);
    match errno {
        libc::EMFILE | libc::ENFILE => DriverError::new(
            op,
            code::OUT_OF_MEMORY,
            format!(
                "{what}: open-file limit reached ({e}); the host backend holds one memfd per \
                 physical handle: raise `ulimit -n` or use larger handles"
            ),
        ),
        libc::ENOMEM
            if op == DriverOp::Map || op == DriverOp::Unmap || op == DriverOp::SetAccess =>
        {
            DriverError::new(
                op,
                code::OS_LIMIT,
                format!(
                    "{what}: {e}; the process may have hit vm.max_map_count (one kernel mapping \
                     per handle): raise it with sysctl or use larger handles"
                ),
            )
        }
        _ => DriverError::new(op, errno as i64, format!("{what}: {e}")),
    }
}

/// Map a fresh `PROT_NONE` placeholder over `[addr, addr+size)` (`MAP_FIXED`), so the range
/// stays reserved. Returns what `mmap` returned.
///
/// # Safety
/// The range must lie inside one of this driver's reservations: whatever is mapped there is
/// replaced.
unsafe fn placeholder(addr: DevAddr, size: u64) -> *mut libc::c_void {
    // SAFETY: the caller vouches for the range.
    unsafe {
        libc::mmap(
            addr as *mut libc::c_void,
            size as usize,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED | libc::MAP_NORESERVE,
            -1,
            0,
        )
    }
}

/// This process's open-file limits (`RLIMIT_NOFILE`), `None` if they cannot be read.
fn open_file_limit() -> Option<libc::rlimit> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit only writes into the struct we pass.
    (unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0).then_some(lim)
}

impl HostDriver {
    /// Raise this process's soft open-file limit to its hard limit, so that more handles fit
    /// (one memfd each; see [`Driver::handle_limit`]), and return the soft limit now in force
    /// (`None` if it cannot be read). A program that runs a device-sized host backend calls
    /// it once at start, as the `stitch` command does; the library never calls it itself
    /// (the limits are the embedding process's to set).
    ///
    /// ```
    /// use stitch_alloc::driver::HostDriver;
    /// let soft = HostDriver::raise_open_file_limit().unwrap();
    /// assert!(soft >= 3);
    /// ```
    pub fn raise_open_file_limit() -> Option<u64> {
        let lim = open_file_limit()?;
        if lim.rlim_cur < lim.rlim_max {
            let up = libc::rlimit {
                rlim_cur: lim.rlim_max,
                rlim_max: lim.rlim_max,
            };
            // SAFETY: raising the soft limit to the hard one changes only this process's
            // limit, and only upwards; on failure the old limit stays.
            if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &up) } == 0 {
                return Some(up.rlim_cur);
            }
        }
        Some(lim.rlim_cur)
    }

    /// A host device of 16 GiB with the GPU's 2 MiB granularity.
    pub fn new() -> DriverResult<Self> {
        Self::with_capacity(HOST_DEFAULT_CAPACITY)
    }

    /// A host device of `capacity` bytes with 2 MiB granularity.
    pub fn with_capacity(capacity: u64) -> DriverResult<Self> {
        Self::with_config(super::sim::GPU_GRANULARITY, capacity)
    }

    /// A host device with a chosen granularity (a power of two, a multiple of the OS page).
    pub fn with_config(granularity: u64, capacity: u64) -> DriverResult<Self> {
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64;
        if !granularity.is_power_of_two() || granularity % page != 0 {
            return Err(DriverError::new(
                DriverOp::Create,
                code::INVALID_VALUE,
                format!("granularity {granularity} must be a power of two and a multiple of the {page}-byte page"),
            ));
        }
        Ok(HostDriver {
            state: Mutex::new(HostState {
                ledger: Ledger::new(granularity, capacity),
                fds: HashMap::new(),
                next_id: 0,
            }),
            panic_on_leak: AtomicBool::new(false),
            #[cfg(test)]
            fail_next_map: AtomicBool::new(false),
        })
    }

    /// What the device still holds.
    pub fn leak_report(&self) -> LeakReport {
        self.state.lock().ledger.leak_report()
    }

    /// Whether dropping a driver that still holds something panics (default: false; the
    /// leak is logged with `tracing::error!` either way).
    pub fn set_panic_on_leak(&self, on: bool) {
        self.panic_on_leak.store(on, Ordering::Relaxed);
    }

    /// Simulate a kernel on `stream` touching `[addr, addr+len)` (see `SimDriver::launch`).
    pub fn launch(&self, stream: Stream, addr: DevAddr, len: u64) -> WorkId {
        self.state.lock().ledger.streams.launch(stream, addr, len)
    }

    /// Complete simulated work on `stream` up to `upto` (all when `None`).
    pub fn complete(&self, stream: Stream, upto: Option<WorkId>) {
        self.state.lock().ledger.streams.complete(stream, upto)
    }

    /// Whether simulated work `w` has completed.
    pub fn work_done(&self, w: WorkId) -> bool {
        self.state.lock().ledger.streams.is_done(w)
    }

    /// Complete all simulated work.
    pub fn complete_all(&self) {
        self.state.lock().ledger.streams.complete_all()
    }

    /// Whether `[addr, addr+len)` is fully mapped with access set.
    pub fn is_accessible(&self, addr: DevAddr, len: u64) -> bool {
        self.state.lock().ledger.check_data(addr, len).is_ok()
    }

    /// Calls made so far, by kind.
    pub fn calls(&self) -> super::CallCounts {
        self.state.lock().ledger.calls
    }

    #[cfg(feature = "testing")]
    /// Every live handle as `(size, addresses it is mapped at)` (read-only, for the test
    /// harness's oracle).
    pub(crate) fn handle_mappings(&self) -> Vec<(u64, Vec<DevAddr>)> {
        self.state.lock().ledger.handle_mappings()
    }
}

impl super::SimulatedWork for HostDriver {
    fn launch(&self, stream: Stream, addr: DevAddr, len: u64) -> WorkId {
        HostDriver::launch(self, stream, addr, len)
    }
    fn complete(&self, stream: Stream, upto: Option<WorkId>) {
        HostDriver::complete(self, stream, upto)
    }
    fn work_done(&self, w: WorkId) -> bool {
        HostDriver::work_done(self, w)
    }
}

impl Driver for HostDriver {
    fn name(&self) -> &'static str {
        "host"
    }
    fn granularity(&self) -> u64 {
        self.state.lock().ledger.granularity
    }
    fn mem_info(&self) -> DriverResult<MemInfo> {
        let mut s = self.state.lock();
        s.ledger.calls.add(DriverOp::MemInfo);
        Ok(MemInfo {
            free: s.ledger.capacity - s.ledger.used,
            total: s.ledger.capacity,
        })
    }

    fn reserve(&self, size: u64) -> DriverResult<DevAddr> {
        let mut s = self.state.lock();
        let l = &mut s.ledger;
        l.calls.add(DriverOp::Reserve);
        let g = l.granularity;
        if size == 0 || size % g != 0 {
            return Err(DriverError::new(
                DriverOp::Reserve,
                code::INVALID_VALUE,
                format!("size {size} is not a non-zero multiple of {g}"),
            ));
        }
        let total = size.checked_add(g).ok_or_else(|| {
            DriverError::new(DriverOp::Reserve, code::INVALID_VALUE, "size overflows")
        })?;
        // SAFETY: an anonymous PROT_NONE mapping at an address the kernel picks touches no
        // existing memory.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                total as usize,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(os_error(DriverOp::Reserve, "mmap(PROT_NONE) reservation"));
        }
        let raw = p as u64;
        let base = raw.div_ceil(g) * g;
        // Trim the unaligned head and the tail so exactly [base, base+size) stays reserved.
        // SAFETY: both pieces lie inside the mapping just made and belong to no one else.
        unsafe {
            if base > raw {
                libc::munmap(p, (base - raw) as usize);
            }
            let tail = raw + total - (base + size);
            if tail > 0 {
                libc::munmap((base + size) as *mut libc::c_void, tail as usize);
            }
        }
        l.check_reserve_at(base, size)?;
        l.commit_reserve(base, size);
        Ok(base)
    }

    fn free_reservation(&self, base: DevAddr, size: u64) -> DriverResult<()> {
        let mut s = self.state.lock();
        s.ledger.calls.add(DriverOp::FreeReservation);
        s.ledger.check_free_reservation(base, size)?;
        // SAFETY: the ledger confirmed [base, base+size) is exactly one of our reservations and
        // holds no mapping, so only our PROT_NONE placeholder is removed.
        let r = unsafe { libc::munmap(base as *mut libc::c_void, size as usize) };
        if r != 0 {
            return Err(os_error(DriverOp::FreeReservation, "munmap"));
        }
        s.ledger.commit_free_reservation(base);
        Ok(())
    }

    fn create(&self, size: u64) -> DriverResult<PhysHandle> {
        let mut s = self.state.lock();
        s.ledger.calls.add(DriverOp::Create);
        s.ledger.check_create(size)?;
        // SAFETY: the name is a valid NUL-terminated string.
        let fd = unsafe { libc::memfd_create(c"stitch-alloc-chunk".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(os_error(DriverOp::Create, "memfd_create"));
        }
        // SAFETY: fd was just returned by memfd_create and is owned by nothing else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: fd is a valid memfd.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), size as libc::off_t) } != 0 {
            return Err(os_error(DriverOp::Create, "ftruncate"));
        }
        s.next_id += 1;
        let id = s.next_id;
        s.fds.insert(id, fd);
        Ok(s.ledger.commit_create_as(id, size))
    }

    /// Three quarters of the soft open-file limit (one memfd per handle; the rest of the
    /// process keeps a quarter), `None` when it is unlimited or cannot be read.
    fn handle_limit(&self) -> Option<u64> {
        let lim = open_file_limit()?;
        (lim.rlim_cur != libc::RLIM_INFINITY).then(|| lim.rlim_cur / 4 * 3)
    }

    fn release(&self, handle: PhysHandle) -> DriverResult<()> {
        let mut s = self.state.lock();
        s.ledger.calls.add(DriverOp::Release);
        s.ledger.check_release(handle)?;
        s.fds.remove(&handle.0); // closes the memfd; its pages are freed with it
        s.ledger.commit_release(handle);
        Ok(())
    }

    /// A duplicate of the handle's memfd: another process that maps it sees the same bytes.
    fn export(&self, handle: PhysHandle) -> DriverResult<OwnedFd> {
        let mut s = self.state.lock();
        s.ledger.calls.add(DriverOp::Share);
        let fd = s.fds.get(&handle.0).ok_or_else(|| {
            DriverError::new(
                DriverOp::Share,
                code::INVALID_HANDLE,
                format!("unknown handle {}", handle.0),
            )
        })?;
        fd.try_clone()
            .map_err(|_| os_error(DriverOp::Share, "dup of a handle's memfd"))
    }

    /// Takes a duplicate of `fd`, which must be a memfd (or any file) of exactly `size` bytes.
    fn import(&self, fd: BorrowedFd<'_>, size: u64) -> DriverResult<PhysHandle> {
        let mut s = self.state.lock();
        s.ledger.calls.add(DriverOp::Share);
        if size == 0 || size % s.ledger.granularity != 0 {
            return Err(DriverError::new(
                DriverOp::Share,
                code::INVALID_VALUE,
                format!(
                    "import of {size} bytes: not a positive multiple of the {}-byte granularity",
                    s.ledger.granularity
                ),
            ));
        }
        // SAFETY: an all-zero `stat` is a valid value; fstat fills it or fails.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: `fd` is a valid open descriptor for the duration of the borrow.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(os_error(DriverOp::Share, "fstat of an imported descriptor"));
        }
        if st.st_size as u64 != size {
            return Err(DriverError::new(
                DriverOp::Share,
                code::INVALID_VALUE,
                format!(
                    "imported descriptor holds {} bytes, the sender said {size}",
                    st.st_size
                ),
            ));
        }
        let fd = fd
            .try_clone_to_owned()
            .map_err(|_| os_error(DriverOp::Share, "dup of an imported descriptor"))?;
        s.next_id += 1;
        let id = s.next_id;
        s.fds.insert(id, fd);
        Ok(s.ledger.commit_import_as(id, size))
    }

    fn map(&self, addr: DevAddr, size: u64, handle: PhysHandle) -> DriverResult<()> {
        let mut s = self.state.lock();
        s.ledger.calls.add(DriverOp::Map);
        s.ledger.check_map(addr, size, handle)?;
        let fd = s.fds[&handle.0].as_raw_fd();
        // SAFETY: the ledger confirmed [addr, addr+size) lies inside one of our reservations
        // and overlaps no mapping, so MAP_FIXED replaces only our PROT_NONE placeholder.
        let p = unsafe {
            libc::mmap(
                addr as *mut libc::c_void,
                size as usize,
                libc::PROT_NONE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                fd,
                0,
            )
        };
        #[cfg(test)]
        let p = if self.fail_next_map.swap(false, Ordering::Relaxed) {
            // Emulate mmap(2)'s "if MAP_FIXED fails, the old mapping may be removed".
            // SAFETY: the range is our own mapping, made just above.
            unsafe {
                libc::munmap(addr as *mut libc::c_void, size as usize);
                *libc::__errno_location() = libc::ENOMEM;
            }
            libc::MAP_FAILED
        } else {
            p
        };
        if p == libc::MAP_FAILED {
            let err = os_error(DriverOp::Map, "mmap(MAP_FIXED|MAP_SHARED) of a memfd");
            // A failed MAP_FIXED may have removed the placeholder: put it back.
            // SAFETY: the range is still ours, inside our reservation, with no mapping of ours.
            if unsafe { placeholder(addr, size) } == libc::MAP_FAILED {
                tracing::error!(addr, size, "could not restore a reservation placeholder");
            }
            return Err(err);
        }
        // SAFETY: advice on the mapping just made; it changes only what fork does with it.
        if unsafe { libc::madvise(p, size as usize, libc::MADV_DONTFORK) } != 0 {
            let err = os_error(DriverOp::Map, "madvise(MADV_DONTFORK)");
            // SAFETY: replacing our own mapping, made just above, with the placeholder.
            if unsafe { placeholder(addr, size) } == libc::MAP_FAILED {
                tracing::error!(addr, size, "could not restore a reservation placeholder");
            }
            return Err(err);
        }
        s.ledger.commit_map(addr, size, handle);
        Ok(())
    }

    fn unmap(&self, addr: DevAddr, size: u64) -> DriverResult<()> {
        let mut s = self.state.lock();
        s.ledger.calls.add(DriverOp::Unmap);
        s.ledger.check_unmap(addr, size)?;
        // SAFETY: the ledger confirmed [addr, addr+size) is exactly one of our mappings;
        // replacing it with a PROT_NONE placeholder keeps the reservation whole.
        let p = unsafe { placeholder(addr, size) };
        if p == libc::MAP_FAILED {
            return Err(os_error(DriverOp::Unmap, "mmap(PROT_NONE) placeholder"));
        }
        s.ledger.commit_unmap(addr);
        Ok(())
    }

    fn set_access(&self, addr: DevAddr, size: u64) -> DriverResult<()> {
        let mut s = self.state.lock();
        s.ledger.calls.add(DriverOp::SetAccess);
        s.ledger.check_set_access(addr, size)?;
        // SAFETY: the ledger confirmed the range is covered by our own memfd mappings.
        let r = unsafe {
            libc::mprotect(
                addr as *mut libc::c_void,
                size as usize,
                libc::PROT_READ | libc::PROT_WRITE,
            )
        };
        if r != 0 {
            return Err(os_error(DriverOp::SetAccess, "mprotect"));
        }
        s.ledger.commit_set_access(addr, size);
        Ok(())
    }

    fn record_event(&self, stream: Stream) -> DriverResult<EventId> {
        let mut s = self.state.lock();
        s.ledger.calls.add(DriverOp::RecordEvent);
        Ok(s.ledger.streams.record(stream))
    }
    fn query_event(&self, event: EventId) -> DriverResult<bool> {
        let mut s = self.state.lock();
        s.ledger.calls.add(DriverOp::QueryEvent);
        s.ledger.streams.query(event).ok_or_else(|| {
            DriverError::new(DriverOp::QueryEvent, code::INVALID_HANDLE, "unknown event")
        })
    }
    fn wait_event(&self, event: EventId) -> DriverResult<()> {
        let mut s = self.state.lock();
        s.ledger.calls.add(DriverOp::WaitEvent);
        s.ledger.streams.wait(event).ok_or_else(|| {
            DriverError::new(DriverOp::WaitEvent, code::INVALID_HANDLE, "unknown event")
        })
    }
    fn destroy_event(&self, event: EventId) -> DriverResult<()> {
        let mut s = self.state.lock();
        s.ledger.calls.add(DriverOp::DestroyEvent);
        s.ledger.streams.destroy(event).ok_or_else(|| {
            DriverError::new(
                DriverOp::DestroyEvent,
                code::INVALID_HANDLE,
                "unknown event",
            )
        })
    }

    fn write(&self, addr: DevAddr, data: &[u8]) -> DriverResult<()> {
        let s = self.state.lock();
        s.ledger.check_data(addr, data.len() as u64)?;
        // SAFETY: the ledger confirmed the whole range is mapped read-write by us, and the
        // lock keeps it mapped during the copy.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), addr as *mut u8, data.len()) };
        Ok(())
    }

    fn read(&self, addr: DevAddr, buf: &mut [u8]) -> DriverResult<()> {
        let s = self.state.lock();
        s.ledger.check_data(addr, buf.len() as u64)?;
        // SAFETY: as in `write`.
        unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, buf.as_mut_ptr(), buf.len()) };
        Ok(())
    }

    fn has_data(&self) -> bool {
        true
    }
    fn simulated_work(&self) -> Option<&dyn super::SimulatedWork> {
        Some(self)
    }
}

impl Drop for HostDriver {
    fn drop(&mut self) {
        let s = self.state.get_mut();
        let report = s.ledger.leak_report();
        // Give every OS resource back whatever the caller left behind.
        for (&base, &size) in &s.ledger.reservations {
            // SAFETY: each entry is a reservation this driver made; its mappings lie inside it
            // and go with it.
            unsafe { libc::munmap(base as *mut libc::c_void, size as usize) };
        }
        s.fds.clear();
        if !report.is_clean() {
            tracing::error!(
                ?report,
                "HostDriver dropped while still holding device resources"
            );
            if self.panic_on_leak.load(Ordering::Relaxed) && !std::thread::panicking() {
                panic!("HostDriver leak: {report:?}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn misuse_is_refused_and_data_follows_the_handle() {
        let d = HostDriver::with_capacity(32 << 20).unwrap();
        let g = d.granularity();
        let va = d.reserve(8 * g).unwrap();
        let a = d.create(2 * g).unwrap();
        let b = d.create(g).unwrap();
        d.map(va, 2 * g, a).unwrap();
        assert!(d.write(va, b"x").is_err(), "no access before set_access");
        assert!(d.map(va + g, g, b).is_err(), "overlap");
        d.map(va + 2 * g, g, b).unwrap();
        d.set_access(va, 3 * g).unwrap();
        let pattern: Vec<u8> = (0..3 * g).map(|i| (i * 7 % 251) as u8).collect();
        d.write(va, &pattern).unwrap();
        // Stitch the two handles in the opposite order at a new address.
        d.unmap(va, 2 * g).unwrap();
        d.unmap(va + 2 * g, g).unwrap();
        d.map(va + 4 * g, g, b).unwrap();
        d.map(va + 5 * g, 2 * g, a).unwrap();
        d.set_access(va + 4 * g, 3 * g).unwrap();
        let mut out = vec![0u8; (3 * g) as usize];
        d.read(va + 4 * g, &mut out).unwrap();
        assert_eq!(&out[..g as usize], &pattern[(2 * g) as usize..]);
        assert_eq!(&out[g as usize..], &pattern[..(2 * g) as usize]);
        assert!(
            d.read(va, &mut out[..1]).is_err(),
            "old address is unmapped"
        );
        d.unmap(va + 4 * g, g).unwrap();
        d.unmap(va + 5 * g, 2 * g).unwrap();
        d.release(a).unwrap();
        d.release(b).unwrap();
        d.free_reservation(va, 8 * g).unwrap();
        assert!(d.leak_report().is_clean());
    }

    /// Whether anything is mapped at `addr` (a `MAP_FIXED_NOREPLACE` probe).
    fn is_mapped(addr: u64, len: u64) -> bool {
        // SAFETY: MAP_FIXED_NOREPLACE never replaces an existing mapping; a probe that
        // succeeds is unmapped again at once.
        unsafe {
            let p = libc::mmap(
                addr as *mut libc::c_void,
                len as usize,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE,
                -1,
                0,
            );
            if p == libc::MAP_FAILED {
                return true;
            }
            libc::munmap(p, len as usize);
            false
        }
    }

    #[test]
    fn a_failed_map_leaves_no_hole_in_the_reservation() {
        let d = HostDriver::with_capacity(32 << 20).unwrap();
        let g = d.granularity();
        let va = d.reserve(4 * g).unwrap();
        let h = d.create(g).unwrap();
        d.fail_next_map.store(true, Ordering::Relaxed);
        assert!(d.map(va + g, g, h).is_err());
        assert!(
            is_mapped(va + g, g),
            "the placeholder is back: no other mmap can take the range"
        );
        // The driver is still consistent: the same map works now.
        d.map(va + g, g, h).unwrap();
        d.unmap(va + g, g).unwrap();
        d.release(h).unwrap();
        d.free_reservation(va, 4 * g).unwrap();
        assert!(d.leak_report().is_clean());
    }

    #[test]
    fn a_forked_child_cannot_write_the_parents_memory() {
        let d = HostDriver::with_capacity(32 << 20).unwrap();
        let g = d.granularity();
        let va = d.reserve(g).unwrap();
        let h = d.create(g).unwrap();
        d.map(va, g, h).unwrap();
        d.set_access(va, g).unwrap();
        d.write(va, &[7u8; 64]).unwrap();
        // SAFETY: the child only stores bytes and calls _exit (async-signal-safe).
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            // SAFETY: in the child; a fault here only ends the child.
            unsafe {
                for i in 0..64 {
                    std::ptr::write_volatile((va + i) as *mut u8, 0xEE);
                }
                libc::_exit(0);
            }
        }
        let mut status = 0;
        // SAFETY: waiting for our own child.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        let mut buf = [0u8; 64];
        d.read(va, &mut buf).unwrap();
        assert_eq!(buf, [7u8; 64], "the child's writes reached the parent");
        d.unmap(va, g).unwrap();
        d.release(h).unwrap();
        d.free_reservation(va, g).unwrap();
    }

    #[test]
    fn dropping_with_leaks_reports_instead_of_panicking() {
        let d = HostDriver::with_capacity(32 << 20).unwrap();
        let g = d.granularity();
        let va = d.reserve(2 * g).unwrap();
        let h = d.create(g).unwrap();
        d.map(va, g, h).unwrap();
        assert!(!d.leak_report().is_clean());
        drop(d); // logs the leak and gives the OS resources back
    }

    #[test]
    fn thousands_of_handles() {
        let g = 64 << 10;
        let n = 3000u64;
        let d = HostDriver::with_config(g, n * g).unwrap();
        let va = d.reserve(n * g).unwrap();
        let mut hs = Vec::new();
        for i in 0..n {
            let h = d.create(g).unwrap();
            d.map(va + i * g, g, h).unwrap();
            hs.push(h);
        }
        d.set_access(va, n * g).unwrap();
        d.write(va + (n - 1) * g, &[1, 2, 3]).unwrap();
        for (i, h) in hs.into_iter().enumerate() {
            d.unmap(va + i as u64 * g, g).unwrap();
            d.release(h).unwrap();
        }
        d.free_reservation(va, n * g).unwrap();
    }
}
