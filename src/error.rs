//! The crate's one error type.
#![forbid(unsafe_code)]

use crate::driver::{DriverError, DriverOp};
use crate::stats::Bytes;
use serde::Serialize;
use std::fmt;

/// Why an allocation failed for lack of memory: enough to tell external fragmentation
/// (which this allocator rules out) from a real shortage.
///
/// ```
/// use stitch_alloc::{AllocError, Allocator, Config, Stream};
/// use stitch_alloc::driver::SimDriver;
/// let a = Allocator::new(SimDriver::with_capacity(64 << 20), Config::default()).unwrap();
/// let held = a.alloc(40 << 20, Stream::DEFAULT).unwrap();
/// let Err(AllocError::OutOfMemory(r)) = a.alloc(40 << 20, Stream::DEFAULT) else {
///     panic!("expected out of memory");
/// };
/// assert_eq!((r.requested, r.capacity, r.live), (40 << 20, 64 << 20, 40 << 20));
/// assert!(!r.driver_out_of_memory, "the allocator's own limit, not the driver's");
/// # a.free(held, Stream::DEFAULT).unwrap();
/// ```
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
///
/// ```
/// use stitch_alloc::{AllocError, Allocator, Config, Stream};
/// use stitch_alloc::driver::SimDriver;
/// let a = Allocator::new(SimDriver::with_capacity(1 << 30), Config::default()).unwrap();
/// let held = a.alloc(600 << 20, Stream::DEFAULT).unwrap();
/// match a.alloc(600 << 20, Stream::DEFAULT) {
///     Err(AllocError::OutOfMemory(why)) => {
///         // The diagnosis tells a real shortage from fragmentation.
///         assert_eq!(why.requested, 600 << 20);
///         assert!(why.to_string().contains("tried to allocate 600.0 MiB"), "{why}");
///         assert_eq!(why.live, 600 << 20);
///     }
///     other => panic!("expected out of memory, got {other:?}"),
/// }
/// assert!(matches!(a.alloc(0, Stream::DEFAULT), Err(AllocError::ZeroSize)));
/// a.free(held, Stream::DEFAULT).unwrap();
/// ```
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Sizes in the unit that suits them: a 4 KiB request is not "0.000 GiB".
    #[test]
    fn oom_message_uses_human_units() {
        let r = OomReport {
            requested: 4096,
            rounded: 2 << 20,
            capacity: 80 << 30,
            reserved: 3 << 29,
            live: 512,
            live_handle_bytes: 2 << 20,
            stranded: 0,
            largest_free_span: 0,
            driver_out_of_memory: false,
        };
        let m = r.to_string();
        for want in [
            "tried to allocate 4.0 KiB (4096 bytes, 2.0 MiB rounded)",
            "capacity 80.000 GiB",
            "1.500 GiB reserved",
            "512 B live",
            "largest free span 0 B",
        ] {
            assert!(m.contains(want), "{want:?} in {m}");
        }
        assert!(!m.contains(" 0.000 GiB"), "{m}");
    }
}
