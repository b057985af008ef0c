//! Tests on a real GPU through `CudaDriver`.
//!
//! Every `gpu_*` test is `#[ignore]`d, so a plain `cargo test` (CI, no GPU) reports it as
//! ignored rather than passed; the GPU bundle (`scripts/gpu-check.sh run`) runs them with
//! `--include-ignored` and `STITCH_REQUIRE_GPU=1`. Each starts with `common::gpu_or_skip`:
//! without a usable CUDA device it fails when `STITCH_REQUIRE_GPU=1`, else it prints
//! `SKIPPED (no CUDA device): <name>` to stderr and returns. The bodies are generic over the
//! driver; the `host_*` tests (not ignored) run the same bodies on `HostDriver` (real OS
//! memory), so the test logic itself is checked on every machine.
//!
//! Run on the GPU machine with `--test-threads=1 --include-ignored`: the tests take large
//! parts of device memory and would starve one another.

mod common;

use std::time::Instant;
use stitch_alloc::driver::{code, Driver, DriverOp, HostDriver};
use stitch_alloc::{AllocError, Allocator, Capacity, Config, CudaDriver, Stream};

const MIB: u64 = 1 << 20;
const S: Stream = Stream::DEFAULT;

/// Returns the device, or `None` when the test is skipped (see `common::gpu_or_skip`).
fn gpu(test: &str) -> Option<CudaDriver> {
    if !common::gpu_or_skip(test) {
        return None;
    }
    let d = CudaDriver::new(0).expect("CUDA is available but device 0 did not open");
    eprintln!(
        "{test}: {} (driver {}), granularity {} bytes",
        d.device_name(),
        d.driver_version(),
        d.granularity()
    );
    Some(d)
}

/// A byte pattern that differs per block and per position.
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

// ---------------------------------------------------------------------------------------
// Bodies, generic over the driver.

/// reserve / create / map / set_access / write / read / unmap / remap elsewhere / release /
/// free: the raw VMM sequence, and data surviving a move to a new address.
fn raw_sequence<D: Driver>(d: &D) {
    let g = d.granularity();
    assert!(g.is_power_of_two() && g >= 4096, "granularity {g}");
    let info = d.mem_info().unwrap();
    assert!(info.total > 0 && info.free <= info.total, "{info:?}");

    let hsize = 2 * g;
    let va = d.reserve(8 * g).unwrap();
    assert_eq!(va % g, 0, "reservation {va:#x} is not granularity-aligned");
    let h = d.create(hsize).unwrap();
    d.map(va, hsize, h).unwrap();
    d.set_access(va, hsize).unwrap();

    let data = pattern(1, hsize as usize);
    d.write(va, &data).unwrap();
    let mut back = vec![0u8; hsize as usize];
    d.read(va, &mut back).unwrap();
    assert!(back == data, "data read back differs");

    // Move the handle to a new address in the same reservation: the bytes come along.
    d.unmap(va, hsize).unwrap();
    let moved = va + 5 * g;
    d.map(moved, 2 * g, h).unwrap();
    d.set_access(moved, hsize).unwrap();
    let mut back = vec![0u8; hsize as usize];
    d.read(moved, &mut back).unwrap();
    assert!(back == data, "data did not survive the remap");

    // Two handles side by side, one set_access spanning both.
    let h2 = d.create(g).unwrap();
    d.map(va, g, h2).unwrap();
    d.set_access(va, g).unwrap();
    d.write(va + g - 3, b"ab").unwrap(); // inside h2
    let mut two = [0u8; 2];
    d.read(va + g - 3, &mut two).unwrap();
    assert_eq!(&two, b"ab");

    // A mapped handle cannot be released on the CPU backends; CUDA defers it. Either way,
    // unmap first, then release and free.
    d.unmap(moved, hsize).unwrap();
    d.unmap(va, g).unwrap();
    d.release(h).unwrap();
    d.release(h2).unwrap();
    d.free_reservation(va, 8 * g).unwrap();

    // Events on the default stream.
    let e = d.record_event(S).unwrap();
    d.wait_event(e).unwrap();
    assert!(d.query_event(e).unwrap());
    d.destroy_event(e).unwrap();
    let e2 = d.record_event(S).unwrap(); // may reuse the pooled event
    d.wait_event(e2).unwrap();
    d.destroy_event(e2).unwrap();
}

