//! `CudaDriver`: the real GPU backend, on the CUDA driver API's virtual memory management
//! calls (`cuMemAddressReserve`, `cuMemCreate`, `cuMemMap`, `cuMemSetAccess`, ...).
//!
//! `libcuda` is loaded at run time (cudarc's `dynamic-loading`), so binaries built on a
//! machine without CUDA run unchanged on a GPU machine. Before the first call this module
//! checks that the library loads and exports every symbol it uses, so a missing library or
//! an old driver becomes a [`DriverError`] instead of a panic inside cudarc.
//!
//! This module holds all of the crate's CUDA `unsafe` code. Bench and test helpers (the
//! `cudaMallocAsync` baseline, stream-ordered copies) live in the child module `helpers`,
//! compiled only with the `cuda-test-helpers` feature; the production path requires only
//! the VMM, event and context symbols listed in `SYMBOLS`.

mod event_pool;
#[cfg(feature = "cuda-test-helpers")]
mod helpers;

use event_pool::{EventPool, Retired};

use super::ledger::Ledger;
use super::{
    code, DevAddr, Driver, DriverError, DriverOp, DriverResult, EventId, LeakReport, MemInfo,
    PhysHandle, Stream,
};
use cudarc::driver::sys;
use parking_lot::Mutex;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

/// The libcuda symbols the production allocator calls (device and context set-up, VMM,
/// events, error names): all are probed when the library is loaded, because cudarc's dynamic
/// loader panics on a missing symbol. Symbols of the optional calls are probed on first use
/// instead: [`STREAM_SYMBOLS`], [`COPY_SYMBOLS`] and the test helpers' own group.
const SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetAttribute",
    "cuDeviceGetName",
    "cuDeviceCanAccessPeer",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuGetErrorName",
    "cuGetErrorString",
    "cuMemGetAllocationGranularity",
    "cuMemGetInfo_v2",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemCreate",
    "cuMemRelease",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemSetAccess",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventSynchronize",
    "cuEventDestroy_v2",
    "cuStreamIsCapturing",
];

/// Streams ([`CudaDriver::create_stream`] and the synchronisations).
static STREAM_SYMBOLS: SymbolGroup = SymbolGroup::new(&[
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuCtxSynchronize",
]);

/// The capture mode of the calling thread ([`Driver::exchange_capture_mode`]).
static CAPTURE_SYMBOLS: SymbolGroup = SymbolGroup::new(&["cuThreadExchangeStreamCaptureMode"]);

/// Host copies ([`Driver::write`] and [`Driver::read`], used by tests).
static COPY_SYMBOLS: SymbolGroup =
    SymbolGroup::new(&["cuMemcpyHtoD_v2", "cuMemcpyDtoH_v2", "cuCtxSynchronize"]);

/// Sharing with other processes ([`Driver::export`], [`Driver::import`]).
static SHARE_SYMBOLS: SymbolGroup = SymbolGroup::new(&[
    "cuMemExportToShareableHandle",
    "cuMemImportFromShareableHandle",
]);

/// A group of optional libcuda symbols, probed once, on the first call that needs them.
pub(crate) struct SymbolGroup {
    names: &'static [&'static str],
    /// The probe's outcome: `Ok` once every name is known to exist.
    found: OnceLock<Result<(), DriverError>>,
}

impl SymbolGroup {
    const fn new(names: &'static [&'static str]) -> Self {
        SymbolGroup {
            names,
            found: OnceLock::new(),
        }
    }

    /// `Ok` when libcuda is loaded and exports every symbol of the group; else a
    /// `CUDA_ERROR_NOT_SUPPORTED` error (for `op`) naming the missing ones.
    fn require(&self, op: DriverOp) -> DriverResult<()> {
        lib()?;
        self.found
            .get_or_init(|| {
                let missing = missing_symbols(self.names);
                if missing.is_empty() {
                    Ok(())
                } else {
                    Err(DriverError::new(
                        op,
                        code::NOT_SUPPORTED,
                        format!("libcuda lacks {}", missing.join(", ")),
                    ))
                }
            })
            .clone()
    }
}

