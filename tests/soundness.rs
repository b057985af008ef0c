//! Soundness defects of issue #13 in the engine (see design/reliability.md): stream owners
//! past 65,535 streams, a stream whose fences fail, a failed multi-stream free, and teardown
//! with work still queued on live memory. Each test failed before its fix.

use parking_lot::Mutex;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use stitch_alloc::driver::{
    code, Call, Done, DriverError, DriverOp, DriverResult, FaultyDriver, Forward, SimDriver, WorkId,
};
use stitch_alloc::{Allocator, Capacity, Config, Stream};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// Whether `[a, a+alen)` and `[b, b+blen)` overlap.
fn overlaps(a: u64, alen: u64, b: u64, blen: u64) -> bool {
    a < b + blen && b < a + alen
}

/// A simulator whose `record_event` fails on one chosen stream (a destroyed or broken stream),
/// and that counts every refused unmap (the simulator refuses to unmap memory in-flight work
/// uses: on a GPU that unmap would be a use-after-free).
struct Watched {
    sim: Arc<SimDriver>,
    /// Raw value of the stream whose records fail (`u64::MAX`: none).
    bad: AtomicU64,
    /// Records refused on the bad stream so far.
    refused_records: AtomicU64,
    /// Unmaps the simulator refused so far, with their errors.
    refused_unmaps: Mutex<Vec<String>>,
}

impl Watched {
    fn new(sim: Arc<SimDriver>) -> Arc<Self> {
        Arc::new(Watched {
            sim,
            bad: AtomicU64::new(u64::MAX),
            refused_records: AtomicU64::new(0),
            refused_unmaps: Mutex::new(Vec::new()),
        })
    }
    fn break_stream(&self, s: Option<Stream>) {
        self.bad
            .store(s.map_or(u64::MAX, |s| s.raw()), Ordering::Relaxed);
    }
    fn refused_records(&self) -> u64 {
        self.refused_records.load(Ordering::Relaxed)
    }
}

impl Forward for Watched {
    type Inner = SimDriver;
    fn inner(&self) -> &SimDriver {
        &self.sim
    }
    fn before(&self, call: &Call) -> DriverResult<()> {
        if let Call::RecordEvent { stream } = call {
            if stream.raw() == self.bad.load(Ordering::Relaxed) {
                self.refused_records.fetch_add(1, Ordering::Relaxed);
                return Err(DriverError::new(
                    DriverOp::RecordEvent,
                    code::INVALID_HANDLE,
                    "the stream is gone",
                ));
            }
        }
        Ok(())
    }
    fn after(&self, call: &Call, result: Result<Done, &DriverError>, _ns: u64) {
        if let (Call::Unmap { .. }, Err(e)) = (call, result) {
            self.refused_unmaps.lock().push(e.to_string());
        }
    }
}

/// Defect 2: the owner index was truncated to u16, so the 65,536th stream that freed
/// memory got owner 0, the clean pool: its block was usable at once by every stream while its
/// work was still queued.
#[test]
fn the_65536th_stream_does_not_free_into_the_clean_pool() {
    let sim = Arc::new(SimDriver::with_capacity(GIB));
    let w = Watched::new(sim.clone());
    let cfg = Config::default().with_capacity(Capacity::Bytes(256 * MIB));
    let a = Allocator::new(w.clone(), cfg).unwrap();
    const N: u64 = 70_000;
    const WINDOW: usize = 4;
    let size = 3 * MIB;
    // (stream, address, work) of the last frees, whose work may still be queued.
    let mut recent: VecDeque<(u64, u64, WorkId)> = VecDeque::new();
    for i in 1..=N {
        let s = Stream::sim(i);
        let p = a
            .alloc(size, s)
            .unwrap_or_else(|e| panic!("stream {i}: {e}"));
        for &(j, addr, work) in &recent {
            assert!(
                !overlaps(addr, size, p.0, size) || sim.work_done(work),
                "stream {i} got memory that stream {j} still uses"
            );
        }
        let work = sim.launch(s, p.0, size);
        a.free(p, s).unwrap();
        recent.push_back((i, p.0, work));
        if recent.len() > WINDOW {
            let (j, _, _) = recent.pop_front().unwrap();
            sim.complete(Stream::sim(j), None);
        }
    }
    assert!(w.refused_unmaps.lock().is_empty(), "{:?}", w.refused_unmaps);
    a.validate().unwrap();
    sim.complete_all();
    drop(a);
    assert!(sim.leak_report().is_clean());
}

