//! Sharing live allocations between processes: CUDA IPC for `torch.multiprocessing`.
//!
//! Memory from `cuMemCreate` cannot be shared with `cudaIpcGetMemHandle`; its handles are
//! exported instead as POSIX file descriptors ([`Driver::export`]), which the receiver
//! fetches from the sender with `pidfd_getfd(2)` (Linux 5.6; the receiver needs the same
//! right over the sender as a debugger: same user, no stricter ptrace policy), imports
//! ([`Driver::import`]) and maps side by side in address space of its own. PyTorch's
//! expandable segments share the same way.
//!
//! * **Sender** ([`crate::Allocator::share`]): the handles behind a live block are exported
//!   once each and their descriptors kept until the handle is released (so the same block
//!   always gives the same bytes, and a receiver can fetch them while the block lives); the
//!   result is a [`SharedBlock`]: the wire bytes and the block's offset in the mapped range.
//!   The sender must keep the block alive until every receiver is done with it (torch's
//!   reference counting does this).
//! * **Receiver** ([`open`]): one mapping of every handle of the message, with read-write
//!   access for the receiving driver's devices; [`Opened::close`] undoes it. The receiver's
//!   allocator does not count it: the memory is the sender's.
//!
//! The wire format, little-endian: `[2, b'S']` (torch's handle-version byte and a type byte
//! that no torch allocator uses, so PyTorch's own allocator refuses such a handle instead of
//! misreading it), the magic `b"stitchA1"`, the sender's pid (u32), the number of handles
//! (u32), then per handle its descriptor in the sender (i32) and its size (u64). Never 64
//! bytes long, the length of a legacy `cudaIpcMemHandle_t`.
//!
//! ```
//! use std::sync::Arc;
//! use stitch_alloc::driver::HostDriver;
//! use stitch_alloc::{ipc, Allocator, Config, Stream};
//! let host = Arc::new(HostDriver::with_capacity(64 << 20).unwrap());
//! let a = Allocator::new(host.clone(), Config::default()).unwrap();
//! let p = a.alloc(4 << 20, Stream::DEFAULT).unwrap();
//! host.write(p.addr(), b"shared bytes").unwrap();
//! let shared = a.share(p).unwrap();
//! // The receiver (here the same process, through a second mapping).
//! let rx = HostDriver::with_capacity(64 << 20).unwrap();
//! let view = ipc::open(&rx, &shared.handle).unwrap();
//! let mut buf = [0u8; 12];
//! rx.read(view.ptr() + shared.offset, &mut buf).unwrap();
//! assert_eq!(&buf, b"shared bytes");
//! view.close(&rx).unwrap();
//! a.free(p, Stream::DEFAULT).unwrap();
//! # use stitch_alloc::driver::Driver;
//! ```
#![forbid(unsafe_code)]

use crate::driver::{code, DevAddr, Driver, DriverError, DriverOp, PhysHandle};
use crate::error::{AllocError, Result};
use rustix::process::{pidfd_getfd, pidfd_open, Pid, PidfdFlags, PidfdGetfdFlags};
use std::os::fd::AsFd;

/// The first bytes of every message: torch's handle version byte and our type byte.
const PREFIX: [u8; 2] = [2, b'S'];
/// The magic after the prefix (format 1).
const MAGIC: &[u8; 8] = b"stitchA1";
/// Prefix, magic, pid and count.
const HEADER: usize = 2 + 8 + 4 + 4;
/// Descriptor and size.
const PIECE: usize = 4 + 8;
/// At most this many handles in one message (a 1 TiB block of 2 MiB handles; a message is
/// under 7 MB).
pub const MAX_PIECES: usize = 1 << 19;

/// A live block made shareable ([`crate::Allocator::share`]): what torch's
/// `ShareableHandle` carries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SharedBlock {
    /// The message for the receiver ([`open`]).
    pub handle: Vec<u8>,
    /// Where the block starts in the range the receiver maps.
    pub offset: u64,
}

/// What a message says: who sent it and the handles, in address order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    /// The sender's process id.
    pub pid: u32,
    /// Each handle's descriptor in the sender and its size in bytes.
    pub pieces: Vec<(i32, u64)>,
}