/// The names in `names` that the loaded libcuda does not export (`lib()` must have
/// succeeded, so the library is loaded).
fn missing_symbols(names: &[&'static str]) -> Vec<&'static str> {
    // SAFETY: the library is known to load (`is_culib_present` returned true before `lib()`
    // could succeed), so `culib` returns it; it stays loaded for the life of the process.
    let culib = unsafe { sys::culib() };
    names
        .iter()
        .copied()
        // SAFETY: the symbol is only looked up, never called, so its type does not matter.
        .filter(|s| unsafe { culib.get::<*const c_void>(s.as_bytes()) }.is_err())
        .collect()
}

/// `CUDA_ERROR_NO_DEVICE`: used when libcuda cannot be loaded at all.
const NO_DEVICE: i64 = 100;

/// At most this many destroyed events are kept for reuse.
const EVENT_POOL_MAX: usize = 256;

/// What loading and initialising libcuda found (once per process).
#[derive(Clone, Debug)]
struct LibInfo {
    driver_version: i32,
    device_count: i32,
}

static LIB: OnceLock<Result<LibInfo, DriverError>> = OnceLock::new();

/// Set once libcuda is loaded and every symbol in [`SYMBOLS`] is known to exist: only then
/// may [`describe`] ask the driver for error names.
static SYMBOLS_OK: AtomicBool = AtomicBool::new(false);

/// Load libcuda, check its symbols, `cuInit(0)` and count devices, once per process.
/// Never panics: every failure is an error value.
fn lib() -> Result<&'static LibInfo, DriverError> {
    LIB.get_or_init(|| {
        // cudarc's loader panics on failure; the checks below should make that impossible,
        // and `catch_unwind` turns any panic that slips through into an error (with the
        // default `panic = "unwind"`).
        std::panic::catch_unwind(load_and_init).unwrap_or_else(|_| {
            Err(init_error(
                NO_DEVICE,
                "loading libcuda panicked inside cudarc (see the panic message above)",
            ))
        })
    })
    .as_ref()
    .map_err(Clone::clone)
}

fn init_error(code: i64, message: impl Into<String>) -> DriverError {
    // `DriverOp` has no "init" kind; device set-up failures are reported as `MemInfo`, the
    // first query the allocator makes of a driver. The message names the real call.
    DriverError::new(DriverOp::MemInfo, code, message)
}

fn load_and_init() -> Result<LibInfo, DriverError> {
    // SAFETY: `is_culib_present` dlopens candidate libcuda names; loading a library runs its
    // initialisers, which for the NVIDIA driver library have no preconditions. It returns
    // false (no panic) when none loads.
    if !unsafe { sys::is_culib_present() } {
        return Err(init_error(
            NO_DEVICE,
            "libcuda could not be loaded (no libcuda.so / libcuda.so.1 on the loader path): \
             no NVIDIA driver on this machine",
        ));
    }
    let missing = missing_symbols(SYMBOLS);
    if !missing.is_empty() {
        return Err(init_error(
            code::NOT_SUPPORTED,
            format!(
                "libcuda lacks {} (driver too old for this build): {}",
                if missing.len() == 1 {
                    "a symbol"
                } else {
                    "symbols"
                },
                missing.join(", ")
            ),
        ));
    }
    SYMBOLS_OK.store(true, Ordering::Release);
    // SAFETY: every symbol is present; cuInit takes flags 0 and may be called repeatedly.
    check_init("cuInit", unsafe { sys::cuInit(0) })?;
    let mut driver_version: c_int = 0;
    // SAFETY: a valid out-pointer to a c_int.
    check_init("cuDriverGetVersion", unsafe {
        sys::cuDriverGetVersion(&mut driver_version)
    })?;
    let mut device_count: c_int = 0;
    // SAFETY: a valid out-pointer to a c_int; cuInit succeeded.
    check_init("cuDeviceGetCount", unsafe {
        sys::cuDeviceGetCount(&mut device_count)
    })?;
    Ok(LibInfo {
        driver_version,
        device_count,
    })
}

fn check_init(call: &str, r: sys::CUresult) -> Result<(), DriverError> {
    check(DriverOp::MemInfo, call, r)
}

/// The name and description of a `CUresult` (`"CUDA_ERROR_OUT_OF_MEMORY"`, `"out of memory"`).
fn describe(r: sys::CUresult) -> (String, String) {
    if !SYMBOLS_OK.load(Ordering::Acquire) {
        // Calling into cudarc now would panic for want of the library.
        return (format!("{r:?}"), "libcuda not loaded".into());
    }
    let fetch = |f: unsafe fn(sys::CUresult, *mut *const c_char) -> sys::CUresult| {
        let mut p: *const c_char = std::ptr::null();
        // SAFETY: `SYMBOLS_OK` says every symbol exists; `p` is a valid out-pointer.
        // On success the driver points it at a static NUL-terminated string.
        let ok = unsafe { f(r, &mut p) } == sys::CUresult::CUDA_SUCCESS && !p.is_null();
        // SAFETY: `p` is non-null and points at the driver's static C string.
        ok.then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
    };
    let name = fetch(sys::cuGetErrorName).unwrap_or_else(|| format!("{r:?}"));
    let text = fetch(sys::cuGetErrorString).unwrap_or_else(|| "no description".into());
    (name, text)
}

/// Turn a `CUresult` into `Ok` or a [`DriverError`] naming `call`.
fn check(op: DriverOp, call: &str, r: sys::CUresult) -> DriverResult<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let (name, text) = describe(r);
    let code = if r == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        code::OUT_OF_MEMORY
    } else {
        r as u32 as i64
    };
    Err(DriverError::new(
        op,
        code,
        format!("{call}: {name} ({text})"),
    ))
}

/// The real GPU backend: one device, its primary context, and CUDA VMM calls.
///
/// Physical memory is pinned device memory of the chosen device (`cuMemCreate` with
/// `CU_MEM_ALLOCATION_TYPE_PINNED`); [`Driver::set_access`] grants read-write access to the
/// device and to any peer devices given to [`CudaDriver::with_peers`]. Streams passed to
/// [`Driver::record_event`] must belong to the device's primary context (as PyTorch's do).
///
/// Every call makes the primary context current on the calling thread first (when it is not
/// already), so the driver can be used from any thread.
///
/// ```
/// use stitch_alloc::driver::{CudaDriver, Driver};
/// if !CudaDriver::available() {
///     return; // no GPU here
/// }
/// let gpu = CudaDriver::new(0).unwrap();
/// let g = gpu.granularity();
/// let va = gpu.reserve(4 * g).unwrap();
/// let h = gpu.create(g).unwrap();
/// gpu.map(va, g, h).unwrap();
/// gpu.set_access(va, g).unwrap();
/// gpu.write(va, b"hello").unwrap();
/// let mut buf = [0u8; 5];
/// gpu.read(va, &mut buf).unwrap();
/// assert_eq!(&buf, b"hello");
/// gpu.unmap(va, g).unwrap();
/// gpu.release(h).unwrap();
/// gpu.free_reservation(va, 4 * g).unwrap();
/// ```
pub struct CudaDriver {
    ordinal: i32,
    device: sys::CUdevice,
    /// The retained primary context (a `CUcontext`, kept as an integer so the driver is
    /// `Send + Sync`; the CUDA driver API is thread-safe).
    ctx: usize,
    granularity: u64,
    /// One read-write access descriptor per device that gets access (the device first).
    access: Vec<sys::CUmemAccessDesc>,
    /// Events handed out, and destroyed ones kept for reuse (raw `CUevent` values).
    events: Mutex<EventPool>,
    /// Reservations, handles and mappings handed out through the [`Driver`] calls and not
    /// yet given back, committed after each successful call (the CPU backends' ledger; its
    /// rule checks are left to the real driver). CUDA cannot enumerate them, so the driver
    /// keeps them: for [`CudaDriver::leak_report`], and to refuse handles it does not hold.
    held: Mutex<Ledger>,
    driver_version: i32,
    device_name: String,
    /// Whether the device supports POSIX file descriptors as shareable handles
    /// (`CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED`): then every
    /// handle is created exportable, so [`Driver::export`] can share it.
    shareable: bool,
}

