//! # stitch-alloc
//!
//! A GPU memory allocator that ends external fragmentation. It reserves a large virtual
//! address range and backs it with physical handles (CUDA virtual memory management). When a
//! request fits no free span, whole free handles are unmapped from wherever they sit and
//! mapped side by side into one new contiguous span ("stitching"), so a request succeeds
//! whenever enough free physical memory exists, anywhere. Live allocations never move.
//!
//! ## In a Rust server
//!
//! One [`Allocator`] per device, shared by the request handlers (it is `Send + Sync`); each
//! request allocates on its own CUDA stream and frees on the stream of last use. The example
//! runs anywhere: it takes the GPU when there is one ([`AnyDriver::auto`]: CUDA or an error
//! saying why) and the simulator only because it asks for it by name.
//!
//! ```
//! use std::sync::Arc;
//! use stitch_alloc::{AllocError, Allocator, AnyDriver, Backend, Capacity, Config, Stream};
//!
//! let driver = AnyDriver::auto().or_else(|no_gpu| {
//!     eprintln!("{no_gpu}");
//!     AnyDriver::open(Backend::Sim) // named: accounting only, pointers not dereferenceable
//! })?;
//! let alloc = Arc::new(Allocator::new(driver, Config::default().with_capacity(Capacity::Fraction(0.9)))?);
//!
//! // Four handlers, each with its own stream (on CUDA: `unsafe { Stream::from_raw(cu_stream) }`).
//! let handlers: Vec<_> = (1..=4u64)
//!     .map(|h| {
//!         let alloc = Arc::clone(&alloc);
//!         std::thread::spawn(move || -> Result<(), AllocError> {
//!             let stream = Stream::sim(h);
//!             for step in 0..50u64 {
//!                 // Freed on drop, on the stream it was allocated on.
//!                 let kv_cache = alloc.alloc_buffer((64 + 8 * step) << 20, stream)?;
//!                 let scratch = alloc.alloc_buffer(3 << 20, stream)?;
//!                 let _ = (kv_cache.ptr(), scratch.ptr()); // hand these to your kernels
//!             }
//!             Ok(())
//!         })
//!     })
//!     .collect();
//! for h in handlers {
//!     h.join().unwrap()?;
//! }
//! let s = alloc.stats();
//! assert_eq!(s.live_allocations.current, 0);
//! println!("{s}"); // a table like torch.cuda.memory_summary()
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! `examples/cuda_server.rs` (in the source tree) does the same on a real GPU with cudarc:
//! two CUDA streams, asynchronous copies and a kernel on stitch-alloc buffers; a buffer's
//! `ptr().addr()` is the `CUdeviceptr` to pass to kernels and copies.
//!
//! ## Features
//!
//! By default the crate is the allocator and its backends ([`driver`]). Feature `cli`
//! adds the `stitch` program and the modules it wraps (`trace`: allocation traces and PyTorch
//! snapshots, `replay`: replay with a model of the driver's time, `plot`: SVG pictures);
//! feature `capi` the C ABI that `libstitch_alloc.so` exports for PyTorch.
//!
//! Layers: [`driver`] (the `Driver` trait and its backends: the only code that touches the
//! OS or the GPU; [`AnyDriver`] picks one at run time under the rule on [`Backend`]), the
//! engine (pure data structures and algorithms), and [`Allocator`] (a lock around the
//! engine). See `design/ARCHITECTURE.md` in the source tree.
#![deny(missing_docs)]
#![deny(clippy::undocumented_unsafe_blocks)]

mod allocator;
mod backend;
#[cfg(feature = "capi")]
#[doc(hidden)]
pub mod capi;
// The `STITCH_ALLOC_CONF` reader in config.rs is used by the C ABI only.
#[cfg_attr(not(feature = "capi"), allow(dead_code))]
mod config;
pub mod cost;
pub mod driver;
mod engine;
mod error;
pub mod ipc;
#[cfg(feature = "cli")]
pub mod plot;
#[cfg(feature = "cli")]
pub mod replay;
pub mod stats;
#[cfg(feature = "testing")]
#[doc(hidden)]
pub mod testing;
#[cfg(feature = "cli")]
pub mod trace;

pub use allocator::{Allocator, Buffer, DevicePtr, ShutdownReport};
pub use backend::{AnyDriver, Backend, BackendError};
pub use config::{parse_size, Capacity, Config, MAX_BYTES, MAX_RESERVE_SLACK};
pub use driver::{CudaDriver, Driver, Stream};
pub use engine::{BlockView, HandleView, Layout, Pool, StrandedHandle};
pub use error::{AllocError, OomReport, Result};
pub use stats::{Bytes, DetailedStats, Stats};

/// The README's Rust example, compiled and run as a doc test.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