/// Calls the device must refuse, each with an error value (no crash, nothing leaked).
/// Kept out of `raw_sequence` so that sanitizer runs can skip deliberate API errors.
fn refusals<D: Driver>(d: &D) {
    let g = d.granularity();
    let va = d.reserve(4 * g).unwrap();
    let h = d.create(2 * g).unwrap();
    d.map(va, 2 * g, h).unwrap();
    // An unmap must cover exactly one earlier mapping.
    let e = d.unmap(va, g).expect_err("a partial unmap must fail");
    assert_eq!(
        (e.op, e.code),
        (DriverOp::Unmap, code::INVALID_VALUE),
        "{e}"
    );
    // Mapping over an existing mapping fails.
    let h2 = d.create(g).unwrap();
    let e = d
        .map(va + g, g, h2)
        .expect_err("an overlapping map must fail");
    assert_eq!((e.op, e.code), (DriverOp::Map, code::INVALID_VALUE), "{e}");
    d.unmap(va, 2 * g).unwrap();
    d.release(h).unwrap();
    d.release(h2).unwrap();
    d.free_reservation(va, 4 * g).unwrap();
}

/// Fill `count` blocks of `block` bytes, free every other one, then allocate one block the
/// size of all the holes: it must succeed by stitching, and the survivors keep their bytes.
fn checkerboard<D: Driver>(d: D, count: u64, block: u64) {
    let capacity = count * block;
    // Stitching by remapping (not release and re-create): this checks that moved handles
    // keep their bytes.
    let mut cfg = Config::default()
        .with_capacity(Capacity::Bytes(capacity))
        .with_paranoid(true);
    cfg.recreate = false;
    let a = Allocator::new(d, cfg).unwrap();
    let probe = 1 << 20; // bytes checked at the start, middle and end of each block
    let spots = |p: u64| [p, p + block / 2 - probe / 2, p + block - probe];

    let t = Instant::now();
    let ptrs: Vec<_> = (0..count).map(|_| a.alloc(block, S).unwrap()).collect();
    for (i, p) in ptrs.iter().enumerate() {
        for (j, at) in spots(p.0).into_iter().enumerate() {
            let pat = pattern(i as u64 * 3 + j as u64, probe as usize);
            a.driver().write(at, &pat).unwrap();
        }
    }
    let filled = t.elapsed();
    for p in ptrs.iter().step_by(2) {
        a.free(*p, S).unwrap();
    }
    let hole_total = (count / 2) * block;
    let before = a.stats().stitches;
    let t = Instant::now();
    let big = a.alloc(hole_total, S).unwrap();
    let stitch_time = t.elapsed();
    let st = a.stats();
    assert!(st.stitches > before, "no stitch happened: {st:?}");
    assert!(st.stitches >= 1);
    eprintln!(
        "checkerboard on {}: {count} x {} MiB filled+written in {filled:?}; one {} MiB \
         allocation in {stitch_time:?} ({} stitch(es), {} handle(s) moved)",
        a.driver().name(),
        block / MIB,
        hole_total / MIB,
        st.stitches,
        st.stitched_handles
    );

    // The stitched span is usable end to end.
    let head = pattern(999, probe as usize);
    a.driver().write(big.0, &head).unwrap();
    a.driver().write(big.0 + hole_total - probe, &head).unwrap();
    let mut buf = vec![0u8; probe as usize];
    a.driver()
        .read(big.0 + hole_total - probe, &mut buf)
        .unwrap();
    assert!(buf == head, "stitched span lost its bytes");

    // Survivors are intact.
    for (i, p) in ptrs.iter().enumerate().skip(1).step_by(2) {
        for (j, at) in spots(p.0).into_iter().enumerate() {
            let want = pattern(i as u64 * 3 + j as u64, probe as usize);
            let mut got = vec![0u8; probe as usize];
            a.driver().read(at, &mut got).unwrap();
            assert!(got == want, "block {i} spot {j} changed");
        }
    }
    a.validate().unwrap();

    a.free(big, S).unwrap();
    for p in ptrs.iter().skip(1).step_by(2) {
        a.free(*p, S).unwrap();
    }
    a.validate().unwrap();
    let report = a.shutdown();
    assert_eq!(report.leaked_allocations, 0);
}