impl std::fmt::Debug for CudaDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDriver")
            .field("ordinal", &self.ordinal)
            .field("device_name", &self.device_name)
            .field("granularity", &self.granularity)
            .field("peers", &self.peers())
            .field("driver_version", &self.driver_version)
            .finish()
    }
}

/// The guard of [`CudaDriver::bind`]: makes the caller's context current again when dropped.
#[must_use = "the primary context stays current only while the guard lives"]
pub(super) struct Bound {
    /// The context that was current on this thread before `bind` made the primary one current
    /// (a `CUcontext`, 0 for none); `None` when the primary context was current already.
    restore: Option<usize>,
}

impl Drop for Bound {
    fn drop(&mut self) {
        let Some(prev) = self.restore else { return };
        // SAFETY: `prev` was this thread's current context when `bind` ran, a moment ago on
        // the same thread (or none: null unbinds); the caller keeps the context it made
        // current alive while it calls into the driver.
        let r = unsafe { sys::cuCtxSetCurrent(prev as sys::CUcontext) };
        if let Err(e) = check(
            DriverOp::MemInfo,
            "cuCtxSetCurrent (restoring the caller's)",
            r,
        ) {
            tracing::warn!(%e, "restoring the caller's CUDA context failed");
        }
    }
}

impl CudaDriver {
    /// Whether a CUDA device can be used: libcuda loads, exports every call this backend
    /// needs, `cuInit` succeeds and at least one device exists.
    ///
    /// Never panics or aborts, also on machines with no NVIDIA driver at all. The result is
    /// computed once per process.
    ///
    /// ```
    /// use stitch_alloc::driver::CudaDriver;
    /// if CudaDriver::available() {
    ///     println!("{} CUDA device(s)", CudaDriver::device_count());
    /// }
    /// ```
    pub fn available() -> bool {
        lib().is_ok_and(|l| l.device_count > 0)
    }

    /// Number of CUDA devices (0 when CUDA is unavailable).
    ///
    /// ```
    /// use stitch_alloc::driver::CudaDriver;
    /// assert_eq!(CudaDriver::available(), CudaDriver::device_count() > 0);
    /// ```
    pub fn device_count() -> i32 {
        lib().map_or(0, |l| l.device_count)
    }

    /// Why CUDA is unavailable, or `None` when it is available.
    ///
    /// ```
    /// use stitch_alloc::driver::CudaDriver;
    /// if let Some(why) = CudaDriver::unavailable_reason() {
    ///     eprintln!("no GPU: {why}");
    /// }
    /// ```
    pub fn unavailable_reason() -> Option<String> {
        match lib() {
            Err(e) => Some(e.message.clone()),
            Ok(l) if l.device_count == 0 => Some("cuDeviceGetCount found no CUDA device".into()),
            Ok(_) => None,
        }
    }

    /// Open device `device_ordinal`: initialise the driver, retain the device's primary
    /// context and query the mapping granularity.
    ///
    /// Fails with a [`DriverError`] (never a panic) when libcuda is missing, the ordinal is
    /// out of range, or the device lacks virtual memory management. Set-up failures carry
    /// `op == DriverOp::MemInfo` (there is no separate "init" kind) and name the failing call
    /// in the message.
    ///
    /// ```
    /// use stitch_alloc::driver::CudaDriver;
    /// match CudaDriver::new(0) {
    ///     Ok(gpu) => println!("{gpu:?}"),
    ///     Err(e) => eprintln!("no GPU: {e}"),
    /// }
    /// ```
    pub fn new(device_ordinal: i32) -> DriverResult<Self> {
        Self::with_peers(device_ordinal, &[])
    }

    /// The other devices that can access memory of `device_ordinal`
    /// (`cuDeviceCanAccessPeer`), in ordinal order: the peers [`CudaDriver::with_peers`]
    /// accepts for it.
    pub fn accessible_peers(device_ordinal: i32) -> DriverResult<Vec<i32>> {
        let info = lib()?;
        let device = get_device(device_ordinal)?;
        let mut out = Vec::new();
        for p in (0..info.device_count).filter(|&p| p != device_ordinal) {
            let peer = get_device(p)?;
            let mut can: c_int = 0;
            // SAFETY: valid out-pointer and device handles from cuDeviceGet.
            check_init("cuDeviceCanAccessPeer", unsafe {
                sys::cuDeviceCanAccessPeer(&mut can, peer, device)
            })?;
            if can != 0 {
                out.push(p);
            }
        }
        Ok(out)
    }

