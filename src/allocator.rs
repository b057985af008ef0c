//! The public allocator: a lock around the engine, plus the RAII buffer type.
#![forbid(unsafe_code)]

use crate::config::Config;
use crate::driver::{Driver, Stream};
use crate::engine::{Engine, Layout, Step};
use crate::error::{AllocError, Result};
use crate::stats::{DetailedStats, Stats};
use parking_lot::{Mutex, MutexGuard};
use std::fmt;

/// A device address handed out by the allocator.
///
/// ```
/// use stitch_alloc::DevicePtr;
/// let p = DevicePtr(0x2000);
/// assert_eq!(p.addr(), 0x2000);
/// assert_eq!(format!("{p}"), "0x2000");
/// ```
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DevicePtr(pub u64);

impl DevicePtr {
    /// The address as an integer.
    ///
    /// ```
    /// use stitch_alloc::{Allocator, Config, Stream};
    /// use stitch_alloc::driver::SimDriver;
    /// let a = Allocator::new(SimDriver::with_capacity(1 << 30), Config::default()).unwrap();
    /// let p = a.alloc(1000, Stream::DEFAULT).unwrap();
    /// assert_ne!(p.addr(), 0);
    /// assert_eq!(p.addr() % 512, 0, "blocks are 512-byte aligned");
    /// # a.free(p, Stream::DEFAULT).unwrap();
    /// ```
    pub fn addr(self) -> u64 {
        self.0
    }
}

impl fmt::Display for DevicePtr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

/// What `shutdown` found and did.
///
/// ```
/// use stitch_alloc::{Allocator, Config, ShutdownReport, Stream};
/// use stitch_alloc::driver::SimDriver;
/// let a = Allocator::new(SimDriver::with_capacity(1 << 30), Config::default()).unwrap();
/// let p = a.alloc(1 << 20, Stream::DEFAULT).unwrap();
/// a.free(p, Stream::DEFAULT).unwrap();
/// let clean = ShutdownReport { leaked_allocations: 0, leaked_bytes: 0 };
/// assert_eq!(a.shutdown(), clean);
/// ```
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct ShutdownReport {
    /// Allocations still live at shutdown (their memory was given back anyway).
    pub leaked_allocations: u64,
    /// Requested bytes of those allocations.
    pub leaked_bytes: u64,
}

/// A GPU memory allocator over a [`Driver`] that never fails for external fragmentation.
///
/// Thread-safe (`Send + Sync` when the driver is). The hot path (a request that fits an
/// already mapped free block) takes one uncontended lock and makes no driver call.
///
/// ```
/// use stitch_alloc::{Allocator, Config, Stream};
/// use stitch_alloc::driver::SimDriver;
///
/// let a = Allocator::new(SimDriver::with_capacity(1 << 30), Config::default()).unwrap();
/// let p = a.alloc(300 << 20, Stream::DEFAULT).unwrap();
/// let q = a.alloc(512, Stream::DEFAULT).unwrap();
/// assert_ne!(p, q);
/// a.free(p, Stream::DEFAULT).unwrap();
/// a.free(q, Stream::DEFAULT).unwrap();
/// assert!(a.free(q, Stream::DEFAULT).is_err(), "double free is an error value");
/// assert_eq!(a.stats().requested.current, 0);
/// ```
pub struct Allocator<D: Driver> {
    engine: Mutex<Engine>,
    driver: D,
}

impl<D: Driver> fmt::Debug for Allocator<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Allocator")
            .field("driver", &self.driver.name())
            .field("stats", &self.stats())
            .finish()
    }
}

impl<D: Driver> Allocator<D> {
    /// Create an allocator on `driver`. Reserves virtual address space up front; creates no
    /// physical memory until the first allocation.
    ///
    /// ```
    /// use stitch_alloc::{Allocator, Capacity, Config};
    /// use stitch_alloc::driver::SimDriver;
    /// let cfg = Config::default().with_capacity(Capacity::Bytes(256 << 20));
    /// let a = Allocator::new(SimDriver::with_capacity(1 << 30), cfg).unwrap();
    /// assert_eq!(a.capacity(), 256 << 20);
    /// assert_eq!(a.stats().reserved.current, 0, "no physical memory yet");
    /// ```
    pub fn new(driver: D, config: Config) -> Result<Self> {
        let info = driver.mem_info()?;
        let mut resolved = config.resolve(driver.granularity(), info)?;
        if let Some(limit) = driver.handle_limit() {
            if let Some(floor) = resolved.fit_handle_limit(limit) {
                tracing::info!(
                    driver = driver.name(),
                    limit,
                    split_min = floor,
                    "the backend holds at most `limit` handles: growth creates handles of at \
                     least `split_min` bytes so that the capacity fits"
                );
            }
        }
        let mut engine = Engine::new(&driver, resolved)?;
        engine.stats.calls.add(crate::driver::DriverOp::MemInfo);
        tracing::info!(
            driver = driver.name(),
            capacity = engine.cfg.capacity,
            granularity = engine.cfg.granularity,
            "stitch-alloc ready"
        );
        Ok(Allocator {
            engine: Mutex::new(engine),
            driver,
        })
    }

