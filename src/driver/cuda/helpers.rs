//! Test and benchmark helpers of [`CudaDriver`] (feature `cuda-test-helpers`, which the
//! `testing` feature and the crate's own tests, benchmarks and examples turn on): stream-
//! ordered copies and memsets, access queries, and the `cudaMalloc`/`cudaMallocAsync`
//! baselines.
//!
//! The production allocator does not use them, so their libcuda symbols ([`HELPER_SYMBOLS`],
//! among them `cuMemAllocAsync`, which old drivers lack) are not required when the library
//! is loaded: they are probed on the first call of a helper, which fails with
//! `CUDA_ERROR_NOT_SUPPORTED` when one is missing.
//!
//! Calls that take a [`Stream`] have the same duty as [`Driver::record_event`](crate::driver::Driver::record_event): the stream
//! must be 0 (the legacy default stream) or a live stream of this device's primary context,
//! such as one from [`CudaDriver::create_stream`]. Device addresses are checked by the driver;
//! a bad one gives an error (or, for queued work, a sticky `CUDA_ERROR_ILLEGAL_ADDRESS` that
//! the next synchronisation reports), never a host memory error.

use super::{check, cu_stream, usize_of, Bound, CudaDriver, SymbolGroup};
use crate::driver::{DevAddr, DriverOp, DriverResult, Stream};
use cudarc::driver::sys;
use std::ffi::c_void;

/// The libcuda symbols only these helpers call.
pub(super) static HELPER_SYMBOLS: SymbolGroup = SymbolGroup::new(&[
    "cuMemGetAccess",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoHAsync_v2",
    "cuMemcpyDtoDAsync_v2",
    "cuMemsetD32Async",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemAllocAsync",
    "cuMemFreeAsync",
    "cuDeviceGetDefaultMemPool",
    "cuMemPoolSetAttribute",
    "cuMemPoolTrimTo",
]);

impl CudaDriver {
    /// Bind the context (until the guard drops) after checking that the helpers' symbols
    /// exist.
    fn bind_helper(&self, op: DriverOp) -> DriverResult<Bound> {
        HELPER_SYMBOLS.require(op)?;
        self.bind(op)
    }

    /// Fill `count` 32-bit words at `addr` with `value`, queued on `stream`
    /// (`cuMemsetD32Async`). `addr` must be 4-byte aligned.
    pub fn memset_d32_async(
        &self,
        addr: DevAddr,
        value: u32,
        count: u64,
        stream: Stream,
    ) -> DriverResult<()> {
        let op = DriverOp::Copy;
        let _ctx = self.bind_helper(op)?;
        // SAFETY: only device memory is written; the driver validates the range (an invalid
        // one fails or faults on the device, never on the host). The stream is 0 or real (see `cu_stream`).
        check(op, "cuMemsetD32Async", unsafe {
            sys::cuMemsetD32Async(addr, value, usize_of(op, count)?, cu_stream(op, stream)?)
        })
    }

    /// Copy `len` bytes from device address `src` to `dst`, queued on `stream`
    /// (`cuMemcpyDtoDAsync`). The ranges must not overlap.
    pub fn copy_dtod_async(
        &self,
        dst: DevAddr,
        src: DevAddr,
        len: u64,
        stream: Stream,
    ) -> DriverResult<()> {
        let op = DriverOp::Copy;
        let _ctx = self.bind_helper(op)?;
        // SAFETY: device memory only, validated by the driver; the stream is 0 or real (see `cu_stream`).
        check(op, "cuMemcpyDtoDAsync", unsafe {
            sys::cuMemcpyDtoDAsync_v2(dst, src, usize_of(op, len)?, cu_stream(op, stream)?)
        })
    }