    /// Like [`CudaDriver::new`], and every [`Driver::set_access`] also grants read-write
    /// access to the devices in `peers` (one `CUmemAccessDesc` per device). Each peer must be
    /// able to access the device (`cuDeviceCanAccessPeer`).
    ///
    /// ```no_run
    /// use stitch_alloc::driver::CudaDriver;
    /// // Memory on GPU 0 that GPUs 1 and 2 may read and write.
    /// let gpu = CudaDriver::with_peers(0, &[1, 2]).unwrap();
    /// assert_eq!(gpu.peers(), vec![1, 2]);
    /// ```
    pub fn with_peers(device_ordinal: i32, peers: &[i32]) -> DriverResult<Self> {
        let info = lib()?;
        if device_ordinal < 0 || device_ordinal >= info.device_count {
            return Err(init_error(
                code::INVALID_VALUE,
                format!(
                    "cuDeviceGet: device ordinal {device_ordinal} is out of range ({} device(s))",
                    info.device_count
                ),
            ));
        }
        let device = get_device(device_ordinal)?;

        let mut vmm: c_int = 0;
        // SAFETY: `lib()` succeeded, so every symbol exists and cuInit ran; valid out-pointer.
        check_init("cuDeviceGetAttribute", unsafe {
            sys::cuDeviceGetAttribute(
                &mut vmm,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                device,
            )
        })?;
        if vmm == 0 {
            return Err(init_error(
                code::NOT_SUPPORTED,
                format!("device {device_ordinal} does not support virtual memory management"),
            ));
        }

        let mut posix_fd: c_int = 0;
        // SAFETY: as above. A driver that does not know the attribute leaves 0: not shareable.
        let _ = unsafe {
            sys::cuDeviceGetAttribute(
                &mut posix_fd,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                device,
            )
        };

        let mut name_buf = [0 as c_char; 256];
        // SAFETY: the buffer holds `len` bytes; the driver NUL-terminates within them.
        let name_ok =
            unsafe { sys::cuDeviceGetName(name_buf.as_mut_ptr(), name_buf.len() as c_int, device) }
                == sys::CUresult::CUDA_SUCCESS;
        let device_name = if name_ok {
            // SAFETY: on success the buffer holds a NUL-terminated string.
            unsafe { CStr::from_ptr(name_buf.as_ptr()) }
                .to_string_lossy()
                .into_owned()
        } else {
            format!("CUDA device {device_ordinal}")
        };

        let mut access = vec![access_desc(device)];
        for &p in peers {
            if p == device_ordinal {
                continue;
            }
            if p < 0 || p >= info.device_count {
                return Err(init_error(
                    code::INVALID_VALUE,
                    format!(
                        "peer device ordinal {p} is out of range ({} device(s))",
                        info.device_count
                    ),
                ));
            }
            let peer = get_device(p)?;
            let mut can: c_int = 0;
            // SAFETY: valid out-pointer and device handles from cuDeviceGet.
            check_init("cuDeviceCanAccessPeer", unsafe {
                sys::cuDeviceCanAccessPeer(&mut can, peer, device)
            })?;
            if can == 0 {
                return Err(init_error(
                    code::NOT_SUPPORTED,
                    format!(
                        "cuDeviceCanAccessPeer: device {p} cannot access device {device_ordinal}"
                    ),
                ));
            }
            if !access.iter().any(|d| d.location.id == peer) {
                access.push(access_desc(peer));
            }
        }

        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: valid out-pointer and device handle; balanced by the release in `Drop`.
        check_init("cuDevicePrimaryCtxRetain", unsafe {
            sys::cuDevicePrimaryCtxRetain(&mut ctx, device)
        })?;
        // From here on `Drop` releases the context, also on the error paths below.
        let mut drv = CudaDriver {
            ordinal: device_ordinal,
            device,
            ctx: ctx as usize,
            granularity: 0,
            access,
            events: Mutex::new(EventPool::new(EVENT_POOL_MAX)),
            held: Mutex::new(Ledger::new(1, u64::MAX)),
            driver_version: info.driver_version,
            device_name,
            shareable: posix_fd != 0,
        };
        let ctx = drv.bind(DriverOp::MemInfo)?;
        let prop = drv.prop();
        let mut g: usize = 0;
        // SAFETY: `prop` is a fully initialised allocation property; valid out-pointer.
        check_init("cuMemGetAllocationGranularity", unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut g,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        })?;
        if g == 0 || !g.is_power_of_two() {
            return Err(init_error(
                code::NOT_SUPPORTED,
                format!("cuMemGetAllocationGranularity: unexpected granularity {g}"),
            ));
        }
        drv.granularity = g as u64;
        drop(ctx);
        tracing::info!(
            ordinal = device_ordinal,
            device = %drv.device_name,
            granularity = g,
            driver_version = info.driver_version,
            peers = ?drv.peers(),
            "CUDA device opened"
        );
        Ok(drv)
    }

    /// The device ordinal this driver allocates on.
    ///
    /// ```no_run
    /// # use stitch_alloc::driver::CudaDriver;
    /// assert_eq!(CudaDriver::new(0).unwrap().ordinal(), 0);
    /// ```
    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    /// The device's name (`"NVIDIA H200"`).
    ///
    /// ```no_run
    /// # use stitch_alloc::driver::CudaDriver;
    /// println!("{}", CudaDriver::new(0).unwrap().device_name());
    /// ```
    pub fn device_name(&self) -> &str {
        &self.device_name
    }

    /// The CUDA driver's version (`cuDriverGetVersion`, e.g. 13000 for CUDA 13.0).
    ///
    /// ```no_run
    /// # use stitch_alloc::driver::CudaDriver;
    /// assert!(CudaDriver::new(0).unwrap().driver_version() >= 11000);
    /// ```
    pub fn driver_version(&self) -> i32 {
        self.driver_version
    }

    /// The peer devices that [`Driver::set_access`] also grants access to.
    ///
    /// ```no_run
    /// # use stitch_alloc::driver::CudaDriver;
    /// assert!(CudaDriver::new(0).unwrap().peers().is_empty());
    /// ```
    pub fn peers(&self) -> Vec<i32> {
        self.access[1..].iter().map(|d| d.location.id).collect()
    }

    /// The allocation property for `cuMemCreate` and the granularity query: pinned memory on
    /// this device, exportable as a POSIX file descriptor where the device supports it (what
    /// [`Driver::export`] needs; PyTorch's expandable segments request the same type).
    fn prop(&self) -> sys::CUmemAllocationProp {
        let handle_type = if self.shareable {
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        } else {
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE
        };
        sys::CUmemAllocationProp {
            type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
            requestedHandleTypes: handle_type,
            location: sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: self.device,
            },
            win32HandleMetaData: std::ptr::null_mut(),
            allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
                compressionType: 0,
                gpuDirectRDMACapable: 0,
                usage: 0,
                reserved: [0; 4],
            },
        }
    }

    /// Make the primary context current on this thread, unless it already is, until the
    /// returned guard drops: then the caller's context (whatever it was, none included) is
    /// current again. No entry point leaves the calling thread on another context than it
    /// found (a caller on the primary context, as torch's threads are, pays one
    /// `cuCtxGetCurrent`; one on another context two `cuCtxSetCurrent` more).
    fn bind(&self, op: DriverOp) -> DriverResult<Bound> {
        let mut cur: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: valid out-pointer; `lib()` succeeded when `self` was built.
        check(op, "cuCtxGetCurrent", unsafe {
            sys::cuCtxGetCurrent(&mut cur)
        })?;
        if cur as usize == self.ctx {
            return Ok(Bound { restore: None });
        }
        // SAFETY: `self.ctx` is the primary context retained in `with_peers` and held
        // until `Drop`.
        check(op, "cuCtxSetCurrent", unsafe {
            sys::cuCtxSetCurrent(self.ctx as sys::CUcontext)
        })?;
        Ok(Bound {
            restore: Some(cur as usize),
        })
    }

    /// Refuse a handle this driver does not hold (never created here, or released): it is
    /// never passed to libcuda.
    fn check_handle(&self, op: DriverOp, handle: PhysHandle) -> DriverResult<()> {
        if self.held.lock().handles.contains_key(&handle.raw()) {
            return Ok(());
        }
        Err(DriverError::new(
            op,
            code::INVALID_HANDLE,
            format!(
                "handle {:#x} was not created by this driver, or was released",
                handle.raw()
            ),
        ))
    }

    /// Refuse an event this driver did not hand out, or that was destroyed.
    fn check_event(&self, op: DriverOp, event: EventId) -> DriverResult<()> {
        if self.events.lock().is_live(event.raw()) {
            Ok(())
        } else {
            Err(unknown_event(op, event))
        }
    }

    /// A spare event or a new one (not yet handed out).
    fn new_event(&self) -> DriverResult<u64> {
        if let Some(ev) = self.events.lock().take_spare() {
            return Ok(ev);
        }
        let mut ev: sys::CUevent = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the context is current (callers bind first).
        check(DriverOp::RecordEvent, "cuEventCreate", unsafe {
            sys::cuEventCreate(&mut ev, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
        })?;
        Ok(ev as u64)
    }
}