    fn check(&self, e: &Engine) {
        if e.cfg.paranoid {
            if let Err(msg) = e.validate() {
                panic!("stitch-alloc invariant violated: {msg}");
            }
        }
    }

    /// Allocate `size` bytes for use on `stream`. The memory is mapped, accessible, and stays
    /// at its address until freed.
    ///
    /// ```
    /// use stitch_alloc::{Allocator, Config, Stream};
    /// use stitch_alloc::driver::SimDriver;
    /// let a = Allocator::new(SimDriver::with_capacity(1 << 30), Config::default()).unwrap();
    /// let p = a.alloc(64 << 20, Stream::DEFAULT).unwrap();
    /// assert_eq!(a.stats().allocs, 1);
    /// assert_eq!(a.usable_size(p), Some(64 << 20));
    /// # a.free(p, Stream::DEFAULT).unwrap();
    /// ```
    pub fn alloc(&self, size: u64, stream: Stream) -> Result<DevicePtr> {
        let mut e = self.engine.lock();
        let mut rounds = 0;
        let r = loop {
            match e.alloc_step(&self.driver, size, stream, rounds) {
                Ok(Step::Done(p)) => break Ok(DevicePtr(p)),
                Ok(Step::Wait(ev)) => {
                    // Wait for in-flight work without the lock: other threads' fast paths
                    // (and frees from host callbacks on the awaited stream) go on meanwhile.
                    let r = MutexGuard::unlocked(&mut e, || self.driver.wait_event(ev));
                    e.waited(&self.driver, ev, r);
                    rounds += 1;
                }
                Err(err) => break Err(err),
            }
        };
        self.check(&e);
        r
    }

    /// Free memory from [`Allocator::alloc`] whose last use was queued on `stream`.
    ///
    /// It is reusable at once by `stream`; by other streams and by stitching only after the
    /// work queued on `stream` before this call has completed. Memory also used on other
    /// streams ([`Allocator::record_stream`]) is fenced on each; a stream whose event cannot be
    /// recorded now is fenced on a later slow path, so the free itself still succeeds.
    ///
    /// ```
    /// use stitch_alloc::{Allocator, Config, Stream};
    /// use stitch_alloc::driver::SimDriver;
    /// let a = Allocator::new(SimDriver::with_capacity(1 << 30), Config::default()).unwrap();
    /// let p = a.alloc(4 << 20, Stream::DEFAULT).unwrap();
    /// a.free(p, Stream::DEFAULT).unwrap();
    /// assert_eq!(a.stats().frees, 1);
    /// assert!(a.free(p, Stream::DEFAULT).is_err(), "double free");
    /// ```
    pub fn free(&self, ptr: DevicePtr, stream: Stream) -> Result<()> {
        self.free_sized(ptr, stream).map(|_| ())
    }

    /// [`Allocator::free`], returning the usable size the block had
    /// ([`Allocator::usable_size`] before the free), for the C ABI's size check without a
    /// second lookup.
    pub(crate) fn free_sized(&self, ptr: DevicePtr, stream: Stream) -> Result<u64> {
        let mut e = self.engine.lock();
        let r = e.free(&self.driver, ptr.0, stream);
        self.check(&e);
        r
    }