/// Defect 2 (the other half): the owner table never shrank and `owner_index` scanned it on
/// every allocation and free, so a server with a stream per request slowed down as streams
/// accumulated. Owners of streams with nothing dirty are recycled now: past 64 slots (below
/// that the engine recycles nothing, keeping the poll order of old), the table holds at most
/// one slot per stream whose freed memory is still dirty.
#[test]
fn the_owner_table_stays_bounded_with_a_stream_per_request() {
    let sim = Arc::new(SimDriver::with_capacity(GIB));
    let cap = 64 * MIB;
    let cfg = Config::default().with_capacity(Capacity::Bytes(cap));
    let a = Allocator::new(sim.clone(), cfg).unwrap();
    let size = 3 * MIB;
    let mut max_slots = 0;
    let mut prev: Option<Stream> = None;
    for i in 1..=5_000u64 {
        let s = Stream::sim(i);
        let p = a.alloc(size, s).unwrap();
        sim.launch(s, p.0, size);
        a.free(p, s).unwrap();
        // The request before this one has finished on the device.
        if let Some(q) = prev.replace(s) {
            sim.complete(q, None);
        }
        max_slots = max_slots.max(a.stream_owner_slots());
    }
    // Every slot in use holds at least one dirty block of `size` bytes: at most 21.
    let bound = 64.max(cap / size) as usize;
    assert!(
        max_slots <= bound,
        "{max_slots} owner slots; at most {bound} expected"
    );
    a.validate().unwrap();
    sim.complete_all();
}

/// Defect 3: a failed `record_event` on one stream (say, destroyed without `retire_stream`)
/// made every slow path fail, because the fences of all streams are recorded in one poll.
/// Now that stream's frees stay dirty (usable by it only, never stitched) and everything
/// else keeps working: other streams' fences, pending multi-stream frees, stitching.
#[test]
fn a_stream_whose_fences_fail_does_not_wedge_the_others() {
    let sim = Arc::new(SimDriver::with_capacity(GIB));
    let w = Watched::new(sim.clone());
    let cfg = Config::default()
        .with_capacity(Capacity::Bytes(512 * MIB))
        .with_paranoid(true);
    let a = Allocator::new(w.clone(), cfg).unwrap();
    let (x, s1, s2) = (Stream::sim(9), Stream::sim(1), Stream::sim(2));
    let px = a.alloc(128 * MIB, x).unwrap();
    let wx = sim.launch(x, px.0, 128 * MIB);
    a.free(px, x).unwrap();
    // From now on, every fence on x fails; each slow path below tries one.
    w.break_stream(Some(x));
    let q: Vec<_> = (0..3).map(|_| a.alloc(128 * MIB, s1).unwrap()).collect();
    a.free(q[0], s1).unwrap();
    a.record_stream(q[2], s2).unwrap();
    a.free(q[2], s1).unwrap(); // pending: waits for s1 and s2
                               // The device is full; 256 MiB needs q[0] and q[2] stitched together, which needs s1's
                               // fence and the pending free: a slow path that also tries to fence x.
    let big = a.alloc(256 * MIB, s2).unwrap();
    assert!(w.refused_records() >= 1, "x was asked for a fence");
    assert!(a.stats().stitches >= 1);
    assert_eq!(a.stats().pending_free, 0);
    assert!(!overlaps(big.0, 256 * MIB, px.0, 128 * MIB));
    assert!(!sim.work_done(wx), "nobody waited for x");
    // x still reuses its own memory (stream order makes that safe).
    let again = a.alloc(128 * MIB, x).unwrap();
    assert_eq!(again, px);
    a.free(again, x).unwrap();
    // More slow paths keep working.
    a.free(big, s2).unwrap();
    let big2 = a.alloc(256 * MIB, s1).unwrap();
    a.free(big2, s1).unwrap();
    assert!(w.refused_unmaps.lock().is_empty(), "{:?}", w.refused_unmaps);
    // Once x works again its memory comes back.
    w.break_stream(None);
    sim.complete(x, None);
    a.free(q[1], s1).unwrap();
    let all = a.alloc(512 * MIB, s1).unwrap();
    a.free(all, s1).unwrap();
    drop(a);
    assert!(w.refused_unmaps.lock().is_empty(), "{:?}", w.refused_unmaps);
    assert!(sim.leak_report().is_clean());
}