impl Message {
    /// The wire bytes (see the module docs).
    ///
    /// ```
    /// use stitch_alloc::ipc::Message;
    /// let m = Message { pid: 7, pieces: vec![(3, 2 << 20), (4, 4 << 20)] };
    /// assert_eq!(Message::decode(&m.encode()).unwrap(), m);
    /// ```
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(HEADER + PIECE * self.pieces.len());
        b.extend_from_slice(&PREFIX);
        b.extend_from_slice(MAGIC);
        b.extend_from_slice(&self.pid.to_le_bytes());
        b.extend_from_slice(&(self.pieces.len() as u32).to_le_bytes());
        for &(fd, size) in &self.pieces {
            b.extend_from_slice(&fd.to_le_bytes());
            b.extend_from_slice(&size.to_le_bytes());
        }
        b
    }

    /// Read wire bytes; anything malformed is an error naming what is wrong.
    ///
    /// ```
    /// use stitch_alloc::ipc::Message;
    /// let legacy = [0u8; 64]; // a cudaIpcMemHandle_t from PyTorch's own allocator
    /// assert!(Message::decode(&legacy).unwrap_err().to_string().contains("not a stitch-alloc"));
    /// ```
    pub fn decode(b: &[u8]) -> Result<Message> {
        let bad = |why: String| AllocError::Config(format!("IPC handle: {why}"));
        if b.len() < HEADER || b[..2] != PREFIX || &b[2..10] != MAGIC {
            return Err(bad(format!(
                "not a stitch-alloc handle ({} bytes; PyTorch's own allocator's handles are \
                 opened by it, not by stitch-alloc)",
                b.len()
            )));
        }
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let pid = u32_at(10);
        let n = u32_at(14) as usize;
        if n == 0 || n > MAX_PIECES {
            return Err(bad(format!("{n} handles (1 to {MAX_PIECES} expected)")));
        }
        if b.len() != HEADER + n * PIECE {
            return Err(bad(format!(
                "{} bytes for {n} handles ({} expected)",
                b.len(),
                HEADER + n * PIECE
            )));
        }
        let mut pieces = Vec::with_capacity(n);
        let mut total: u64 = 0;
        for k in 0..n {
            let i = HEADER + k * PIECE;
            let fd = i32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
            let size = u64::from_le_bytes(b[i + 4..i + 12].try_into().expect("8 bytes"));
            if fd < 0 || size == 0 {
                return Err(bad(format!("handle {k}: descriptor {fd}, {size} bytes")));
            }
            total = total
                .checked_add(size)
                .filter(|&t| t <= 1 << 50)
                .ok_or_else(|| bad("handles add up to more than 1 PiB".into()))?;
            pieces.push((fd, size));
        }
        if pid == 0 || pid > i32::MAX as u32 {
            return Err(bad(format!("sender pid {pid}")));
        }
        Ok(Message { pid, pieces })
    }
}

/// Another process's memory mapped in this one ([`open`]); give it back with
/// [`Opened::close`] on the driver that opened it.
#[derive(Debug)]
#[must_use = "an opened mapping holds address space and handles until it is closed"]
pub struct Opened {
    base: DevAddr,
    size: u64,
    /// The imported handles, in address order, with their sizes.
    handles: Vec<(PhysHandle, u64)>,
    closed: bool,
}

fn share_error(message: String) -> AllocError {
    AllocError::Driver {
        op: DriverOp::Share,
        code: code::NOT_SUPPORTED,
        message,
    }
}

/// Map the memory a [`SharedBlock::handle`] describes: fetch each descriptor from the
/// sender, import it on `d`, map the handles side by side in a fresh reservation and grant
/// access. Nothing is left behind on failure.
pub fn open<D: Driver + ?Sized>(d: &D, handle: &[u8]) -> Result<Opened> {
    let m = Message::decode(handle)?;
    let pid =
        Pid::from_raw(m.pid as i32).ok_or_else(|| share_error(format!("sender pid {}", m.pid)))?;
    let pidfd = pidfd_open(pid, PidfdFlags::empty()).map_err(|e| {
        share_error(format!(
            "cannot reach the sending process {} (pidfd_open: {e}); it must be alive and on \
             this host",
            m.pid
        ))
    })?;
    let total: u64 = m.pieces.iter().map(|p| p.1).sum();
    let mut opened = Opened {
        base: 0,
        size: total,
        handles: Vec::with_capacity(m.pieces.len()),
        closed: false,
    };
    // Handles mapped so far, from `base` on: what a failure unmaps.
    let mut mapped = 0;
    let r = (|| -> Result<()> {
        for &(fd, size) in &m.pieces {
            let local = pidfd_getfd(&pidfd, fd, PidfdGetfdFlags::empty()).map_err(|e| {
                share_error(format!(
                    "cannot take descriptor {fd} of process {} (pidfd_getfd: {e}); the \
                     receiver needs ptrace rights over the sender (same user; \
                     kernel.yama.ptrace_scope at most 1 for a child, 0 otherwise)",
                    m.pid
                ))
            })?;
            let h = d.import(local.as_fd(), size)?;
            opened.handles.push((h, size));
        }
        opened.base = d.reserve(total)?;
        let mut at = opened.base;
        for &(h, size) in &opened.handles {
            d.map(at, size, h)?;
            mapped += 1;
            at += size;
        }
        d.set_access(opened.base, total)?;
        Ok(())
    })();
    match r {
        Ok(()) => Ok(opened),
        Err(e) => {
            let _ = opened.undo(d, mapped);
            Err(e)
        }
    }
}