/// Allocate `chunk`-sized blocks until the allocator says `OutOfMemory` (never a driver
/// error), then free one and allocate again.
fn oom_then_recover<D: Driver>(a: &Allocator<D>, chunk: u64) {
    let mut live = Vec::new();
    let t = Instant::now();
    let err = loop {
        match a.alloc(chunk, S) {
            Ok(p) => live.push(p),
            Err(e) => break e,
        }
        assert!(live.len() < 100_000, "never ran out of memory");
    };
    let took = t.elapsed();
    assert!(
        matches!(err, AllocError::OutOfMemory(_)),
        "expected OutOfMemory, got {err}"
    );
    let st = a.stats();
    eprintln!(
        "OOM on {} after {} x {} MiB ({:.2} GiB held, capacity {:.2} GiB) in {took:?}: {err}",
        a.driver().name(),
        live.len(),
        chunk / MIB,
        st.reserved.current as f64 / (1u64 << 30) as f64,
        a.capacity() as f64 / (1u64 << 30) as f64
    );
    assert!(!live.is_empty());
    assert!(st.ooms >= 1);
    a.validate().unwrap();

    // Still works after freeing.
    let p = live.pop().unwrap();
    a.free(p, S).unwrap();
    let q = a.alloc(chunk, S).unwrap();
    if a.driver().has_data() {
        a.driver().write(q.0, b"alive").unwrap();
        let mut b = [0u8; 5];
        a.driver().read(q.0, &mut b).unwrap();
        assert_eq!(&b, b"alive");
    }
    live.push(q);
    for p in live {
        a.free(p, S).unwrap();
    }
    a.validate().unwrap();
    assert_eq!(a.stats().requested.current, 0);
}

// ---------------------------------------------------------------------------------------
// GPU tests.

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-check.sh run)"]
fn gpu_raw_driver_sequence() {
    let Some(d) = gpu("gpu_raw_driver_sequence") else {
        return;
    };
    assert_eq!(d.granularity(), 2 * MIB, "H100/H200 granularity is 2 MiB");
    raw_sequence(&d);
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-check.sh run)"]
fn gpu_errors_are_values() {
    let Some(d) = gpu("gpu_errors_are_values") else {
        return;
    };
    refusals(&d);
    let g = d.granularity();
    // Mapping outside any reservation fails with a named error, not a crash.
    let h = d.create(g).unwrap();
    let e = d.map(0x1000_0000_0000, g, h).unwrap_err();
    assert_eq!((e.op, e.code), (DriverOp::Map, code::INVALID_VALUE), "{e}");
    assert!(e.message.starts_with("cuMemMap: CUDA_ERROR_"), "{e}");
    d.release(h).unwrap();
    // A create far beyond the device is out of memory, with the allocator's OOM code.
    let total = d.mem_info().unwrap().total;
    let e = d.create((total + 64 * g) / g * g).unwrap_err();
    assert_eq!(
        (e.op, e.code),
        (DriverOp::Create, code::OUT_OF_MEMORY),
        "{e}"
    );
    assert!(e.message.contains("cuMemCreate"), "{e}");
    let e = CudaDriver::new(CudaDriver::device_count()).unwrap_err();
    assert_eq!(e.code, code::INVALID_VALUE, "{e}");
    assert!(e.message.contains("out of range"), "{e}");
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-check.sh run)"]
fn gpu_checkerboard_stitches_and_keeps_data() {
    let Some(d) = gpu("gpu_checkerboard_stitches_and_keeps_data") else {
        return;
    };
    checkerboard(d, 20, 100 * MIB);
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-check.sh run)"]
fn gpu_oom_at_half_capacity() {
    let Some(d) = gpu("gpu_oom_at_half_capacity") else {
        return;
    };
    let a = Allocator::new(d, Config::default().with_capacity(Capacity::Fraction(0.5))).unwrap();
    oom_then_recover(&a, 4096 * MIB);
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-check.sh run)"]
fn gpu_oom_at_device_limit() {
    // The allocator's capacity is the whole device, so cuMemCreate itself runs out first:
    // its CUDA_ERROR_OUT_OF_MEMORY must surface as AllocError::OutOfMemory.
    let Some(d) = gpu("gpu_oom_at_device_limit") else {
        return;
    };
    let a = Allocator::new(d, Config::default()).unwrap();
    oom_then_recover(&a, 4096 * MIB);
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-check.sh run)"]
fn gpu_events_follow_stream_work() {
    let Some(d) = gpu("gpu_events_follow_stream_work") else {
        return;
    };
    // Queue a large copy, then record: the event completes only after it.
    let a = Allocator::new(
        d,
        Config::default().with_capacity(Capacity::Bytes(2048 * MIB)),
    )
    .unwrap();
    let p = a.alloc(512 * MIB, S).unwrap();
    let big = vec![7u8; (512 * MIB) as usize];
    a.driver().write(p.0, &big).unwrap();
    let e = a.driver().record_event(S).unwrap();
    a.driver().wait_event(e).unwrap();
    assert!(a.driver().query_event(e).unwrap());
    a.driver().destroy_event(e).unwrap();
    a.free(p, S).unwrap();
    // Many events: the pool hands them out and takes them back.
    let evs: Vec<_> = (0..300)
        .map(|_| a.driver().record_event(S).unwrap())
        .collect();
    for e in evs {
        a.driver().wait_event(e).unwrap();
        a.driver().destroy_event(e).unwrap();
    }
}

