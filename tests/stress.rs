//! Concurrency stress: many threads allocating, freeing their own and each other's memory
//! (through channels), on several streams; no address is ever handed out twice while live,
//! and every invariant holds at the end.

use crossbeam::channel;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use stitch_alloc::driver::SimDriver;
use stitch_alloc::{Allocator, Capacity, Config, DevicePtr, Stream};

const MIB: u64 = 1 << 20;

fn stress(threads: usize, ops_per_thread: usize, cfg: Config) -> (u64, u64) {
    let dev = Arc::new(SimDriver::with_capacity(8 << 30));
    let a = Allocator::new(dev.clone(), cfg).unwrap();
    // Ownership ledger: address -> (size, owner thread). Checked on every alloc and free.
    let owned: Mutex<HashMap<u64, u64>> = Mutex::new(HashMap::new());
    let (tx, rx) = channel::bounded::<(DevicePtr, Stream)>(256);
    crossbeam::scope(|s| {
        for t in 0..threads {
            let (a, owned, tx, rx) = (&a, &owned, tx.clone(), rx.clone());
            s.spawn(move |_| {
                let mut seed = 0x9e37_79b9_7f4a_7c15u64 ^ (t as u64 + 1);
                let mut rnd = move || {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    seed
                };
                let mut mine: Vec<(DevicePtr, u64, Stream)> = Vec::new();
                for _ in 0..ops_per_thread {
                    let r = rnd();
                    match r % 8 {
                        0..=3 => {
                            let size = match r >> 8 & 3 {
                                0 | 1 => 1 + (r >> 16) % (64 << 10),
                                2 => 1 + (r >> 16) % (8 * MIB),
                                _ => 1 + (r >> 16) % (128 * MIB),
                            };
                            let stream = Stream::sim((r >> 40) % 3);
                            if let Ok(p) = a.alloc(size, stream) {
                                let mut o = owned.lock().unwrap();
                                // No live allocation may overlap the new one.
                                for (&q, &qs) in o.iter() {
                                    assert!(
                                        q + qs <= p.0 || p.0 + size <= q,
                                        "{p} handed out while {q:#x}+{qs} is live"
                                    );
                                }
                                o.insert(p.0, size);
                                drop(o);
                                mine.push((p, size, stream));
                            }
                        }
                        4 | 5 if !mine.is_empty() => {
                            let (p, _, st) = mine.swap_remove((r >> 8) as usize % mine.len());
                            owned.lock().unwrap().remove(&p.0).expect("owned");
                            a.free(p, st).unwrap();
                        }
                        6 if !mine.is_empty() => {
                            // Hand it to another thread to free.
                            let (p, _, st) = mine.swap_remove((r >> 8) as usize % mine.len());
                            if let Err(e) = tx.try_send((p, st)) {
                                let (p, st) = e.into_inner();
                                owned.lock().unwrap().remove(&p.0).expect("owned");
                                a.free(p, st).unwrap();
                            }
                        }
                        _ => {
                            while let Ok((p, st)) = rx.try_recv() {
                                owned.lock().unwrap().remove(&p.0).expect("owned");
                                a.free(p, st).unwrap();
                            }
                        }
                    }
                }
                for (p, _, st) in mine {
                    owned.lock().unwrap().remove(&p.0).expect("owned");
                    a.free(p, st).unwrap();
                }
            });
        }
        drop(tx);
    })
    .unwrap();
    while let Ok((p, st)) = rx.try_recv() {
        owned.lock().unwrap().remove(&p.0).expect("owned");
        a.free(p, st).unwrap();
    }
    assert!(owned.lock().unwrap().is_empty());
    a.validate().unwrap();
    let s = a.stats();
    assert_eq!(s.live_allocations.current, 0);
    assert_eq!(s.requested.current, 0);
    drop(a);
    assert!(dev.leak_report().is_clean());
    (s.allocs, s.stitches)
}

#[test]
fn eight_threads_default_policy() {
    let (allocs, _) = stress(8, 4000, Config::default());
    assert!(allocs > 10_000);
}

#[test]
fn eight_threads_tight_reuse_first() {
    // 1 GiB cap, no growth slack: stitching runs under contention.
    let cfg = Config::default()
        .with_capacity(Capacity::Bytes(1 << 30))
        .with_reserve_slack(0.0, 0);
    let (allocs, stitches) = stress(8, 3000, cfg);
    assert!(allocs > 5_000);
    assert!(stitches > 0, "the tight run must stitch");
}