    /// Allocate `size` bytes for use on `stream`, which may be capturing a CUDA graph (a
    /// graph's private memory pool): only clean free memory or new memory is used, and no
    /// event is recorded, queried or waited for on any stream. The driver's virtual memory
    /// calls run with the thread in relaxed capture mode
    /// ([`Driver::exchange_capture_mode`]), which a capture in global mode requires. Give
    /// the memory back with [`Allocator::free_clean`] once no work uses it.
    ///
    /// ```
    /// use stitch_alloc::{Allocator, Config, Stream};
    /// use stitch_alloc::driver::SimDriver;
    /// let a = Allocator::new(SimDriver::with_capacity(1 << 30), Config::default()).unwrap();
    /// let p = a.alloc_clean(8 << 20, Stream::sim(3)).unwrap();
    /// assert_eq!(a.stats().calls.get(stitch_alloc::driver::DriverOp::RecordEvent), 0);
    /// a.free_clean(p).unwrap();
    /// ```
    pub fn alloc_clean(&self, size: u64, stream: Stream) -> Result<DevicePtr> {
        let old = self
            .driver
            .exchange_capture_mode(crate::driver::CaptureMode::Relaxed)?;
        let r = {
            let mut e = self.engine.lock();
            let r = e.alloc_clean(&self.driver, size, stream).map(DevicePtr);
            self.check(&e);
            r
        };
        if let Err(err) = self.driver.exchange_capture_mode(old) {
            tracing::warn!(%err, "could not restore the thread's stream capture mode");
        }
        r
    }

    /// Allocate `size` bytes for use on `stream` inside **one** physical handle created for
    /// them (any size up to the capacity), mapped alone: for buffers that NCCL user-buffer
    /// registration or RDMA pinning will see, which need one physical allocation behind
    /// the whole range (a span of several handles, stitched or not, is refused there).
    /// Clean free handles are released first when the capacity leaves no room. Free it
    /// with [`Allocator::free`] like any other allocation; its handle then joins the pool.
    ///
    /// ```
    /// use stitch_alloc::{Allocator, Config, Stream};
    /// use stitch_alloc::driver::{DriverOp, SimDriver};
    /// let a = Allocator::new(SimDriver::with_capacity(1 << 30), Config::default()).unwrap();
    /// let p = a.alloc_one_handle(300 << 20, Stream::DEFAULT).unwrap();
    /// assert_eq!(a.stats().calls.get(DriverOp::Create), 1, "one handle, above max_handle");
    /// a.free(p, Stream::DEFAULT).unwrap();
    /// ```
    pub fn alloc_one_handle(&self, size: u64, stream: Stream) -> Result<DevicePtr> {
        let mut e = self.engine.lock();
        let r = e
            .alloc_one_handle(&self.driver, size, stream)
            .map(DevicePtr);
        self.check(&e);
        r
    }

    /// Make the live allocation at `ptr` shareable with another process (CUDA IPC, what
    /// `torch.multiprocessing` needs): its physical handles are exported as POSIX file
    /// descriptors, each once, kept open until the handle is released. The receiver maps
    /// them with [`crate::ipc::open`]. Keep the allocation alive until every receiver has
    /// closed it. Errors: a pointer that is not the start of a live allocation, a backend
    /// that cannot export (the simulator; a GPU without POSIX-descriptor handles).
    ///
    /// ```
    /// use std::sync::Arc;
    /// use stitch_alloc::driver::{Driver, HostDriver, SimDriver};
    /// use stitch_alloc::{ipc, Allocator, Config, Stream};
    /// let a = Allocator::new(HostDriver::with_capacity(64 << 20).unwrap(), Config::default()).unwrap();
    /// let p = a.alloc(3 << 20, Stream::DEFAULT).unwrap();
    /// let s = a.share(p).unwrap();
    /// assert_eq!(s, a.share(p).unwrap(), "the same message each time");
    /// assert_eq!(ipc::Message::decode(&s.handle).unwrap().pid, std::process::id());
    /// a.free(p, Stream::DEFAULT).unwrap();
    /// let sim = Allocator::new(SimDriver::with_capacity(1 << 30), Config::default()).unwrap();
    /// let q = sim.alloc(1 << 20, Stream::DEFAULT).unwrap();
    /// assert!(sim.share(q).is_err(), "the simulator holds no memory to share");
    /// # sim.free(q, Stream::DEFAULT).unwrap();
    /// ```
    pub fn share(&self, ptr: DevicePtr) -> Result<crate::ipc::SharedBlock> {
        let mut e = self.engine.lock();
        let r = e.share(&self.driver, ptr.0);
        self.check(&e);
        let x = r?;
        Ok(crate::ipc::SharedBlock {
            handle: crate::ipc::Message {
                pid: std::process::id(),
                pieces: x.pieces,
            }
            .encode(),
            offset: x.offset,
        })
    }