/// The stream rule on real hardware. Block A is allocated on stream 1 and a long chain of
/// `cuMemsetD32Async` calls that write it is queued there; A is freed on stream 1 while that
/// writer is still running, and at once stream 2 asks for a size that only stitching A's
/// handle (with another free handle) can give, the capacity being full.
///
/// The allocator must wait for the writer before it unmaps A's handle: when `alloc` returns,
/// the writer's event has completed; synchronising reports no error (an early unmap would
/// make the memsets fault with an illegal address); and the bytes read back through the new
/// mapping are the writer's last value everywhere. Runs under compute-sanitizer memcheck in
/// `scripts/gpu-check.sh run`.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-check.sh run)"]
fn gpu_free_then_stitch_on_other_stream_waits_for_the_writer() {
    let Some(d) = gpu("gpu_free_then_stitch_on_other_stream_waits_for_the_writer") else {
        return;
    };
    const BLOCK: u64 = 256 * MIB;
    const WRITES: u32 = 128; // about 10 ms of memsets on an H200
    const LAST: u32 = 0x5EED_F00D;
    let s1 = d.create_stream(true).unwrap();
    let s2 = d.create_stream(true).unwrap();
    let (st1, st2) = (s1.stream(), s2.stream());
    let a = Allocator::new(
        d,
        Config::default()
            .with_capacity(Capacity::Bytes(4 * BLOCK))
            .with_contiguous(false)
            .with_paranoid(true),
    )
    .unwrap();
    let gpu = a.driver();

    // x | y1 | A | y2: the capacity is full, and x and A are not neighbours.
    let x = a.alloc(BLOCK, st1).unwrap();
    let y1 = a.alloc(BLOCK, st1).unwrap();
    let blk = a.alloc(BLOCK, st1).unwrap();
    let y2 = a.alloc(BLOCK, st1).unwrap();
    assert_eq!(a.stats().reserved.current, 4 * BLOCK, "{:?}", a.stats());
    gpu.memset_d32_async(x.0, LAST, BLOCK / 4, st1).unwrap();
    gpu.stream_synchronize(st1).unwrap();
    a.free(x, st1).unwrap();

    // The long writer of A, on stream 1; its last memset writes LAST.
    for i in 0..WRITES {
        let v = if i + 1 == WRITES { LAST } else { i };
        gpu.memset_d32_async(blk.0, v, BLOCK / 4, st1).unwrap();
    }
    let writer = gpu.record_event(st1).unwrap();
    assert!(
        !gpu.query_event(writer).unwrap(),
        "the writer finished before the free: the test would prove nothing (raise WRITES)"
    );

    let before = a.stats();
    let t = Instant::now();
    a.free(blk, st1).unwrap();
    let big = a.alloc(2 * BLOCK, st2).unwrap();
    let took = t.elapsed();
    let writer_done = gpu.query_event(writer).unwrap();
    let st = a.stats();
    eprintln!(
        "free on stream 1 + stitching alloc of {} MiB on stream 2 took {took:?}: {} stitch(es),          {} handle(s) moved, {} event wait(s)",
        2 * BLOCK / MIB,
        st.stitches - before.stitches,
        st.stitched_handles - before.stitched_handles,
        st.event_waits - before.event_waits
    );
    assert!(st.stitches > before.stitches, "no stitch happened: {st:?}");
    eprintln!(
        "{}",
        if big.0 == x.0 {
            "A's handle was unmapped and mapped after x's (the unmap the fence protects)"
        } else if big.0 == blk.0 {
            "x's handle was mapped after A's; A's handle stayed in place"
        } else {
            "both handles were mapped at a new address"
        }
    );
    assert!(
        writer_done,
        "alloc returned (having remapped A's handle) before the writer on stream 1 finished"
    );
    gpu.synchronize()
        .expect("queued work failed: memory was unmapped under it");

    // Every sample of the stitched span holds LAST: x's bytes and the writer's final bytes.
    let mut buf = vec![0u8; 4096];
    let mut spots: Vec<u64> = (0..2 * BLOCK).step_by((8 * MIB) as usize).collect();
    spots.push(2 * BLOCK - buf.len() as u64);
    for off in spots {
        gpu.read(big.0 + off, &mut buf).unwrap();
        let bad = buf
            .chunks_exact(4)
            .position(|w| u32::from_le_bytes(w.try_into().unwrap()) != LAST);
        assert!(
            bad.is_none(),
            "stitched span at offset {off:#x}: word {} is not the writer's last value",
            bad.unwrap_or(0)
        );
    }

    gpu.destroy_event(writer).unwrap();
    a.free(big, st2).unwrap();
    a.free(y1, st1).unwrap();
    a.free(y2, st1).unwrap();
    a.validate().unwrap();
    assert_eq!(a.shutdown().leaked_allocations, 0);
    let leaks = a.driver().leak_report();
    assert!(leaks.is_clean(), "device still holds {leaks:?}");
}