/// A CUDA stream owned by the caller, created with [`CudaDriver::create_stream`] and
/// destroyed when dropped. It keeps the device's primary context retained, so it may outlive
/// the driver that made it.
///
/// ```
/// use stitch_alloc::driver::CudaDriver;
/// if let Ok(gpu) = CudaDriver::new(0) {
///     let s = gpu.create_stream(true).unwrap();
///     gpu.stream_synchronize(s.stream()).unwrap();
/// }
/// ```
pub struct CudaStream {
    raw: u64,
    device: sys::CUdevice,
    ctx: usize,
}

impl std::fmt::Debug for CudaStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaStream({:#x})", self.raw)
    }
}

impl CudaStream {
    /// The stream's raw handle, for [`Driver::record_event`], the allocator and the
    /// `*_async` helpers of [`CudaDriver`].
    ///
    /// The value stays valid while this `CudaStream` lives: drop it only once the allocator
    /// no longer uses the stream (no allocation made or freed on it is still pending).
    pub fn stream(&self) -> Stream {
        Stream(self.raw)
    }
}

impl Drop for CudaStream {
    fn drop(&mut self) {
        let mut prev: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: `ctx` is the primary context this stream retained in `create_stream` and
        // still holds; `raw` is a stream of that context, destroyed exactly once here (work
        // still queued on it completes first: the driver defers the release). The release
        // balances the retain in `create_stream`. The caller's context (`prev`, read first)
        // is made current again afterwards.
        unsafe {
            let got = sys::cuCtxGetCurrent(&mut prev) == sys::CUresult::CUDA_SUCCESS;
            if got
                && sys::cuCtxSetCurrent(self.ctx as sys::CUcontext) == sys::CUresult::CUDA_SUCCESS
            {
                let r = sys::cuStreamDestroy_v2(self.raw as sys::CUstream);
                if let Err(e) = check(DriverOp::MemInfo, "cuStreamDestroy", r) {
                    tracing::warn!(%e, "destroying a stream failed");
                }
                let _ = sys::cuCtxSetCurrent(prev);
            }
            let _ = sys::cuDevicePrimaryCtxRelease_v2(self.device);
        }
    }
}

/// The leak report and streams (the `stitch` CLI replays on several streams).
///
/// Calls that take a [`Stream`] have the same duty as [`Driver::record_event`]: the stream
/// must be 0 (the legacy default stream) or a live stream of this device's primary context,
/// such as one from [`CudaDriver::create_stream`].
impl CudaDriver {
    /// What is still held through the [`Driver`] calls of this driver: handles created and
    /// not released, mappings not unmapped, reservations not freed, events recorded and not
    /// destroyed. CUDA cannot enumerate these, so the driver counts them.
    ///
    /// ```
    /// use stitch_alloc::driver::{CudaDriver, Driver};
    /// if let Ok(gpu) = CudaDriver::new(0) {
    ///     let h = gpu.create(gpu.granularity()).unwrap();
    ///     assert_eq!(gpu.leak_report().handles, 1);
    ///     gpu.release(h).unwrap();
    ///     assert!(gpu.leak_report().is_clean());
    /// }
    /// ```
    pub fn leak_report(&self) -> LeakReport {
        LeakReport {
            events: self.events.lock().live_count(),
            ..self.held.lock().leak_report()
        }
    }

    /// Create a stream on this device's primary context (`cuStreamCreate`);
    /// `non_blocking` = `CU_STREAM_NON_BLOCKING` (no implicit synchronisation with the legacy
    /// default stream).
    pub fn create_stream(&self, non_blocking: bool) -> DriverResult<CudaStream> {
        let op = DriverOp::MemInfo;
        STREAM_SYMBOLS.require(op)?;
        let _ctx = self.bind(op)?;
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: valid out-pointer and device handle; the retain is balanced by the release
        // in `CudaStream::drop`, or below on failure.
        check(op, "cuDevicePrimaryCtxRetain", unsafe {
            sys::cuDevicePrimaryCtxRetain(&mut ctx, self.device)
        })?;
        let flags = if non_blocking {
            sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32
        } else {
            sys::CUstream_flags::CU_STREAM_DEFAULT as u32
        };
        let mut s: sys::CUstream = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the primary context is current.
        let r = unsafe { sys::cuStreamCreate(&mut s, flags) };
        if let Err(e) = check(op, "cuStreamCreate", r) {
            // SAFETY: balances the retain above.
            unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.device) };
            return Err(e);
        }
        Ok(CudaStream {
            raw: s as u64,
            device: self.device,
            ctx: ctx as usize,
        })
    }

    /// Block until all work queued on `stream` has completed (`cuStreamSynchronize`).
    /// Errors of that work (an illegal address, say) are returned here.
    pub fn stream_synchronize(&self, stream: Stream) -> DriverResult<()> {
        let op = DriverOp::WaitEvent;
        STREAM_SYMBOLS.require(op)?;
        let _ctx = self.bind(op)?;
        let s = cu_stream(op, stream)?;
        // SAFETY: `s` is 0 or a real stream of this context (see `cu_stream`).
        check(op, "cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(s)
        })
    }

    /// Block until all work on the device has completed (`cuCtxSynchronize`); returns any
    /// error that queued work raised.
    pub fn synchronize(&self) -> DriverResult<()> {
        let op = DriverOp::WaitEvent;
        STREAM_SYMBOLS.require(op)?;
        let _ctx = self.bind(op)?;
        // SAFETY: no arguments; the context is current.
        check(op, "cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
    }
}