    /// Free memory as clean: usable by every stream at once, with no event recorded. The
    /// caller guarantees that no work queued on the device uses it any more (for a CUDA
    /// graph's pool: after the device was synchronised once the graph was destroyed).
    pub fn free_clean(&self, ptr: DevicePtr) -> Result<()> {
        let mut e = self.engine.lock();
        let r = e.free_clean(ptr.0);
        self.check(&e);
        r
    }

    /// Start every high-water mark of [`Allocator::stats`] again from its current value
    /// (torch's `reset_peak_memory_stats`). The growth budget keeps the lifetime peak
    /// (`Stats::requested_lifetime_peak`), so resetting changes no allocation decision.
    pub fn reset_peak_stats(&self) {
        self.engine.lock().stats.reset_peaks();
    }

    /// Zero the accumulated counters of [`Allocator::stats`] (`Stats::reset_accumulated`;
    /// torch's `reset_accumulated_memory_stats`).
    ///
    /// ```
    /// use stitch_alloc::{Allocator, Config, Stream};
    /// use stitch_alloc::driver::SimDriver;
    /// let a = Allocator::new(SimDriver::with_capacity(1 << 30), Config::default()).unwrap();
    /// let p = a.alloc(1 << 20, Stream::DEFAULT).unwrap();
    /// a.reset_accumulated_stats();
    /// let s = a.stats();
    /// assert_eq!((s.allocs, s.live_allocations.current), (0, 1));
    /// # a.free(p, Stream::DEFAULT).unwrap();
    /// ```
    pub fn reset_accumulated_stats(&self) {
        self.engine.lock().stats.reset_accumulated();
    }

    /// Change the capacity at run time to `bytes` rounded down to the granularity; returns
    /// the capacity set. Nothing live is touched: with a lower capacity no memory is created
    /// while more than it is held, and a later allocation that does not fit under it fails
    /// with [`AllocError::OutOfMemory`] (or `TooLarge`).
    ///
    /// ```
    /// use stitch_alloc::{Allocator, Config, Stream};
    /// use stitch_alloc::driver::SimDriver;
    /// let a = Allocator::new(SimDriver::with_capacity(1 << 30), Config::default()).unwrap();
    /// let p = a.alloc(256 << 20, Stream::DEFAULT).unwrap();
    /// assert_eq!(a.set_capacity(300 << 20).unwrap(), 300 << 20);
    /// assert!(a.alloc(128 << 20, Stream::DEFAULT).is_err(), "256 + 128 MiB > 300 MiB");
    /// assert_eq!(a.usable_size(p), Some(256 << 20), "the live allocation is untouched");
    /// # a.free(p, Stream::DEFAULT).unwrap();
    /// ```
    pub fn set_capacity(&self, bytes: u64) -> Result<u64> {
        let mut e = self.engine.lock();
        let r = e.set_capacity(bytes);
        self.check(&e);
        r
    }