    /// Copy `data` to device address `addr` on `stream` and wait for that stream, so the
    /// copy has landed when this returns (other streams are not waited for, unlike
    /// [`Driver::write`], which synchronises the whole device).
    pub fn write_on(&self, stream: Stream, addr: DevAddr, data: &[u8]) -> DriverResult<()> {
        if data.is_empty() {
            return Ok(());
        }
        let op = DriverOp::Copy;
        let _ctx = self.bind_helper(op)?;
        // SAFETY: `data` is a live host buffer of `len` bytes and stays borrowed until the
        // stream synchronisation below, after which the copy no longer reads it.
        check(op, "cuMemcpyHtoDAsync", unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                addr,
                data.as_ptr() as *const c_void,
                data.len(),
                cu_stream(op, stream)?,
            )
        })?;
        self.stream_synchronize(stream)
    }

    /// Copy device bytes at `addr` into `buf` on `stream` and wait for that stream.
    pub fn read_on(&self, stream: Stream, addr: DevAddr, buf: &mut [u8]) -> DriverResult<()> {
        if buf.is_empty() {
            return Ok(());
        }
        let op = DriverOp::Copy;
        let _ctx = self.bind_helper(op)?;
        // SAFETY: `buf` is a live, writable host buffer of `len` bytes, exclusively borrowed
        // until the stream synchronisation below completes the copy.
        check(op, "cuMemcpyDtoHAsync", unsafe {
            sys::cuMemcpyDtoHAsync_v2(
                buf.as_mut_ptr() as *mut c_void,
                addr,
                buf.len(),
                cu_stream(op, stream)?,
            )
        })?;
        self.stream_synchronize(stream)
    }

    /// This device's access flags on the mapping holding `addr` (`cuMemGetAccess`):
    /// 0 = none, 1 = read, 3 = read-write. An error when `addr` is not mapped.
    pub fn access_flags(&self, addr: DevAddr) -> DriverResult<u64> {
        let op = DriverOp::SetAccess;
        let _ctx = self.bind_helper(op)?;
        let mut flags: std::ffi::c_ulonglong = 0;
        let loc = self.access[0].location;
        // SAFETY: valid out-pointer and location; the driver validates `addr`.
        check(op, "cuMemGetAccess", unsafe {
            sys::cuMemGetAccess(&mut flags, &loc, addr)
        })?;
        Ok(flags as u64)
    }

    /// Whether `[addr, addr+len)` is mapped with read-write access for this device, judged
    /// by [`CudaDriver::access_flags`] at the first and last byte, every granule boundary
    /// when the range spans at most 64 granules, and 64 evenly spaced points otherwise.
    pub fn is_accessible(&self, addr: DevAddr, len: u64) -> bool {
        if len == 0 {
            return true;
        }
        let rw = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE as u64;
        let ok = |p: DevAddr| self.access_flags(p).is_ok_and(|f| f == rw);
        let g = self.granularity;
        let last = addr + len - 1;
        if !ok(addr) || !ok(last) {
            return false;
        }
        let first_granule = addr / g + 1;
        let end_granule = last / g; // granules starting inside (addr, last]
        let n = end_granule.saturating_sub(first_granule) + 1;
        if end_granule < first_granule {
            return true;
        }
        let step = n.div_ceil(64).max(1);
        (0..n)
            .step_by(step as usize)
            .all(|i| ok((first_granule + i) * g))
    }

    /// `cuMemAlloc`: `size` bytes of device memory outside the allocator (the `cudaMalloc`
    /// baseline, and scratch buffers for tests). Free with [`CudaDriver::mem_free`].
    pub fn mem_alloc(&self, size: u64) -> DriverResult<DevAddr> {
        let op = DriverOp::Create;
        let _ctx = self.bind_helper(op)?;
        let mut p: sys::CUdeviceptr = 0;
        // SAFETY: valid out-pointer; the context is current.
        check(op, "cuMemAlloc", unsafe {
            sys::cuMemAlloc_v2(&mut p, usize_of(op, size)?)
        })?;
        Ok(p)
    }

    /// `cuMemFree` of memory from [`CudaDriver::mem_alloc`] (waits for queued work that
    /// uses it; the driver rejects any other address).
    pub fn mem_free(&self, addr: DevAddr) -> DriverResult<()> {
        let op = DriverOp::Release;
        let _ctx = self.bind_helper(op)?;
        // SAFETY: the driver validates the address against its allocations.
        check(op, "cuMemFree", unsafe { sys::cuMemFree_v2(addr) })
    }

    /// `cuMemAllocAsync` from the device's default memory pool, ordered on `stream` (the
    /// `cudaMallocAsync` baseline).
    pub fn mem_alloc_async(&self, size: u64, stream: Stream) -> DriverResult<DevAddr> {
        let op = DriverOp::Create;
        let _ctx = self.bind_helper(op)?;
        let mut p: sys::CUdeviceptr = 0;
        // SAFETY: valid out-pointer; the stream is 0 or real (see `cu_stream`).
        check(op, "cuMemAllocAsync", unsafe {
            sys::cuMemAllocAsync(&mut p, usize_of(op, size)?, cu_stream(op, stream)?)
        })?;
        Ok(p)
    }

    /// `cuMemFreeAsync`: give memory from [`CudaDriver::mem_alloc_async`] back to its pool,
    /// ordered on `stream`.
    pub fn mem_free_async(&self, addr: DevAddr, stream: Stream) -> DriverResult<()> {
        let op = DriverOp::Release;
        let _ctx = self.bind_helper(op)?;
        // SAFETY: the driver validates the address; the stream is 0 or real (see `cu_stream`).
        check(op, "cuMemFreeAsync", unsafe {
            sys::cuMemFreeAsync(addr, cu_stream(op, stream)?)
        })
    }

    fn default_pool(&self, op: DriverOp) -> DriverResult<sys::CUmemoryPool> {
        let _ctx = self.bind_helper(op)?;
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: valid out-pointer and device handle.
        check(op, "cuDeviceGetDefaultMemPool", unsafe {
            sys::cuDeviceGetDefaultMemPool(&mut pool, self.device)
        })?;
        Ok(pool)
    }

    /// Set the default memory pool's release threshold (`CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`):
    /// the pool keeps up to this many unused bytes across synchronisations. `u64::MAX` keeps
    /// everything, as PyTorch's `cudaMallocAsync` backend does (a "warm pool").
    pub fn set_default_pool_release_threshold(&self, bytes: u64) -> DriverResult<()> {
        let op = DriverOp::MemInfo;
        let pool = self.default_pool(op)?;
        let mut v: u64 = bytes;
        // SAFETY: the release threshold attribute takes a pointer to a cuuint64_t, which `v`
        // is, live for the call.
        check(op, "cuMemPoolSetAttribute", unsafe {
            sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                &mut v as *mut u64 as *mut c_void,
            )
        })
    }

    /// Release the default pool's unused memory down to `keep` bytes (`cuMemPoolTrimTo`).
    pub fn trim_default_pool(&self, keep: u64) -> DriverResult<()> {
        let op = DriverOp::MemInfo;
        let pool = self.default_pool(op)?;
        // SAFETY: a pool handle from cuDeviceGetDefaultMemPool.
        check(op, "cuMemPoolTrimTo", unsafe {
            sys::cuMemPoolTrimTo(pool, usize_of(op, keep)?)
        })
    }
}
