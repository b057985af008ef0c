//! CUDA IPC on the host backend, across two real processes (the GPU path is the same code
//! over `cuMemExportToShareableHandle`; python/tests/test_torch_gpu.py runs it through torch):
//! the sender shares a stitched allocation, a child process opens it from the message alone,
//! checks the sender's bytes and writes its own, which the sender then reads.

use std::process::Command;
use std::sync::Arc;
use stitch_alloc::driver::{Driver, HostDriver};
use stitch_alloc::{ipc, Allocator, Capacity, Config, Stream};

const MIB: u64 = 1 << 20;

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

/// Run in the child only (the parent sets `STITCH_IPC_HANDLE`); a plain run does nothing.
#[test]
fn ipc_child() {
    let Ok(h) = std::env::var("STITCH_IPC_HANDLE") else {
        return;
    };
    let offset: u64 = std::env::var("STITCH_IPC_OFFSET").unwrap().parse().unwrap();
    let len: usize = std::env::var("STITCH_IPC_LEN").unwrap().parse().unwrap();
    let rx = HostDriver::with_capacity(64 * MIB).unwrap();
    let view = ipc::open(&rx, &unhex(&h)).expect("the child opens the sender's block");
    let mut got = vec![0u8; len];
    rx.read(view.ptr() + offset, &mut got).unwrap();
    assert!(got == pattern(len, 7), "the child sees the sender's bytes");
    rx.write(view.ptr() + offset, &pattern(len, 99)).unwrap();
    view.close(&rx).unwrap();
    assert!(rx.leak_report().is_clean(), "close gives everything back");
    println!("IPC-CHILD-OK");
}

#[test]
fn a_stitched_block_is_shared_with_another_process_both_ways() {
    let host = Arc::new(HostDriver::with_capacity(256 * MIB).unwrap());
    let cfg = Config::default()
        .with_handle_sizes(2 * MIB, 2 * MIB)
        .with_capacity(Capacity::Bytes(24 * MIB))
        .with_paranoid(true);
    let a = Allocator::new(host.clone(), cfg).unwrap();
    // A checkerboard of 2 MiB blocks, then every other one freed: the 8 MiB block is
    // stitched from handles that were apart.
    let blocks: Vec<_> = (0..12)
        .map(|_| a.alloc(2 * MIB, Stream::DEFAULT).unwrap())
        .collect();
    for p in blocks.iter().step_by(2) {
        a.free(*p, Stream::DEFAULT).unwrap();
    }
    let big = a.alloc(8 * MIB, Stream::DEFAULT).unwrap();
    assert!(a.stats().stitches >= 1, "the block was stitched");
    let len = (8 * MIB) as usize;
    host.write(big.addr(), &pattern(len, 7)).unwrap();
    let s = a.share(big).unwrap();
    assert_eq!(ipc::Message::decode(&s.handle).unwrap().pieces.len(), 4);

    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "ipc_child", "--nocapture", "--test-threads=1"])
        .env("STITCH_IPC_HANDLE", hex(&s.handle))
        .env("STITCH_IPC_OFFSET", s.offset.to_string())
        .env("STITCH_IPC_LEN", len.to_string())
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && text.contains("IPC-CHILD-OK"),
        "{text}"
    );
    let mut back = vec![0u8; len];
    host.read(big.addr(), &mut back).unwrap();
    assert!(
        back == pattern(len, 99),
        "the sender sees the child's bytes"
    );

    a.free(big, Stream::DEFAULT).unwrap();
    for p in blocks.iter().skip(1).step_by(2) {
        a.free(*p, Stream::DEFAULT).unwrap();
    }
    drop(a);
    assert!(host.leak_report().is_clean());
}

#[test]
fn a_receiver_can_open_the_same_block_twice_and_the_sender_may_release_first() {
    let host = Arc::new(HostDriver::with_capacity(64 * MIB).unwrap());
    let a = Allocator::new(host.clone(), Config::default()).unwrap();
    let p = a.alloc(4 * MIB, Stream::DEFAULT).unwrap();
    host.write(p.addr(), b"still here").unwrap();
    let s = a.share(p).unwrap();
    let rx = HostDriver::with_capacity(64 * MIB).unwrap();
    let v1 = ipc::open(&rx, &s.handle).unwrap();
    let v2 = ipc::open(&rx, &s.handle).unwrap();
    assert_ne!(v1.ptr(), v2.ptr());
    // The sender frees and gives its handles back: the receiver's import keeps the memory.
    a.free(p, Stream::DEFAULT).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(a.stats().handles, 0);
    let mut buf = [0u8; 10];
    rx.read(v2.ptr() + s.offset, &mut buf).unwrap();
    assert_eq!(&buf, b"still here");
    v1.close(&rx).unwrap();
    v2.close(&rx).unwrap();
    assert!(rx.leak_report().is_clean());
    drop(a);
    assert!(host.leak_report().is_clean());
}