    /// Allocate a buffer that frees itself when dropped.
    ///
    /// ```
    /// use stitch_alloc::{Allocator, Config, Stream};
    /// use stitch_alloc::driver::SimDriver;
    /// let a = Allocator::new(SimDriver::with_capacity(64 << 20), Config::default()).unwrap();
    /// {
    ///     let b = a.alloc_buffer(4096, Stream::DEFAULT).unwrap();
    ///     assert_eq!(b.len(), 4096);
    ///     assert_eq!(a.stats().live_allocations.current, 1);
    /// }
    /// assert_eq!(a.stats().live_allocations.current, 0);
    /// ```
    pub fn alloc_buffer(&self, size: u64, stream: Stream) -> Result<Buffer<'_, D>> {
        let ptr = self.alloc(size, stream)?;
        Ok(Buffer {
            alloc: self,
            ptr,
            len: size,
            stream,
        })
    }

    /// Record that the live allocation at `ptr` is also used on `stream` (like PyTorch's
    /// `record_stream`): its free will then wait for that stream too.
    ///
    /// ```
    /// use stitch_alloc::{Allocator, Config, Stream};
    /// use stitch_alloc::driver::SimDriver;
    /// let a = Allocator::new(SimDriver::with_capacity(1 << 30), Config::default()).unwrap();
    /// let p = a.alloc(1 << 20, Stream::DEFAULT).unwrap();
    /// a.record_stream(p, Stream::sim(1)).unwrap(); // also used on stream 1
    /// a.free(p, Stream::DEFAULT).unwrap(); // fenced on both streams
    /// assert_eq!(a.stats().live_allocations.current, 0);
    /// ```
    pub fn record_stream(&self, ptr: DevicePtr, stream: Stream) -> Result<()> {
        self.engine.lock().record_stream(ptr.0, stream)
    }

    /// Call before destroying a stream that was passed to [`Allocator::free`]: waits until
    /// the work queued on it before its frees has completed, so the allocator never records
    /// an event on it later (fences are recorded lazily, on slow paths). Streams that live as
    /// long as the allocator need no call.
    ///
    /// If the stream cannot be fenced (recording or waiting fails), its freed memory is
    /// quarantined (used by nobody until shutdown, since nothing tells when the stream is done
    /// with it), the allocator still never records on the stream again, and the error is
    /// returned. A stream that fails outside `retire_stream` only keeps its own frees dirty:
    /// every other stream goes on.
    ///
    /// ```
    /// use stitch_alloc::{Allocator, Config, Stream};
    /// use stitch_alloc::driver::SimDriver;
    /// let a = Allocator::new(SimDriver::with_capacity(1 << 30), Config::default()).unwrap();
    /// let s = Stream::sim(7);
    /// let p = a.alloc(1 << 20, s).unwrap();
    /// a.free(p, s).unwrap();
    /// a.retire_stream(s).unwrap(); // now the stream may be destroyed
    /// ```
    pub fn retire_stream(&self, stream: Stream) -> Result<()> {
        let mut e = self.engine.lock();
        let r = e.retire_stream(&self.driver, stream);
        self.check(&e);
        r
    }

    /// The usable size of the live allocation at `ptr` (its request rounded to 512 bytes).
    ///
    /// ```
    /// use stitch_alloc::{Allocator, Config, Stream};
    /// use stitch_alloc::driver::SimDriver;
    /// let a = Allocator::new(SimDriver::with_capacity(1 << 30), Config::default()).unwrap();
    /// let p = a.alloc(1000, Stream::DEFAULT).unwrap();
    /// assert_eq!(a.usable_size(p), Some(1024));
    /// a.free(p, Stream::DEFAULT).unwrap();
    /// assert_eq!(a.usable_size(p), None, "no longer live");
    /// ```
    pub fn usable_size(&self, ptr: DevicePtr) -> Option<u64> {
        self.engine.lock().usable_size(ptr.0)
    }

    /// Release every physical handle that holds no live byte back to the driver
    /// (`torch.cuda.empty_cache()`). Returns the bytes released.
    ///
    /// ```
    /// use stitch_alloc::{Allocator, Config, Stream};
    /// use stitch_alloc::driver::SimDriver;
    /// let a = Allocator::new(SimDriver::with_capacity(1 << 30), Config::default()).unwrap();
    /// let p = a.alloc(64 << 20, Stream::DEFAULT).unwrap();
    /// a.free(p, Stream::DEFAULT).unwrap();
    /// let cached = a.stats().reserved.current;
    /// assert!(cached >= 64 << 20, "freed memory stays cached");
    /// assert_eq!(a.empty_cache().unwrap(), cached);
    /// assert_eq!(a.stats().reserved.current, 0);
    /// ```
    pub fn empty_cache(&self) -> Result<u64> {
        let mut e = self.engine.lock();
        let r = e.empty_cache(&self.driver);
        self.check(&e);
        r
    }

    /// The cheap counters.
    ///
    /// ```
    /// use stitch_alloc::{Allocator, Config, Stream};
    /// use stitch_alloc::driver::SimDriver;
    /// let a = Allocator::new(SimDriver::with_capacity(1 << 30), Config::default()).unwrap();
    /// let p = a.alloc(1 << 20, Stream::DEFAULT).unwrap();
    /// let s = a.stats();
    /// assert_eq!((s.allocs, s.requested.current), (1, 1 << 20));
    /// # a.free(p, Stream::DEFAULT).unwrap();
    /// ```
    pub fn stats(&self) -> Stats {
        self.engine.lock().stats
    }

    /// Fragmentation figures, computed by walking the structures (slower).
    ///
    /// ```
    /// use stitch_alloc::{Allocator, Config, Stream};
    /// use stitch_alloc::driver::SimDriver;
    /// let a = Allocator::new(SimDriver::with_capacity(1 << 30), Config::default()).unwrap();
    /// let p = a.alloc(100 << 20, Stream::DEFAULT).unwrap();
    /// let d = a.detailed_stats();
    /// assert_eq!(d.capacity, 1 << 30);
    /// assert_eq!(d.stats.live_allocations.current, 1);
    /// # a.free(p, Stream::DEFAULT).unwrap();
    /// ```
    pub fn detailed_stats(&self) -> DetailedStats {
        self.engine.lock().detailed()
    }

    /// The whole layout (blocks, handles, reservations) for dumps and pictures.
    ///
    /// ```
    /// use stitch_alloc::{Allocator, Config, Stream};
    /// use stitch_alloc::driver::SimDriver;
    /// let a = Allocator::new(SimDriver::with_capacity(1 << 30), Config::default()).unwrap();
    /// let p = a.alloc(8 << 20, Stream::DEFAULT).unwrap();
    /// let layout = a.snapshot();
    /// assert!(!layout.handles.is_empty());
    /// assert_eq!(layout.detailed.stats.live_allocations.current, 1);
    /// # a.free(p, Stream::DEFAULT).unwrap();
    /// ```
    pub fn snapshot(&self) -> Layout {
        self.engine.lock().layout()
    }

    /// The layout as JSON.
    ///
    /// ```
    /// use stitch_alloc::{Allocator, Config, Stream};
    /// use stitch_alloc::driver::SimDriver;
    /// let a = Allocator::new(SimDriver::with_capacity(1 << 30), Config::default()).unwrap();
    /// let p = a.alloc(8 << 20, Stream::DEFAULT).unwrap();
    /// let v: serde_json::Value = serde_json::from_str(&a.snapshot_json()).unwrap();
    /// assert!(v["handles"].as_array().is_some_and(|h| !h.is_empty()));
    /// # a.free(p, Stream::DEFAULT).unwrap();
    /// ```
    pub fn snapshot_json(&self) -> String {
        serde_json::to_string(&self.snapshot()).expect("snapshot serialises")
    }

    /// Check every invariant; `Err` names the first one broken.
    ///
    /// ```
    /// use stitch_alloc::{Allocator, Config, Stream};
    /// use stitch_alloc::driver::SimDriver;
    /// let a = Allocator::new(SimDriver::with_capacity(1 << 30), Config::default()).unwrap();
    /// let p = a.alloc(3 << 20, Stream::DEFAULT).unwrap();
    /// assert_eq!(a.validate(), Ok(()));
    /// a.free(p, Stream::DEFAULT).unwrap();
    /// assert_eq!(a.validate(), Ok(()));
    /// ```
    pub fn validate(&self) -> std::result::Result<(), String> {
        self.engine.lock().validate()
    }

    /// The allocator's physical capacity in bytes.
    ///
    /// ```
    /// use stitch_alloc::{Allocator, Capacity, Config};
    /// use stitch_alloc::driver::SimDriver;
    /// let half = Config::default().with_capacity(Capacity::Fraction(0.5));
    /// let a = Allocator::new(SimDriver::with_capacity(1 << 30), half).unwrap();
    /// assert_eq!(a.capacity(), 512 << 20);
    /// ```
    pub fn capacity(&self) -> u64 {
        self.engine.lock().cfg.capacity
    }

    /// The driver's granularity.
    ///
    /// ```
    /// use stitch_alloc::{Allocator, Config};
    /// use stitch_alloc::driver::SimDriver;
    /// let d = SimDriver::with_config(4 << 20, 1 << 30); // a 4 MiB granularity
    /// let a = Allocator::new(d, Config::default()).unwrap();
    /// assert_eq!(a.granularity(), 4 << 20);
    /// ```
    pub fn granularity(&self) -> u64 {
        self.engine.lock().cfg.granularity
    }

    /// Slots of the stream-owner table (one per stream whose freed memory is not yet usable
    /// by every stream, plus recycled slots): for tests that the table stays bounded.
    #[cfg(feature = "testing")]
    #[doc(hidden)]
    pub fn stream_owner_slots(&self) -> usize {
        self.engine.lock().stream_owner_slots()
    }

    /// The driver.
    ///
    /// ```
    /// use stitch_alloc::{Allocator, Config, Driver, Stream};
    /// use stitch_alloc::driver::SimDriver;
    /// let a = Allocator::new(SimDriver::with_capacity(1 << 30), Config::default()).unwrap();
    /// assert_eq!(a.driver().name(), "sim");
    /// let p = a.alloc(8 << 20, Stream::DEFAULT).unwrap();
    /// assert_eq!(a.driver().used_bytes(), a.stats().reserved.current);
    /// # a.free(p, Stream::DEFAULT).unwrap();
    /// ```
    pub fn driver(&self) -> &D {
        &self.driver
    }

    /// Give all memory back to the driver; later calls fail with [`AllocError::ShutDown`].
    /// Live allocations are reported as leaks (and logged); the work queued on them (on their
    /// streams and the streams `record_stream` added) is waited for before they are unmapped.
    ///
    /// ```
    /// use stitch_alloc::{AllocError, Allocator, Config, Stream};
    /// use stitch_alloc::driver::SimDriver;
    /// let a = Allocator::new(SimDriver::with_capacity(1 << 30), Config::default()).unwrap();
    /// let _leaked = a.alloc(4096, Stream::DEFAULT).unwrap();
    /// let r = a.shutdown();
    /// assert_eq!((r.leaked_allocations, r.leaked_bytes), (1, 4096));
    /// assert!(matches!(a.alloc(4096, Stream::DEFAULT), Err(AllocError::ShutDown)));
    /// ```
    pub fn shutdown(&self) -> ShutdownReport {
        let mut e = self.engine.lock();
        if e.shut_down {
            return ShutdownReport {
                leaked_allocations: 0,
                leaked_bytes: 0,
            };
        }
        let (n, bytes) = e.teardown(&self.driver);
        if n > 0 {
            tracing::warn!(
                allocations = n,
                bytes,
                "allocator shut down with live allocations"
            );
        }
        ShutdownReport {
            leaked_allocations: n,
            leaked_bytes: bytes,
        }
    }
}

