//! Exporting a live allocation's physical handles so that another process can map them
//! (CUDA IPC; the wire format and the receiving side are in [`crate::ipc`]).
//!
//! A live block lies in one or more mapped handles, side by side. Each of them is exported
//! once ([`Driver::export`]): its descriptor is kept in the handle's record until the handle
//! is released, so that sharing the same block again gives the same descriptors (torch's
//! receivers cache by the handle bytes) and a receiver can still fetch them from this
//! process while the block lives. Exporting touches no mapping and moves nothing; the live
//! block keeps its handles mapped (live allocations never move), so the receiver's view
//! stays the sender's memory for as long as the receiver keeps it open, even after the
//! sender releases the handle (the driver counts the import as a reference).
#![forbid(unsafe_code)]

use super::Engine;
use crate::driver::{Driver, DriverOp};
use crate::error::{AllocError, Result};
use std::os::fd::AsRawFd;

/// The handles behind one live block, as exported.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Exported {
    /// Where the block starts in the first handle.
    pub(crate) offset: u64,
    /// Each handle's descriptor (this process's, open while the handle is owned) and size,
    /// in address order.
    pub(crate) pieces: Vec<(i32, u64)>,
}

impl Engine {
    /// Export the handles behind the live block that starts at `ptr`.
    pub(crate) fn share<D: Driver + ?Sized>(&mut self, d: &D, ptr: u64) -> Result<Exported> {
        let Some(&i) = self.arena.live.get(&ptr) else {
            return Err(AllocError::InvalidPointer {
                ptr,
                reason: "not the start of a live allocation of this allocator",
            });
        };
        let end = ptr + self.arena.blocks[i as usize].size;
        let Some((first, _)) = self.handles.containing(ptr) else {
            return Err(AllocError::InvalidPointer {
                ptr,
                reason: "live allocation without a mapped handle (broken invariant)",
            });
        };
        let ids: Vec<(u64, u32)> = self
            .handles
            .mapped
            .range(first..end)
            .map(|(&a, &id)| (a, id))
            .collect();
        let mut at = first;
        let mut pieces = Vec::with_capacity(ids.len());
        for (a, id) in ids {
            let size = self.handles.size(id);
            if a != at {
                return Err(AllocError::InvalidPointer {
                    ptr,
                    reason: "live allocation over a gap in its handles (broken invariant)",
                });
            }
            if self.handles.record(id).exported.is_none() {
                let h = self.handles.record(id).handle;
                let fd = self.driver_call(DriverOp::Share, || d.export(h))?;
                self.handles.record_mut(id).exported = Some(fd);
                self.stats.handles_exported += 1;
            }
            let fd = self.handles.record(id).exported.as_ref().expect("just set");
            pieces.push((fd.as_raw_fd(), size));
            at = a + size;
        }
        if at < end {
            return Err(AllocError::InvalidPointer {
                ptr,
                reason: "live allocation past its handles (broken invariant)",
            });
        }
        Ok(Exported {
            offset: ptr - first,
            pieces,
        })
    }
}

#[cfg(test)]
mod tests {
    use crate::driver::{HostDriver, SimDriver};
    use crate::ipc::Message;
    use crate::{Allocator, Config, DevicePtr, Stream};
    use std::sync::Arc;

    const MIB: u64 = 1 << 20;

    #[test]
    fn a_block_is_exported_once_per_handle_and_descriptors_close_with_the_handle() {
        let host = Arc::new(HostDriver::with_capacity(256 * MIB).unwrap());
        let cfg = Config::default()
            .with_handle_sizes(2 * MIB, 4 * MIB)
            .with_paranoid(true);
        let a = Allocator::new(host.clone(), cfg).unwrap();
        let p = a.alloc(10 * MIB, Stream::DEFAULT).unwrap();
        let s1 = a.share(p).unwrap();
        assert_eq!(s1, a.share(p).unwrap(), "the same descriptors each time");
        let m = Message::decode(&s1.handle).unwrap();
        assert!(
            m.pieces.len() >= 3,
            "10 MiB over handles of at most 4 MiB: {m:?}"
        );
        let covered: u64 = m.pieces.iter().map(|p| p.1).sum();
        assert!(covered >= s1.offset + 10 * MIB);
        assert_eq!(a.stats().handles_exported, m.pieces.len() as u64);
        // Each exported descriptor's file (a memfd: device and inode), to tell it from a
        // later descriptor of the same number (tests in this process open memfds too).
        let file_of = |fd: i32| {
            use std::os::unix::fs::MetadataExt;
            std::fs::metadata(format!("/proc/self/fd/{fd}"))
                .ok()
                .map(|m| (m.dev(), m.ino()))
        };
        let files: Vec<_> = m.pieces.iter().map(|&(fd, _)| file_of(fd)).collect();
        assert!(
            files.iter().all(Option::is_some),
            "every descriptor is open"
        );
        // Not a block start: refused, nothing changes.
        assert!(a.share(DevicePtr(p.addr() + 4096)).is_err());
        a.free(p, Stream::DEFAULT).unwrap();
        a.empty_cache().unwrap();
        for (&(fd, _), f) in m.pieces.iter().zip(&files) {
            assert_ne!(
                file_of(fd),
                *f,
                "descriptor {fd} was closed with its handle"
            );
        }
        drop(a);
        assert!(host.leak_report().is_clean());
    }

    #[test]
    fn a_backend_that_cannot_export_gives_a_clear_error_and_stays_consistent() {
        let a = Allocator::new(
            SimDriver::with_capacity(1 << 30),
            Config::default().with_paranoid(true),
        )
        .unwrap();
        let p = a.alloc(8 * MIB, Stream::DEFAULT).unwrap();
        let e = a.share(p).unwrap_err().to_string();
        assert!(e.contains("cannot export"), "{e}");
        a.validate().unwrap();
        a.free(p, Stream::DEFAULT).unwrap();
        assert_eq!(a.stats().handles_exported, 0);
    }
}