/// Issue #13 item 8 on the device: a slow path that must wait for a long writer on stream 1
/// waits without the allocator's lock, so small allocations and frees on another thread go
/// on meanwhile. Prints both threads' timings (the figures in design/gpu-results.md).
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-check.sh run)"]
fn gpu_fast_path_goes_on_while_a_slow_path_waits_behind_a_long_kernel() {
    let Some(d) = gpu("gpu_fast_path_goes_on_while_a_slow_path_waits_behind_a_long_kernel") else {
        return;
    };
    const BLOCK: u64 = 256 * MIB;
    const WRITES: u32 = 1200; // about 100 ms of memsets over 768 MiB on an H200
    let s1 = d.create_stream(true).unwrap();
    let s2 = d.create_stream(true).unwrap();
    let (st1, st2) = (s1.stream(), s2.stream());
    let a = std::sync::Arc::new(
        Allocator::new(
            d,
            Config::default().with_capacity(Capacity::Bytes(4 * BLOCK)),
        )
        .unwrap(),
    );
    let warm = a.alloc(4096, st2).unwrap();
    a.free(warm, st2).unwrap();
    let blk = a.alloc(3 * BLOCK, st1).unwrap();
    for i in 0..WRITES {
        a.driver()
            .memset_d32_async(blk.0, i, 3 * BLOCK / 4, st1)
            .unwrap();
    }
    a.free(blk, st1).unwrap();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let t0 = Instant::now();
    let waiter = {
        let (a, done) = (a.clone(), done.clone());
        std::thread::spawn(move || {
            // Needs the writer's memory: waits for stream 1.
            let p = a.alloc(2 * BLOCK, st2);
            let took = t0.elapsed();
            done.store(true, std::sync::atomic::Ordering::SeqCst);
            (p, took)
        })
    };
    let mut lat = Vec::new();
    while !done.load(std::sync::atomic::Ordering::SeqCst) {
        let t = Instant::now();
        let p = a.alloc(4096, st2).unwrap();
        a.free(p, st2).unwrap();
        lat.push(t.elapsed());
    }
    let (p, waited) = waiter.join().unwrap();
    let p = p.unwrap();
    lat.sort();
    let max = *lat.last().unwrap();
    let p50 = lat[lat.len() / 2];
    eprintln!(
        "slow path waited {waited:?} for the writer; meanwhile {} fast-path alloc+free pairs \
         on another thread: p50 {p50:?}, max {max:?}; event waits {}",
        lat.len(),
        a.stats().event_waits
    );
    assert!(
        waited.as_millis() >= 20,
        "the writer finished too soon ({waited:?}) to prove anything: raise WRITES"
    );
    assert!(
        max * 4 < waited,
        "a fast-path pair took {max:?} while the slow path waited {waited:?}: it was blocked"
    );
    a.free(p, st2).unwrap();
    a.validate().unwrap();
    assert_eq!(a.shutdown().leaked_allocations, 0);
}

