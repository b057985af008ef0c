//! The crate's one error type.
#![forbid(unsafe_code)]

use crate::driver::{DriverError, DriverOp};
use crate::stats::Bytes;
use serde::Serialize;
use std::fmt;

/// Why an allocation failed for lack of memory: enough to tell external fragmentation
/// (which this allocator rules out) from a real shortage.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct OomReport {
    /// Bytes the caller asked for.
    pub requested: u64,
    /// The request rounded to what it would occupy.
    pub rounded: u64,
    /// The allocator's physical capacity.
    pub capacity: u64,
    /// Physical bytes held in handles (reserved).
    pub reserved: u64,
    /// Bytes handed out and not freed (requested sizes).
    pub live: u64,
    /// Total size of the handles that hold at least one live byte.
    pub live_handle_bytes: u64,
    /// Free bytes inside handles that hold live bytes: unusable for a large request.
    pub stranded: u64,
    /// The largest free span of already mapped memory.
    pub largest_free_span: u64,
    /// Whether the driver itself ran out (another process may hold device memory).
    pub driver_out_of_memory: bool,
}

impl fmt::Display for OomReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "tried to allocate {} ({} bytes, {} rounded); capacity {}, {} reserved, {} live in \
             handles totalling {}, {} free but stranded in partly used handles, largest free \
             span {}",
            Bytes(self.requested),
            self.requested,
            Bytes(self.rounded),
            Bytes(self.capacity),
            Bytes(self.reserved),
            Bytes(self.live),
            Bytes(self.live_handle_bytes),
            Bytes(self.stranded),
            Bytes(self.largest_free_span),
        )?;
        if self.driver_out_of_memory {
            write!(f, "; the driver refused to create more memory")?;
        }
        Ok(())
    }
}

/// Everything that can go wrong, as a value.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AllocError {
    /// Not enough physical memory for the request (with a diagnosis).
    #[error("out of memory: {0}")]
    OutOfMemory(Box<OomReport>),
    /// The pointer was never returned by this allocator, or points inside a live allocation.
    #[error("invalid pointer {ptr:#x}: {reason}")]
    InvalidPointer {
        /// The pointer passed in.
        ptr: u64,
        /// Why it is not valid.
        reason: &'static str,
    },
    /// The pointer lies in memory that is already free.
    #[error("double free of {ptr:#x}")]
    DoubleFree {
        /// The pointer passed in.
        ptr: u64,
    },
    /// A request for zero bytes.
    #[error("zero-size allocation")]
    ZeroSize,
    /// A request larger than the allocator could ever hold.
    #[error("request of {requested} bytes exceeds the limit of {limit} bytes")]
    TooLarge {
        /// Bytes asked for.
        requested: u64,
        /// The largest request that could ever succeed.
        limit: u64,
    },
    /// A driver call failed; the allocator is still consistent.
    #[error("driver call {op} failed (code {code}): {message}")]
    Driver {
        /// The call.
        op: DriverOp,
        /// The driver's code.
        code: i64,
        /// The driver's message.
        message: String,
    },
    /// The configuration is invalid.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The allocator was shut down.
    #[error("the allocator has been shut down")]
    ShutDown,
}

impl From<DriverError> for AllocError {
    fn from(e: DriverError) -> Self {
        AllocError::Driver {
            op: e.op,
            code: e.code,
            message: e.message,
        }
    }
}

/// `Result` with [`AllocError`].
pub type Result<T, E = AllocError> = std::result::Result<T, E>;