/// Defect 3: `retire_stream` on a stream that cannot be fenced any more reports it and
/// quarantines the stream's frees; no later slow path or teardown records on it again.
#[test]
fn retiring_a_broken_stream_stops_fencing_it() {
    let sim = Arc::new(SimDriver::with_capacity(GIB));
    let w = Watched::new(sim.clone());
    let cfg = Config::default()
        .with_capacity(Capacity::Bytes(512 * MIB))
        .with_paranoid(true);
    let a = Allocator::new(w.clone(), cfg).unwrap();
    let (x, s1) = (Stream::sim(9), Stream::sim(1));
    let px = a.alloc(128 * MIB, x).unwrap();
    a.free(px, x).unwrap();
    let q = a.alloc(64 * MIB, x).unwrap();
    a.record_stream(q, s1).unwrap();
    w.break_stream(Some(x));
    // The multi-stream free cannot fence x either.
    a.free(q, s1).unwrap();
    assert!(a.retire_stream(x).is_err(), "x's frees cannot be fenced");
    let refused = w.refused_records();
    for _ in 0..3 {
        let p = a.alloc(256 * MIB, s1).unwrap();
        a.free(p, s1).unwrap();
        a.empty_cache().unwrap();
    }
    drop(a);
    assert_eq!(w.refused_records(), refused, "x was never asked again");
    assert!(w.refused_unmaps.lock().is_empty(), "{:?}", w.refused_unmaps);
    assert!(sim.leak_report().is_clean());
}

/// Defect 7: when a free of memory used on several streams could not record its events, the
/// free failed and the block stayed live, while the caller had forgotten the pointer: a leak.
/// Now the free succeeds; the streams not yet fenced are fenced on a later slow path.
#[test]
fn a_failed_multi_stream_free_does_not_leak_the_block() {
    let sim = Arc::new(SimDriver::with_capacity(GIB));
    let f = FaultyDriver::new(sim.clone());
    let cfg = Config::default()
        .with_capacity(Capacity::Bytes(512 * MIB))
        .with_paranoid(true);
    let a = Allocator::new(f, cfg).unwrap();
    let (s1, s2, s3) = (Stream::sim(1), Stream::sim(2), Stream::sim(3));
    let p = a.alloc(256 * MIB, s1).unwrap();
    a.record_stream(p, s2).unwrap();
    let work = sim.launch(s2, p.0, 256 * MIB);
    // The free records one event per stream; the second record (s2's) fails.
    a.driver().fail_nth(DriverOp::RecordEvent, 2);
    a.free(p, s1).unwrap();
    assert_eq!(a.driver().faults_fired(), 1);
    let st = a.stats();
    assert_eq!(st.live_allocations.current, 0);
    assert_eq!(st.requested.current, 0);
    assert_eq!(st.allocated.current, 0);
    assert_eq!(st.pending_free, 256 * MIB);
    assert!(
        a.free(p, s1).is_err(),
        "it is freed: a second free is refused"
    );
    // Still in use by s2: nobody gets it yet.
    let r = a.alloc(256 * MIB, s3).unwrap();
    assert!(!overlaps(r.0, 256 * MIB, p.0, 256 * MIB));
    assert!(!sim.work_done(work));
    a.free(r, s3).unwrap();
    sim.complete(s2, None);
    // Eventually the memory is reusable: the whole capacity at once.
    let all = a.alloc(512 * MIB, s3).unwrap();
    a.free(all, s3).unwrap();
    assert_eq!(a.stats().pending_free, 0);
    let report = a.shutdown();
    assert_eq!(report.leaked_allocations, 0);
    drop(a);
    assert!(sim.leak_report().is_clean());
}