impl Opened {
    /// The address of the first handle's first byte; the shared block is at
    /// `ptr() + SharedBlock::offset`.
    pub fn ptr(&self) -> DevAddr {
        self.base
    }

    /// Bytes mapped (the sum of the handles' sizes).
    pub fn len(&self) -> u64 {
        self.size
    }

    /// Whether nothing is mapped (never, for an opened mapping).
    pub fn is_empty(&self) -> bool {
        self.size == 0
    }

    /// Unmap, release the imported handles and free the address space, on the driver that
    /// opened it. The caller makes sure no queued work still uses the memory. Every step is
    /// tried; the first error is returned.
    pub fn close<D: Driver + ?Sized>(mut self, d: &D) -> std::result::Result<(), DriverError> {
        let n = self.handles.len();
        self.undo(d, n).map_or(Ok(()), Err)
    }

    /// Unmap the first `mapped` handles, release every imported one, free the address
    /// space (when reserved); every step is tried, the first error returned. Marks the
    /// mapping closed.
    fn undo<D: Driver + ?Sized>(&mut self, d: &D, mapped: usize) -> Option<DriverError> {
        self.closed = true;
        let mut first: Option<DriverError> = None;
        let mut keep = |r: std::result::Result<(), DriverError>| {
            if let Err(e) = r {
                first.get_or_insert(e);
            }
        };
        let mut at = self.base;
        for &(_, size) in &self.handles[..mapped] {
            keep(d.unmap(at, size));
            at += size;
        }
        for &(h, _) in &self.handles {
            keep(d.release(h));
        }
        if self.base != 0 {
            keep(d.free_reservation(self.base, self.size));
        }
        first
    }
}

impl Drop for Opened {
    fn drop(&mut self) {
        if !self.closed {
            tracing::error!(
                base = self.base,
                size = self.size,
                "an IPC mapping was dropped without close(): its handles and address space stay held"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn garbage_and_hostile_messages_are_refused_without_panicking() {
        let good = Message {
            pid: std::process::id(),
            pieces: vec![(5, 2 << 20)],
        }
        .encode();
        assert_ne!(good.len(), 64);
        for n in 0..good.len() {
            assert!(Message::decode(&good[..n]).is_err(), "truncated at {n}");
        }
        let mut b = good.clone();
        b[14..18].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(Message::decode(&b).is_err(), "absurd count");
        let huge = Message {
            pid: 1,
            pieces: vec![(3, u64::MAX / 2), (4, u64::MAX / 2)],
        };
        assert!(
            Message::decode(&huge.encode()).is_err(),
            "overflowing sizes"
        );
        let neg = Message {
            pid: 1,
            pieces: vec![(-1, 2 << 20)],
        };
        assert!(
            Message::decode(&neg.encode()).is_err(),
            "negative descriptor"
        );
    }

    proptest::proptest! {
        /// Any bytes: an error or a message that encodes back to them (the `ipc_message`
        /// fuzz target does the same at length).
        #[test]
        fn any_bytes_decode_to_an_error_or_their_own_message(
            v in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..200)
        ) {
            if let Ok(m) = Message::decode(&v) {
                proptest::prop_assert_eq!(m.encode(), v);
            }
        }
    }

    #[test]
    fn a_dead_or_foreign_sender_is_a_clear_error_and_leaks_nothing() {
        let rx = crate::driver::HostDriver::with_capacity(64 << 20).unwrap();
        // A pid that cannot exist (beyond pid_max).
        let m = Message {
            pid: (1 << 22) + 12345,
            pieces: vec![(3, 2 << 20)],
        };
        let e = open(&rx, &m.encode()).unwrap_err().to_string();
        assert!(e.contains("cannot reach the sending process"), "{e}");
        // Our own pid but a descriptor we do not have.
        let m = Message {
            pid: std::process::id(),
            pieces: vec![(1 << 20, 2 << 20)],
        };
        let e = open(&rx, &m.encode()).unwrap_err().to_string();
        assert!(e.contains("cannot take descriptor"), "{e}");
        assert!(rx.leak_report().is_clean());
    }
}