// ---------------------------------------------------------------------------------------
// The same bodies on the host backend (always run).

#[test]
fn host_raw_driver_sequence() {
    raw_sequence(&HostDriver::with_capacity(256 * MIB).unwrap());
}

#[test]
fn host_refusals() {
    refusals(&HostDriver::with_capacity(256 * MIB).unwrap());
}

#[test]
fn host_checkerboard_stitches_and_keeps_data() {
    checkerboard(
        HostDriver::with_capacity(2048 * MIB).unwrap(),
        20,
        100 * MIB,
    );
}

#[test]
fn host_oom_then_recover() {
    let a = Allocator::new(
        HostDriver::with_capacity(1024 * MIB).unwrap(),
        Config::default().with_capacity(Capacity::Fraction(0.5)),
    )
    .unwrap();
    oom_then_recover(&a, 100 * MIB);
}

/// The layout and checks of `gpu_free_then_stitch_on_other_stream_waits_for_the_writer` on
/// the host backend, with simulated work in place of the memsets: the stitch must wait for
/// the work (the host backend refuses to unmap under in-flight work).
#[test]
fn host_free_then_stitch_on_other_stream_waits_for_the_work() {
    const BLOCK: u64 = 256 * MIB;
    let (st1, st2) = (Stream::sim(1), Stream::sim(2));
    let a = Allocator::new(
        HostDriver::with_capacity(4 * BLOCK).unwrap(),
        // Runs apart: the layout below (x's handle first in the stitched span) is the one
        // of separate spans; contiguous growth would link them and merge the freed blocks.
        Config::default()
            .with_capacity(Capacity::Bytes(4 * BLOCK))
            .with_contiguous(false)
            .with_paranoid(true),
    )
    .unwrap();
    let x = a.alloc(BLOCK, st1).unwrap();
    let y1 = a.alloc(BLOCK, st1).unwrap();
    let blk = a.alloc(BLOCK, st1).unwrap();
    let y2 = a.alloc(BLOCK, st1).unwrap();
    assert_eq!(a.stats().reserved.current, 4 * BLOCK, "{:?}", a.stats());
    a.driver().write(x.0, b"x-bytes").unwrap();
    a.free(x, st1).unwrap();
    a.driver().write(blk.0 + BLOCK - 7, b"a-bytes").unwrap();
    let w = a.driver().launch(st1, blk.0, BLOCK);
    let before = a.stats();
    a.free(blk, st1).unwrap();
    let big = a.alloc(2 * BLOCK, st2).unwrap();
    let st = a.stats();
    assert!(st.stitches > before.stitches, "no stitch happened: {st:?}");
    assert!(
        a.driver().work_done(w),
        "alloc returned before the work finished"
    );
    assert_eq!(big.0, x.0, "expected A's handle to be remapped after x's");
    assert!(st.event_waits > before.event_waits, "{st:?}");
    // Both handles' bytes are in the new span, in some order.
    let mut buf = vec![0u8; (2 * BLOCK) as usize];
    a.driver().read(big.0, &mut buf).unwrap();
    let has = |pat: &[u8]| buf.windows(pat.len()).any(|w| w == pat);
    assert!(has(b"x-bytes") && has(b"a-bytes"));
    a.free(big, st2).unwrap();
    a.free(y1, st1).unwrap();
    a.free(y2, st1).unwrap();
    a.validate().unwrap();
    assert_eq!(a.shutdown().leaked_allocations, 0);
    assert!(a.driver().leak_report().is_clean());
}

