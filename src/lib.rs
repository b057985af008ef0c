//! # stitch-alloc
//!
//! A GPU memory allocator that ends external fragmentation. It reserves a large virtual
//! address range and backs it with physical handles (CUDA virtual memory management). When a
//! request fits no free span, whole free handles are unmapped from wherever they sit and
//! mapped side by side into one new contiguous span ("stitching"), so a request succeeds
//! whenever enough free physical memory exists, anywhere. Live allocations never move.
//!
//! ```
//! use stitch_alloc::{Allocator, Config, Stream};
//! use stitch_alloc::driver::SimDriver;
//!
//! // A simulated 1 GiB device.
//! let a = Allocator::new(SimDriver::with_capacity(1 << 30), Config::default()).unwrap();
//! // Fill it with 100 MiB tensors, then free every other one: 500 MiB free, in holes.
//! let ptrs: Vec<_> = (0..10).map(|_| a.alloc(100 << 20, Stream::DEFAULT).unwrap()).collect();
//! for p in ptrs.iter().step_by(2) {
//!     a.free(*p, Stream::DEFAULT).unwrap();
//! }
//! // A 500 MiB tensor still fits: the free handles are stitched into one span.
//! let big = a.alloc(500 << 20, Stream::DEFAULT).unwrap();
//! assert!(a.stats().stitches >= 1);
//! # let _ = big;
//! ```
//!
//! Traces and reports: [`trace`] reads, writes and generates allocation traces (including
//! PyTorch memory snapshots), [`replay`] runs them through an allocator and models the GPU
//! driver time, [`plot`] draws the results as SVG. The `stitch` program wraps them.
//!
//! Layers: [`driver`] (the `Driver` trait and its backends: the only code that touches the
//! OS or the GPU; [`AnyDriver`] picks one at run time), the engine (pure data structures and
//! algorithms), and [`Allocator`] (a lock around the engine). See `design/ARCHITECTURE.md`.
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
pub use stats::{DetailedStats, Stats};

/// The README's Rust example, compiled and run as a doc test.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