/// Shuts down; live allocations are reported as leaks: through `tracing` when a subscriber
/// is installed, else on stderr, so a leak is never silent.
impl<D: Driver> Drop for Allocator<D> {
    fn drop(&mut self) {
        let r = self.shutdown();
        if r.leaked_allocations > 0 && !tracing::dispatcher::has_been_set() {
            eprintln!(
                "stitch-alloc: allocator dropped with {} live allocation(s) of {} in total \
                 (leaked; their memory was given back to the driver)",
                r.leaked_allocations,
                crate::stats::Bytes(r.leaked_bytes)
            );
        }
    }
}

/// An allocation that frees itself on drop (on the stream it was allocated on).
///
/// On CUDA, `ptr().addr()` is the `CUdeviceptr` to hand to kernels and copies (cudarc's
/// `cudarc::driver::result` calls and kernel arguments take it as a `u64`; see
/// `examples/cuda_server.rs`). On the host backend [`Buffer::write`] and [`Buffer::read`]
/// copy bytes in and out.
///
/// ```
/// use stitch_alloc::{Allocator, Config, Stream};
/// use stitch_alloc::driver::HostDriver;
/// let a = Allocator::new(HostDriver::with_capacity(64 << 20).unwrap(), Config::default()).unwrap();
/// {
///     let buf = a.alloc_buffer(4096, Stream::DEFAULT).unwrap();
///     buf.write(0, b"hello").unwrap();
///     let mut out = [0u8; 5];
///     buf.read(0, &mut out).unwrap();
///     assert_eq!(&out, b"hello");
///     assert!(buf.write(4095, b"xy").is_err(), "outside the buffer");
/// } // freed here
/// assert_eq!(a.stats().live_allocations.current, 0);
/// ```
pub struct Buffer<'a, D: Driver> {
    alloc: &'a Allocator<D>,
    ptr: DevicePtr,
    len: u64,
    stream: Stream,
}