/// Defect 11: teardown unmapped live allocations without waiting for the work queued on
/// them (the simulator refused the unmap: on a GPU, a use-after-free).
#[test]
fn teardown_waits_for_work_on_live_memory() {
    let sim = Arc::new(SimDriver::with_capacity(GIB));
    let w = Watched::new(sim.clone());
    let a = Allocator::new(w.clone(), Config::default().with_paranoid(true)).unwrap();
    let (s1, s2) = (Stream::sim(1), Stream::sim(2));
    let p = a.alloc(64 * MIB, s1).unwrap();
    sim.launch(s1, p.0, 64 * MIB);
    let q = a.alloc(32 * MIB, s1).unwrap();
    a.record_stream(q, s2).unwrap();
    sim.launch(s2, q.0, 32 * MIB);
    let report = a.shutdown();
    assert_eq!(report.leaked_allocations, 2);
    assert!(w.refused_unmaps.lock().is_empty(), "{:?}", w.refused_unmaps);
    assert_eq!(sim.in_flight(), 0, "teardown waited for the work");
    drop(a);
    assert!(sim.leak_report().is_clean(), "{:?}", sim.leak_report());
}

/// Defect 8 (the first half): a slow path that found no room waited for every in-flight
/// free on every stream, though one stream's frees were enough. Now it waits for the fence
/// that frees the most, tries again, and waits for more only if that was not enough.
#[test]
fn a_slow_path_waits_only_for_what_the_request_needs() {
    let sim = Arc::new(SimDriver::with_capacity(GIB));
    let cfg = Config::default().with_capacity(Capacity::Bytes(256 * MIB));
    let a = Allocator::new(sim.clone(), cfg).unwrap();
    let (s1, s2, s3) = (Stream::sim(1), Stream::sim(2), Stream::sim(3));
    let big = a.alloc(120 * MIB, s1).unwrap();
    let small = a.alloc(100 * MIB, s2).unwrap();
    let w1 = sim.launch(s1, big.0, 120 * MIB);
    let w2 = sim.launch(s2, small.0, 100 * MIB);
    a.free(big, s1).unwrap();
    a.free(small, s2).unwrap();
    // 220 MiB in flight, 36 MiB never used: 90 MiB needs one of the two streams' frees.
    let p = a.alloc(90 * MIB, s3).unwrap();
    let st = a.stats();
    assert_eq!(st.event_waits, 1, "one wait is enough");
    assert!(
        sim.work_done(w1),
        "the larger in-flight free was waited for"
    );
    assert!(
        !sim.work_done(w2),
        "the other stream's work was not waited for"
    );
    a.free(p, s3).unwrap();
    a.validate().unwrap();
    sim.complete_all();
    drop(a);
    assert!(sim.leak_report().is_clean());
}

/// A simulator whose `wait_event` blocks until the test opens the gate: a slow path that
/// waits for the device stays in its wait as long as the test likes.
struct Gated {
    sim: Arc<SimDriver>,
    open: Mutex<bool>,
    cv: parking_lot::Condvar,
    /// Waits that have entered the gate so far.
    entered: AtomicU64,
}

impl Forward for Gated {
    type Inner = SimDriver;
    fn inner(&self) -> &SimDriver {
        &self.sim
    }
    fn before(&self, call: &Call) -> DriverResult<()> {
        if let Call::WaitEvent { .. } = call {
            self.entered.fetch_add(1, Ordering::SeqCst);
            let mut open = self.open.lock();
            while !*open {
                self.cv.wait(&mut open);
            }
        }
        Ok(())
    }
}