fn get_device(ordinal: i32) -> DriverResult<sys::CUdevice> {
    let mut device: sys::CUdevice = 0;
    // SAFETY: valid out-pointer; `lib()` succeeded, so cuInit ran.
    check_init("cuDeviceGet", unsafe {
        sys::cuDeviceGet(&mut device, ordinal)
    })?;
    Ok(device)
}

fn access_desc(device: sys::CUdevice) -> sys::CUmemAccessDesc {
    sys::CUmemAccessDesc {
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: device,
        },
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    }
}

/// The `CUstream` of `stream`, refusing a simulated stream ([`Stream::sim`]): its raw value
/// is no stream of any context. What remains is 0 (the legacy default stream) or a real
/// stream: a `Stream` is otherwise made only by [`CudaStream::stream`] (a stream of this
/// crate, live while the `CudaStream` is) or by the `unsafe` [`Stream::from_raw`], whose
/// caller vouches that it is a live stream of the device's primary context.
fn cu_stream(op: DriverOp, stream: Stream) -> DriverResult<sys::CUstream> {
    if stream.is_sim() {
        return Err(DriverError::new(
            op,
            code::INVALID_HANDLE,
            format!(
                "stream {:#x} is a simulated stream (Stream::sim), not a CUDA stream",
                stream.raw()
            ),
        ));
    }
    Ok(stream.raw() as sys::CUstream)
}

fn unknown_event(op: DriverOp, event: EventId) -> DriverError {
    DriverError::new(
        op,
        code::INVALID_HANDLE,
        format!(
            "event {:#x} was not handed out by this driver, or was destroyed",
            event.raw()
        ),
    )
}

fn usize_of(op: DriverOp, v: u64) -> DriverResult<usize> {
    usize::try_from(v).map_err(|_| {
        DriverError::new(
            op,
            code::INVALID_VALUE,
            format!("{v} does not fit in usize"),
        )
    })
}

impl Driver for CudaDriver {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn granularity(&self) -> u64 {
        self.granularity
    }

    fn mem_info(&self) -> DriverResult<MemInfo> {
        let _ctx = self.bind(DriverOp::MemInfo)?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: valid out-pointers; the context is current.
        check(DriverOp::MemInfo, "cuMemGetInfo", unsafe {
            sys::cuMemGetInfo_v2(&mut free, &mut total)
        })?;
        Ok(MemInfo {
            free: free as u64,
            total: total as u64,
        })
    }

