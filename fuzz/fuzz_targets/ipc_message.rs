//! The CUDA IPC message reader (`ipc::Message::decode`, which `stitch_ipc_open` and the torch
//! extension's `getIpcDevPtr` run on bytes from another process) on arbitrary input: an
//! error value or a message that encodes back to the same bytes, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stitch_alloc::ipc::Message;

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = Message::decode(data) {
        assert!(!m.pieces.is_empty());
        assert_eq!(m.encode(), data, "a message that decodes encodes to the same bytes");
    }
});