/// Defect 8 (the second half): the slow path waited for the device while holding the lock
/// that every allocation and free takes, so a fast-path allocation or free on another thread
/// (autograd, a NCCL watchdog, a host callback freeing on the awaited stream) queued behind
/// a long kernel, or deadlocked. Now the wait runs without the lock.
#[test]
fn a_fast_path_goes_on_while_a_slow_path_waits_for_the_device() {
    let sim = Arc::new(SimDriver::with_capacity(GIB));
    let g = Arc::new(Gated {
        sim: sim.clone(),
        open: Mutex::new(false),
        cv: parking_lot::Condvar::new(),
        entered: AtomicU64::new(0),
    });
    let cfg = Config::default().with_capacity(Capacity::Bytes(256 * MIB));
    let a = Arc::new(Allocator::new(g.clone(), cfg).unwrap());
    let (s1, s2) = (Stream::sim(1), Stream::sim(2));
    // A small page, warm, for the other thread's fast path.
    let warm = a.alloc(4096, s2).unwrap();
    a.free(warm, s2).unwrap();
    let big = a.alloc(200 * MIB, s1).unwrap();
    sim.launch(s1, big.0, 200 * MIB); // the "long kernel"
    a.free(big, s1).unwrap();
    let waiter = {
        let a = a.clone();
        std::thread::spawn(move || a.alloc(150 * MIB, s2))
    };
    let t0 = std::time::Instant::now();
    while g.entered.load(Ordering::SeqCst) == 0 {
        assert!(t0.elapsed().as_secs() < 20, "the slow path never waited");
        std::thread::yield_now();
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let fast = {
        let a = a.clone();
        std::thread::spawn(move || {
            let p = a.alloc(4096, s2).unwrap();
            a.free(p, s2).unwrap();
            tx.send(()).unwrap();
        })
    };
    let went_on = rx.recv_timeout(std::time::Duration::from_secs(5)).is_ok();
    *g.open.lock() = true;
    g.cv.notify_all();
    fast.join().unwrap();
    let p = waiter.join().unwrap().unwrap();
    assert!(
        went_on,
        "a fast-path alloc and free waited for another thread's wait on the device"
    );
    a.free(p, s2).unwrap();
    a.validate().unwrap();
    sim.complete_all();
}

/// A simulator on which the test marks one stream as capturing a CUDA graph, counting the
/// events recorded on that stream meanwhile.
struct Capturing {
    sim: Arc<SimDriver>,
    /// Raw value of the capturing stream (`u64::MAX`: none).
    stream: AtomicU64,
    /// Events recorded on it while it was capturing.
    recorded_while_capturing: AtomicU64,
}

impl Forward for Capturing {
    type Inner = SimDriver;
    fn inner(&self) -> &SimDriver {
        &self.sim
    }
    fn before(&self, call: &Call) -> DriverResult<()> {
        if let Call::RecordEvent { stream } = call {
            if stream.raw() == self.stream.load(Ordering::SeqCst) {
                self.recorded_while_capturing.fetch_add(1, Ordering::SeqCst);
            }
        }
        Ok(())
    }
    fn forward_stream_capturing(&self, stream: Stream) -> DriverResult<bool> {
        Ok(stream.raw() == self.stream.load(Ordering::SeqCst))
    }
}

/// Found by the torch soak on the H200 (design/gpu-results.md, run 20): a slow path on one
/// thread fenced every dirty stream, including one that another thread was capturing a CUDA
/// graph on; the event record invalidated that capture. Now a capturing stream is fenced once
/// its capture has ended, and its frees stay its own until then.
#[test]
fn no_event_is_recorded_on_a_stream_that_is_capturing() {
    let sim = Arc::new(SimDriver::with_capacity(GIB));
    let c = Arc::new(Capturing {
        sim: sim.clone(),
        stream: AtomicU64::new(u64::MAX),
        recorded_while_capturing: AtomicU64::new(0),
    });
    let cfg = Config::default().with_capacity(Capacity::Bytes(256 * MIB));
    let a = Allocator::new(c.clone(), cfg).unwrap();
    let (s1, s2) = (Stream::sim(1), Stream::sim(2));
    let p = a.alloc(100 * MIB, s1).unwrap();
    sim.launch(s1, p.0, 100 * MIB);
    a.free(p, s1).unwrap(); // dirty on s1
    c.stream.store(s1.raw(), Ordering::SeqCst); // s1 starts capturing
                                                // Slow paths on s2: the first creates memory, the last finds no room.
    let q = a.alloc(150 * MIB, s2).unwrap();
    assert!(
        a.alloc(90 * MIB, s2).is_err(),
        "s1's frees are not usable by s2 yet"
    );
    assert_eq!(c.recorded_while_capturing.load(Ordering::SeqCst), 0);
    // The capture ends: the next slow path fences s1, and its memory serves s2.
    c.stream.store(u64::MAX, Ordering::SeqCst);
    let r = a.alloc(90 * MIB, s2).unwrap();
    a.free(q, s2).unwrap();
    a.free(r, s2).unwrap();
    a.validate().unwrap();
    sim.complete_all();
}