    fn reserve(&self, size: u64) -> DriverResult<DevAddr> {
        let op = DriverOp::Reserve;
        let _ctx = self.bind(op)?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: valid out-pointer; alignment is the granularity (a power of two); no fixed
        // address is requested (0) and flags must be 0.
        check(op, "cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(
                &mut ptr,
                usize_of(op, size)?,
                self.granularity as usize,
                0,
                0,
            )
        })?;
        self.held.lock().commit_reserve(ptr, size);
        Ok(ptr)
    }

    fn free_reservation(&self, base: DevAddr, size: u64) -> DriverResult<()> {
        let op = DriverOp::FreeReservation;
        let _ctx = self.bind(op)?;
        // SAFETY: only touches address space; the driver rejects a range that is not a whole
        // earlier reservation.
        check(op, "cuMemAddressFree", unsafe {
            sys::cuMemAddressFree(base, usize_of(op, size)?)
        })?;
        self.held.lock().commit_free_reservation(base);
        Ok(())
    }

    fn create(&self, size: u64) -> DriverResult<PhysHandle> {
        let op = DriverOp::Create;
        let _ctx = self.bind(op)?;
        let prop = self.prop();
        let mut h: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: valid out-pointer and a fully initialised property; flags must be 0.
        check(op, "cuMemCreate", unsafe {
            sys::cuMemCreate(&mut h, usize_of(op, size)?, &prop, 0)
        })?;
        self.held.lock().commit_create_as(h, size);
        Ok(PhysHandle::new(h))
    }

    fn release(&self, handle: PhysHandle) -> DriverResult<()> {
        let op = DriverOp::Release;
        let _ctx = self.bind(op)?;
        self.check_handle(op, handle)?;
        // SAFETY: `check_handle` found the handle created by this driver and not released.
        check(op, "cuMemRelease", unsafe {
            sys::cuMemRelease(handle.raw())
        })?;
        self.held.lock().commit_release(handle);
        Ok(())
    }

    fn export(&self, handle: PhysHandle) -> DriverResult<OwnedFd> {
        let op = DriverOp::Share;
        SHARE_SYMBOLS.require(op)?;
        if !self.shareable {
            return Err(DriverError::new(
                op,
                code::NOT_SUPPORTED,
                format!(
                    "device {} does not support POSIX file descriptors as shareable handles",
                    self.ordinal
                ),
            ));
        }
        self.check_handle(op, handle)?;
        let _ctx = self.bind(op)?;
        let mut fd: c_int = -1;
        // SAFETY: `check_handle` found the handle held by this driver; it was created with
        // the POSIX-descriptor type (`shareable`), for which the out-pointer is an `int`.
        check(op, "cuMemExportToShareableHandle", unsafe {
            sys::cuMemExportToShareableHandle(
                (&mut fd as *mut c_int).cast(),
                handle.raw(),
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        })?;
        if fd < 0 {
            return Err(DriverError::new(
                op,
                code::INVALID_VALUE,
                format!("cuMemExportToShareableHandle returned descriptor {fd}"),
            ));
        }
        // SAFETY: the driver just opened `fd` for the caller; nothing else owns it.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    fn import(&self, fd: BorrowedFd<'_>, size: u64) -> DriverResult<PhysHandle> {
        let op = DriverOp::Share;
        SHARE_SYMBOLS.require(op)?;
        let _ctx = self.bind(op)?;
        let mut h: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: for the POSIX-descriptor type the handle argument is the descriptor itself,
        // passed by value as a pointer-sized integer; it stays open for the call (borrowed).
        check(op, "cuMemImportFromShareableHandle", unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut h,
                fd.as_raw_fd() as usize as *mut c_void,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        })?;
        self.held.lock().commit_import_as(h, size);
        Ok(PhysHandle::new(h))
    }

    fn map(&self, addr: DevAddr, size: u64, handle: PhysHandle) -> DriverResult<()> {
        let op = DriverOp::Map;
        self.check_handle(op, handle)?;
        let _ctx = self.bind(op)?;
        // SAFETY: maps into reserved address space only; the driver rejects ranges outside a
        // reservation or overlapping a mapping. Offset and flags must be 0.
        check(op, "cuMemMap", unsafe {
            sys::cuMemMap(addr, usize_of(op, size)?, 0, handle.raw(), 0)
        })?;
        self.held.lock().commit_map(addr, size, handle);
        Ok(())
    }

    fn unmap(&self, addr: DevAddr, size: u64) -> DriverResult<()> {
        let op = DriverOp::Unmap;
        let _ctx = self.bind(op)?;
        // SAFETY: unmapping only invalidates device addresses; the allocator fences in-flight
        // work with events before it unmaps (no VMM call waits for the GPU).
        check(op, "cuMemUnmap", unsafe {
            sys::cuMemUnmap(addr, usize_of(op, size)?)
        })?;
        self.held.lock().commit_unmap(addr);
        Ok(())
    }

    fn set_access(&self, addr: DevAddr, size: u64) -> DriverResult<()> {
        let op = DriverOp::SetAccess;
        let _ctx = self.bind(op)?;
        // SAFETY: `access` holds `len` initialised descriptors; the driver validates the range.
        check(op, "cuMemSetAccess", unsafe {
            sys::cuMemSetAccess(
                addr,
                usize_of(op, size)?,
                self.access.as_ptr(),
                self.access.len(),
            )
        })
    }

    fn record_event(&self, stream: Stream) -> DriverResult<EventId> {
        let op = DriverOp::RecordEvent;
        let cu_stream = cu_stream(op, stream)?;
        let _ctx = self.bind(op)?;
        let ev = self.new_event()?;
        // SAFETY: `ev` is a live event of this context (new or spare, not handed out);
        // `cu_stream` is 0 (the legacy default stream) or a stream of this context: a
        // `Stream` is made only by `CudaStream::stream` or by the `unsafe Stream::from_raw`
        // whose caller vouches for it, and simulated ones were refused above.
        let r = unsafe { sys::cuEventRecord(ev as sys::CUevent, cu_stream) };
        self.events.lock().hand_out(ev);
        if let Err(e) = check(op, "cuEventRecord", r) {
            let _ = self.destroy_event(EventId::new(ev));
            return Err(e);
        }
        Ok(EventId::new(ev))
    }

    fn query_event(&self, event: EventId) -> DriverResult<bool> {
        let op = DriverOp::QueryEvent;
        self.check_event(op, event)?;
        let _ctx = self.bind(op)?;
        // SAFETY: `check_event` found the event handed out by `record_event` and not
        // destroyed, so it is a live event of this context.
        let r = unsafe { sys::cuEventQuery(event.raw() as sys::CUevent) };
        match r {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            _ => check(op, "cuEventQuery", r).map(|_| false),
        }
    }

    fn wait_event(&self, event: EventId) -> DriverResult<()> {
        let op = DriverOp::WaitEvent;
        self.check_event(op, event)?;
        let _ctx = self.bind(op)?;
        // SAFETY: as in `query_event`.
        check(op, "cuEventSynchronize", unsafe {
            sys::cuEventSynchronize(event.raw() as sys::CUevent)
        })
    }

    fn destroy_event(&self, event: EventId) -> DriverResult<()> {
        let op = DriverOp::DestroyEvent;
        match self.events.lock().retire(event.raw()) {
            None => return Err(unknown_event(op, event)),
            Some(Retired::Pooled) => return Ok(()),
            Some(Retired::Destroy) => {}
        }
        let _ctx = self.bind(op)?;
        // SAFETY: the pool found the event handed out and not destroyed, and took it out of
        // the live set without keeping it as a spare: it is destroyed exactly once, here.
        check(op, "cuEventDestroy", unsafe {
            sys::cuEventDestroy_v2(event.raw() as sys::CUevent)
        })
    }

    fn write(&self, addr: DevAddr, data: &[u8]) -> DriverResult<()> {
        if data.is_empty() {
            return Ok(());
        }
        let op = DriverOp::Copy;
        COPY_SYMBOLS.require(op)?;
        let _ctx = self.bind(op)?;
        // SAFETY: `data` is a live host buffer of `len` bytes; the driver checks that the
        // device range is mapped and accessible.
        check(op, "cuMemcpyHtoD", unsafe {
            sys::cuMemcpyHtoD_v2(addr, data.as_ptr() as *const c_void, data.len())
        })?;
        // A copy from pageable memory may return before the DMA lands; wait, so that an
        // unmap right after `write` cannot race it.
        // SAFETY: no arguments; the context is current.
        check(op, "cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
    }

    fn read(&self, addr: DevAddr, buf: &mut [u8]) -> DriverResult<()> {
        if buf.is_empty() {
            return Ok(());
        }
        let op = DriverOp::Copy;
        COPY_SYMBOLS.require(op)?;
        let _ctx = self.bind(op)?;
        // SAFETY: `buf` is a live, writable host buffer of `len` bytes; the copy to pageable
        // memory is synchronous, so it is complete when the call returns.
        check(op, "cuMemcpyDtoH", unsafe {
            sys::cuMemcpyDtoH_v2(buf.as_mut_ptr() as *mut c_void, addr, buf.len())
        })
    }

    fn stream_capturing(&self, stream: Stream) -> DriverResult<bool> {
        // The legacy default stream (0, or `CU_STREAM_LEGACY`) cannot capture: torch's
        // default stream costs no driver call.
        if stream.raw() <= 1 {
            return Ok(false);
        }
        let op = DriverOp::RecordEvent;
        let s = cu_stream(op, stream)?;
        let query = || {
            let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
            // SAFETY: valid out-pointer; `s` is a real stream of this device's primary
            // context (see `cu_stream`) or `CU_STREAM_PER_THREAD`, resolved through the
            // current context.
            let r = unsafe { sys::cuStreamIsCapturing(s, &mut status) };
            (r, status)
        };
        // An explicit stream names its context; the per-thread default stream (2) is the
        // current context's, and a caller on another context is retried bound.
        let (mut r, mut status) = if stream.raw() == 2 {
            let _ctx = self.bind(op)?;
            query()
        } else {
            query()
        };
        if r == sys::CUresult::CUDA_ERROR_INVALID_CONTEXT {
            let _ctx = self.bind(op)?;
            (r, status) = query();
        }
        match r {
            // Active or invalidated: the capture goes on, and its graph may run.
            sys::CUresult::CUDA_SUCCESS => {
                Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
            }
            // A relaxed capture elsewhere makes this (legacy-synchronising) stream part of it.
            sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT => Ok(true),
            _ => check(op, "cuStreamIsCapturing", r).map(|_| false),
        }
    }

    fn exchange_capture_mode(&self, mode: super::CaptureMode) -> DriverResult<super::CaptureMode> {
        use super::CaptureMode as M;
        use sys::CUstreamCaptureMode as C;
        let op = DriverOp::RecordEvent;
        CAPTURE_SYMBOLS.require(op)?;
        let mut m = match mode {
            M::Global => C::CU_STREAM_CAPTURE_MODE_GLOBAL,
            M::ThreadLocal => C::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            M::Relaxed => C::CU_STREAM_CAPTURE_MODE_RELAXED,
        };
        // SAFETY: valid in-out pointer; the call only swaps the calling thread's mode.
        check(op, "cuThreadExchangeStreamCaptureMode", unsafe {
            sys::cuThreadExchangeStreamCaptureMode(&mut m)
        })?;
        Ok(match m {
            C::CU_STREAM_CAPTURE_MODE_GLOBAL => M::Global,
            C::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL => M::ThreadLocal,
            C::CU_STREAM_CAPTURE_MODE_RELAXED => M::Relaxed,
        })
    }

    fn access_devices(&self) -> u32 {
        self.access.len() as u32
    }
    fn has_data(&self) -> bool {
        true
    }
}

