//! CUDA IPC through the C ABI (issue #12 item 6): `stitch_share` on the sender,
//! `stitch_ipc_open` / `stitch_ipc_close` on the receiver ([`crate::ipc`] does the work).
//!
//! The receiver's mappings are kept here, one per (device, message): opening the same
//! message again on the same device returns the same pointer and counts one more user (a
//! torch receiver builds one storage per tensor of a shared block, and PyTorch's own
//! allocator caches the same way); the mapping is closed when its last user closes it.
//! They are made on the device's bare driver, outside its allocator (not counted, no
//! segment events): the memory is the sender's.
#![forbid(unsafe_code)]

use super::guard::describe;
use super::runtime::Runtime;
use crate::driver::Forward;
use crate::ipc::{self, Opened};
use crate::DevicePtr;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::ffi::c_int;

/// A receiver mapping's key: the device and the message it was opened from.
type Key = (c_int, Vec<u8>);

/// One receiver mapping.
struct Entry {
    /// Its key in `by_message`.
    key: Key,
    opened: Opened,
    users: u64,
}

#[derive(Default)]
struct Table {
    /// Mapping base -> its entry.
    by_ptr: HashMap<u64, Entry>,
    /// (device, message) -> mapping base.
    by_message: HashMap<Key, u64>,
}

static TABLE: Mutex<Option<Table>> = Mutex::new(None);

/// `stitch_share`: the message and offset of the live allocation at `addr`, on whichever
/// device holds it.
pub(super) fn share(rt: &Runtime, addr: u64) -> Result<(Vec<u8>, u64), String> {
    let Some(device) = rt.owner_of(addr) else {
        return Err(format!(
            "{addr:#x} is not the start of a live allocation of this library"
        ));
    };
    let device = c_int::try_from(device).map_err(|e| e.to_string())?;
    rt.with_alloc("stitch_share", device, |a, _| {
        a.share(DevicePtr(addr))
            .map(|s| (s.handle, s.offset))
            .map_err(|e| {
                format!(
                    "{}; CUDA IPC needs handles exportable as POSIX file descriptors",
                    describe(&e)
                )
            })
    })?
}

/// `stitch_ipc_open`: map (or find mapped) the memory `message` describes on `device`.
pub(super) fn open(rt: &Runtime, device: c_int, message: &[u8]) -> Result<u64, String> {
    let key = (device, message.to_vec());
    let mut t = TABLE.lock();
    let t = t.get_or_insert_with(Table::default);
    if let Some(&base) = t.by_message.get(&key) {
        t.by_ptr.get_mut(&base).expect("both maps agree").users += 1;
        return Ok(base);
    }
    let opened = rt.with_alloc("stitch_ipc_open", device, |a, _| {
        let bare = a.driver().inner().inner();
        ipc::open(bare, message).map_err(|e| describe(&e))
    })??;
    let base = opened.ptr();
    t.by_message.insert(key.clone(), base);
    t.by_ptr.insert(
        base,
        Entry {
            key,
            opened,
            users: 1,
        },
    );
    Ok(base)
}

/// `stitch_ipc_close`: one user of the mapping at `addr` is done; the last one unmaps it.
/// The caller has made sure no queued work still uses it.
pub(super) fn close(rt: &Runtime, addr: u64) -> Result<(), String> {
    let mut t = TABLE.lock();
    let t = t.get_or_insert_with(Table::default);
    let Some(e) = t.by_ptr.get_mut(&addr) else {
        return Err(format!(
            "{addr:#x} is not a mapping made by stitch_ipc_open (or it was closed already)"
        ));
    };
    e.users -= 1;
    if e.users > 0 {
        return Ok(());
    }
    let e = t.by_ptr.remove(&addr).expect("just found");
    t.by_message.remove(&e.key);
    let opened = e.opened;
    rt.with_alloc("stitch_ipc_close", e.key.0, move |a, _| {
        opened
            .close(a.driver().inner().inner())
            .map_err(|e| format!("closing an IPC mapping: {e}"))
    })?
}