impl<D: Driver> fmt::Debug for Buffer<'_, D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Buffer")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .field("stream", &self.stream)
            .finish()
    }
}

impl<D: Driver> Buffer<'_, D> {
    /// The device address.
    ///
    /// ```
    /// use stitch_alloc::{Allocator, Config, Stream};
    /// use stitch_alloc::driver::SimDriver;
    /// let a = Allocator::new(SimDriver::with_capacity(1 << 30), Config::default()).unwrap();
    /// let b = a.alloc_buffer(4096, Stream::DEFAULT).unwrap();
    /// assert_eq!(a.usable_size(b.ptr()), Some(4096));
    /// ```
    pub fn ptr(&self) -> DevicePtr {
        self.ptr
    }
    /// Requested length in bytes.
    ///
    /// ```
    /// use stitch_alloc::{Allocator, Config, Stream};
    /// use stitch_alloc::driver::SimDriver;
    /// let a = Allocator::new(SimDriver::with_capacity(1 << 30), Config::default()).unwrap();
    /// let b = a.alloc_buffer(1000, Stream::DEFAULT).unwrap();
    /// assert_eq!(b.len(), 1000, "the request, not the rounded size");
    /// assert_eq!(a.usable_size(b.ptr()), Some(1024));
    /// ```
    pub fn len(&self) -> u64 {
        self.len
    }
    /// Whether the length is zero (never: zero-size requests are refused).
    ///
    /// ```
    /// use stitch_alloc::{Allocator, Config, Stream};
    /// use stitch_alloc::driver::SimDriver;
    /// let a = Allocator::new(SimDriver::with_capacity(1 << 30), Config::default()).unwrap();
    /// let b = a.alloc_buffer(1, Stream::DEFAULT).unwrap();
    /// assert!(!b.is_empty());
    /// assert!(a.alloc_buffer(0, Stream::DEFAULT).is_err());
    /// ```
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The stream it was allocated on.
    ///
    /// ```
    /// use stitch_alloc::{Allocator, Config, Stream};
    /// use stitch_alloc::driver::SimDriver;
    /// let a = Allocator::new(SimDriver::with_capacity(1 << 30), Config::default()).unwrap();
    /// let b = a.alloc_buffer(4096, Stream::sim(3)).unwrap();
    /// assert_eq!(b.stream(), Stream::sim(3)); // and is freed on it when dropped
    /// ```
    pub fn stream(&self) -> Stream {
        self.stream
    }
    /// Copy bytes in at `offset` (backends with data only).
    ///
    /// ```
    /// use stitch_alloc::{Allocator, Config, Stream};
    /// use stitch_alloc::driver::HostDriver;
    /// let a = Allocator::new(HostDriver::with_capacity(64 << 20).unwrap(), Config::default()).unwrap();
    /// let b = a.alloc_buffer(4096, Stream::DEFAULT).unwrap();
    /// b.write(4090, b"tail!!").unwrap();
    /// let mut out = [0u8; 6];
    /// b.read(4090, &mut out).unwrap();
    /// assert_eq!(&out, b"tail!!");
    /// assert!(b.write(4091, b"tail!!").is_err(), "one byte past the end");
    /// ```
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.bounds(offset, data.len() as u64)?;
        Ok(self.alloc.driver.write(self.ptr.0 + offset, data)?)
    }
    /// Copy bytes out from `offset` (backends with data only).
    ///
    /// ```
    /// use stitch_alloc::{Allocator, Config, Stream};
    /// use stitch_alloc::driver::HostDriver;
    /// let a = Allocator::new(HostDriver::with_capacity(64 << 20).unwrap(), Config::default()).unwrap();
    /// let b = a.alloc_buffer(4096, Stream::DEFAULT).unwrap();
    /// b.write(100, &[7; 8]).unwrap();
    /// let mut out = [0u8; 8];
    /// b.read(100, &mut out).unwrap();
    /// assert_eq!(out, [7; 8]);
    /// assert!(b.read(u64::MAX, &mut out).is_err(), "outside the buffer");
    /// ```
    pub fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.bounds(offset, buf.len() as u64)?;
        Ok(self.alloc.driver.read(self.ptr.0 + offset, buf)?)
    }
    fn bounds(&self, offset: u64, n: u64) -> Result<()> {
        match offset.checked_add(n) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(AllocError::InvalidPointer {
                ptr: self.ptr.0.wrapping_add(offset),
                reason: "access outside the buffer",
            }),
        }
    }
    /// Give up ownership without freeing; free it later with [`Allocator::free`].
    ///
    /// ```
    /// use stitch_alloc::{Allocator, Config, Stream};
    /// use stitch_alloc::driver::SimDriver;
    /// let a = Allocator::new(SimDriver::with_capacity(1 << 30), Config::default()).unwrap();
    /// let p = a.alloc_buffer(4096, Stream::DEFAULT).unwrap().into_raw();
    /// assert_eq!(a.stats().live_allocations.current, 1, "not freed on drop");
    /// a.free(p, Stream::DEFAULT).unwrap();
    /// assert_eq!(a.stats().live_allocations.current, 0);
    /// ```
    pub fn into_raw(self) -> DevicePtr {
        let p = self.ptr;
        std::mem::forget(self);
        p
    }
}

impl<D: Driver> Drop for Buffer<'_, D> {
    fn drop(&mut self) {
        if let Err(e) = self.alloc.free(self.ptr, self.stream) {
            tracing::error!(%e, ptr = %self.ptr, "freeing a Buffer failed");
        }
    }
}