/// This thread's current CUDA context (a `CUcontext` as an integer).
fn current_context() -> usize {
    use cudarc::driver::sys;
    let mut cur: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: a valid out-pointer; the driver is initialised (a `CudaDriver` was opened).
    let r = unsafe { sys::cuCtxGetCurrent(&mut cur) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    cur as usize
}

/// Issue #13, item 1: every driver entry leaves the caller's current context as it found
/// it: a context of the caller's own (not the primary one), and none at all. Through the
/// allocator, the streams, the capture query and the C ABI's malloc / free / reset.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-check.sh run)"]
fn gpu_caller_context_is_restored() {
    use cudarc::driver::sys;
    use stitch_alloc::capi::{stitch_free, stitch_malloc, stitch_reset};
    let Some(d) = gpu("gpu_caller_context_is_restored") else {
        return;
    };
    let mut dev: sys::CUdevice = 0;
    // SAFETY: a valid out-pointer; the driver is initialised.
    assert_eq!(
        unsafe { sys::cuDeviceGet(&mut dev, 0) },
        sys::CUresult::CUDA_SUCCESS
    );
    let mut mine: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: a valid out-pointer and device; no creation parameters. The new context is
    // made current (pushed) on this thread and destroyed at the end of the test.
    let r = unsafe { sys::cuCtxCreate_v4(&mut mine, std::ptr::null_mut(), 0, dev) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    let a = Allocator::new(d, Config::default().with_capacity(Capacity::Bytes(1 << 30))).unwrap();
    for want in [mine as usize, 0] {
        // SAFETY: `mine` is live (destroyed below); null unbinds.
        assert_eq!(
            unsafe { sys::cuCtxSetCurrent(want as sys::CUcontext) },
            sys::CUresult::CUDA_SUCCESS
        );
        assert_eq!(current_context(), want);
        let p = a.alloc(64 * MIB, S).unwrap();
        assert_eq!(current_context(), want, "after alloc");
        a.free(p, S).unwrap();
        assert_eq!(current_context(), want, "after free");
        a.empty_cache().unwrap();
        assert_eq!(current_context(), want, "after empty_cache");
        let s = a.driver().create_stream(true).unwrap();
        assert!(!a.driver().stream_capturing(s.stream()).unwrap());
        assert_eq!(
            current_context(),
            want,
            "after create_stream, stream_capturing"
        );
        drop(s);
        assert_eq!(current_context(), want, "after the stream's drop");
        // The C ABI (default configuration: backend auto, CUDA here), whose reset walks every
        // device's context.
        let p = stitch_malloc(MIB as usize, 0, std::ptr::null_mut());
        assert!(!p.is_null());
        assert_eq!(current_context(), want, "after stitch_malloc");
        stitch_free(p, 0, 0, std::ptr::null_mut());
        stitch_reset();
        assert_eq!(current_context(), want, "after stitch_free, stitch_reset");
    }
    // SAFETY: `mine` was created above and is destroyed once; nothing uses it any more.
    assert_eq!(
        unsafe { sys::cuCtxDestroy_v2(mine) },
        sys::CUresult::CUDA_SUCCESS
    );
}

/// Issue #12: `stream_capturing` sees a graph capture on a real stream (and the default
/// stream never captures).
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-check.sh run)"]
fn gpu_stream_capturing_sees_a_capture() {
    use cudarc::driver::sys;
    let Some(d) = gpu("gpu_stream_capturing_sees_a_capture") else {
        return;
    };
    // Like torch's threads: the primary context current.
    let (mut dev, mut primary): (sys::CUdevice, sys::CUcontext) = (0, std::ptr::null_mut());
    // SAFETY: valid out-pointers; the driver is initialised. The retain is balanced by the
    // release at the end.
    unsafe {
        assert_eq!(sys::cuDeviceGet(&mut dev, 0), sys::CUresult::CUDA_SUCCESS);
        assert_eq!(
            sys::cuDevicePrimaryCtxRetain(&mut primary, dev),
            sys::CUresult::CUDA_SUCCESS
        );
        assert_eq!(sys::cuCtxSetCurrent(primary), sys::CUresult::CUDA_SUCCESS);
    }
    let s = d.create_stream(true).unwrap();
    let raw = s.stream().raw() as sys::CUstream;
    assert!(!d.stream_capturing(s.stream()).unwrap());
    // SAFETY: `raw` is a live stream of the primary context, current on this thread;
    // relaxed mode lets other calls go on.
    let r = unsafe {
        sys::cuStreamBeginCapture_v2(
            raw,
            sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
        )
    };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    assert!(d.stream_capturing(s.stream()).unwrap());
    assert!(!d.stream_capturing(S).unwrap());
    let mut graph: sys::CUgraph = std::ptr::null_mut();
    // SAFETY: ends the capture begun above on the same stream; the (empty) graph is
    // destroyed once, right after.
    unsafe {
        assert_eq!(
            sys::cuStreamEndCapture(raw, &mut graph),
            sys::CUresult::CUDA_SUCCESS
        );
        assert_eq!(sys::cuGraphDestroy(graph), sys::CUresult::CUDA_SUCCESS);
    }
    assert!(!d.stream_capturing(s.stream()).unwrap());
    drop(s);
    // SAFETY: balances the retain above.
    unsafe { sys::cuDevicePrimaryCtxRelease_v2(dev) };
}

/// The base and size of the driver's allocation containing `ptr` (`cuMemGetAddressRange`,
/// what NCCL registration looks up), queried in device 0's primary context.
fn cuda_address_range(ptr: u64) -> (u64, u64) {
    use cudarc::driver::sys;
    let mut dev: sys::CUdevice = 0;
    let mut ctx: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: valid out-pointers; the driver is initialised (a `CudaDriver` was opened).
    unsafe {
        assert_eq!(sys::cuDeviceGet(&mut dev, 0), sys::CUresult::CUDA_SUCCESS);
        assert_eq!(
            sys::cuDevicePrimaryCtxRetain(&mut ctx, dev),
            sys::CUresult::CUDA_SUCCESS
        );
        assert_eq!(sys::cuCtxPushCurrent_v2(ctx), sys::CUresult::CUDA_SUCCESS);
    }
    let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
    // SAFETY: valid out-pointers; `ptr` is a live allocation of this process.
    let r = unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) };
    let mut popped: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: balances the push and the retain above.
    unsafe {
        sys::cuCtxPopCurrent_v2(&mut popped);
        sys::cuDevicePrimaryCtxRelease_v2(dev);
    }
    assert_eq!(
        r,
        sys::CUresult::CUDA_SUCCESS,
        "cuMemGetAddressRange({ptr:#x})"
    );
    (base, size as u64)
}