impl Drop for CudaDriver {
    fn drop(&mut self) {
        let pooled = self.events.get_mut().drain_spare();
        let ctx = if pooled.is_empty() {
            None
        } else {
            self.bind(DriverOp::DestroyEvent).ok()
        };
        if ctx.is_some() {
            for ev in pooled {
                // SAFETY: pooled events are live events of this context, each pooled once.
                let r = unsafe { sys::cuEventDestroy_v2(ev as sys::CUevent) };
                if let Err(e) = check(DriverOp::DestroyEvent, "cuEventDestroy", r) {
                    tracing::warn!(%e, "destroying a pooled event failed");
                }
            }
        }
        drop(ctx);
        // SAFETY: balances the cuDevicePrimaryCtxRetain in `with_peers` (exactly once).
        let r = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.device) };
        if let Err(e) = check(DriverOp::MemInfo, "cuDevicePrimaryCtxRelease", r) {
            tracing::warn!(%e, "releasing the primary context failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn availability_never_panics_and_agrees_with_new() {
        let avail = CudaDriver::available();
        assert_eq!(avail, CudaDriver::unavailable_reason().is_none());
        assert_eq!(avail, CudaDriver::device_count() > 0);
        assert_eq!(avail, CudaDriver::new(0).is_ok());
    }

    #[test]
    fn without_libcuda_everything_is_an_error() {
        // SAFETY: see `load_and_init`.
        if unsafe { sys::is_culib_present() } {
            eprintln!("SKIPPED (libcuda present): without_libcuda_everything_is_an_error");
            return;
        }
        assert!(!CudaDriver::available());
        let e = CudaDriver::new(0).unwrap_err();
        assert!(e.message.contains("libcuda"), "{e}");
        assert!(CudaDriver::with_peers(0, &[1]).is_err());
        assert!(CudaDriver::unavailable_reason()
            .unwrap()
            .contains("libcuda"));
    }

    #[test]
    fn simulated_streams_are_refused_before_any_cuda_call() {
        let e = cu_stream(DriverOp::RecordEvent, Stream::sim(1)).unwrap_err();
        assert_eq!(e.code, code::INVALID_HANDLE);
        assert!(e.message.contains("simulated"), "{e}");
        assert!(cu_stream(DriverOp::RecordEvent, Stream::DEFAULT)
            .unwrap()
            .is_null());
        // SAFETY: the value is only converted, never given to libcuda.
        let real = unsafe { Stream::from_raw(0x7f00_dead_0000) };
        assert_eq!(
            cu_stream(DriverOp::RecordEvent, real).unwrap() as u64,
            0x7f00_dead_0000
        );
    }

    #[test]
    fn bad_ordinals_are_errors() {
        assert!(CudaDriver::new(-1).is_err());
        assert!(CudaDriver::new(i32::MAX).is_err());
    }

    #[test]
    fn error_codes_and_messages() {
        assert!(check(DriverOp::Map, "cuMemMap", sys::CUresult::CUDA_SUCCESS).is_ok());
        let e = check(
            DriverOp::Create,
            "cuMemCreate",
            sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY,
        )
        .unwrap_err();
        assert_eq!(e.code, code::OUT_OF_MEMORY);
        assert_eq!(e.op, DriverOp::Create);
        assert!(e.message.starts_with("cuMemCreate: "), "{}", e.message);
        if !CudaDriver::available() {
            // Without libcuda the name comes from the enum's Debug form.
            assert!(
                e.message.contains("CUDA_ERROR_OUT_OF_MEMORY"),
                "{}",
                e.message
            );
        }
        let e = check(
            DriverOp::Map,
            "cuMemMap",
            sys::CUresult::CUDA_ERROR_INVALID_VALUE,
        )
        .unwrap_err();
        assert_eq!(e.code, 1);
        assert!(
            e.message.contains("CUDA_ERROR_INVALID_VALUE"),
            "{}",
            e.message
        );
    }
}