/// Issue #14: a buffer from `alloc_one_handle` is one driver allocation (what NCCL
/// user-buffer registration needs), also when the pool is fragmented so that an ordinary
/// request of the same size gets a stitched span of several handles, which the driver
/// reports as several allocations. The oracle is the driver's `cuMemGetAddressRange`.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored (scripts/gpu-check.sh run)"]
fn gpu_one_handle_buffer_is_one_driver_allocation() {
    let Some(d) = gpu("gpu_one_handle_buffer_is_one_driver_allocation") else {
        return;
    };
    let a = Allocator::new(d, Config::default().with_capacity(Capacity::Bytes(4 << 30))).unwrap();
    let small: Vec<_> = (0..64).map(|_| a.alloc(24 * MIB, S).unwrap()).collect();
    for p in small.iter().step_by(2) {
        a.free(*p, S).unwrap();
    }
    let big = a.alloc(200 * MIB, S).unwrap();
    let (b0, s0) = cuda_address_range(big.addr());
    assert!(
        b0 + s0 < big.addr() + 200 * MIB,
        "the ordinary path gives a span of several allocations here: {b0:#x} + {s0}"
    );
    for size in [3 * MIB, 200 * MIB, 300 * MIB + 5] {
        let p = a.alloc_one_handle(size, S).unwrap();
        let (b, s) = cuda_address_range(p.addr());
        assert!(
            b <= p.addr() && p.addr() + size <= b + s,
            "{size}: {b:#x} + {s}"
        );
        a.free(p, S).unwrap();
    }
    a.free(big, S).unwrap();
    for p in small.into_iter().skip(1).step_by(2) {
        a.free(p, S).unwrap();
    }
    a.validate().unwrap();
    assert_eq!(a.shutdown().leaked_allocations, 0);
}
