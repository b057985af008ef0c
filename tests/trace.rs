//! Trace formats, generators, replay and the `stitch` command line.

use serde_pickle::{HashableValue, SerOptions, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use stitch_alloc::driver::{CallCounts, SimDriver};
use stitch_alloc::replay::{replay, Meter, Metered, ReplayOptions};
use stitch_alloc::trace::gen::{self, Kind, Rng, Scale};
use stitch_alloc::trace::{self, Event, Format, ReadOptions, Trace, TraceError};
use stitch_alloc::{Allocator, Config};

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}

fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("stitch-trace-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn read(name: &str) -> Result<Trace, TraceError> {
    trace::read_path(data(name), ReadOptions::default())
}

// ----- text format -----

#[test]
fn text_round_trip_every_generator() {
    for kind in Kind::ALL {
        let t = gen::generate(kind, 11, Scale::Small);
        t.validate().unwrap();
        let text = t.to_text();
        let back = Trace::parse_str(&text).unwrap();
        assert_eq!(back, t, "{kind:?}");
        assert_eq!(back.to_text(), text);
    }
}

#[test]
fn text_format_details() {
    let t = Trace::parse_str(
        "# header\n\n  a 5 100\t3\r\na 6 7\n# probe-largest\nf 6 7 3\nf 5\n   # indented comment\n",
    )
    .unwrap();
    assert_eq!(
        t.events,
        vec![
            Event::Alloc {
                id: 5,
                bytes: 100,
                stream: 3
            },
            Event::Alloc {
                id: 6,
                bytes: 7,
                stream: 0
            },
            Event::ProbeLargest,
            Event::Free {
                id: 6,
                stream: Some(3)
            },
            Event::Free {
                id: 5,
                stream: None
            },
        ]
    );
    // Ids may be reused once freed.
    Trace::parse_str("a 1 10\nf 1\na 1 20\nf 1\n").unwrap();
    // A free may give its size without a stream.
    Trace::parse_str("a 1 10\nf 1 10\n").unwrap();
}

#[test]
fn gzip_by_extension_and_by_magic() {
    let t = gen::generate(Kind::Llm, 3, Scale::Small);
    let gz = tmp("x.trace.gz");
    t.write_path(&gz).unwrap();
    let bytes = std::fs::read(&gz).unwrap();
    assert!(trace::is_gzip(&bytes));
    assert_eq!(trace::read_path(&gz, ReadOptions::default()).unwrap(), t);
    // Same bytes under a name without .gz: detected by the magic number.
    let renamed = tmp("x-no-extension.trace");
    std::fs::write(&renamed, &bytes).unwrap();
    assert_eq!(
        trace::read_path(&renamed, ReadOptions::default()).unwrap(),
        t
    );
    // Plain text is not compressed.
    let plain = tmp("x.trace");
    t.write_path(&plain).unwrap();
    assert!(!trace::is_gzip(&std::fs::read(&plain).unwrap()));
    assert_eq!(trace::read_path(&plain, ReadOptions::default()).unwrap(), t);
}

#[test]
fn bad_inputs_name_the_line() {
    use TraceError as E;
    type Check = Box<dyn Fn(&TraceError) -> bool>;
    let cases: Vec<(&str, Check)> = vec![
        (
            "bad/unknown-action.trace",
            Box::new(|e| matches!(e, E::UnknownAction { line: 5, action } if action == "x")),
        ),
        (
            "bad/bad-number.trace",
            Box::new(
                |e| matches!(e, E::BadNumber { line: 3, field: "bytes", text } if text == "12x"),
            ),
        ),
        (
            "bad/missing-field.trace",
            Box::new(|e| {
                matches!(
                    e,
                    E::MissingField {
                        line: 2,
                        field: "bytes"
                    }
                )
            }),
        ),
        (
            "bad/unknown-id.trace",
            Box::new(|e| matches!(e, E::UnknownId { line: 4, id: 9 })),
        ),
        (
            "bad/duplicate-id.trace",
            Box::new(|e| matches!(e, E::DuplicateId { line: 3, id: 1 })),
        ),
        (
            "bad/zero-size.trace",
            Box::new(|e| matches!(e, E::AbsurdSize { line: 2, bytes: 0 })),
        ),
        (
            "bad/huge-size.trace",
            Box::new(|e| {
                matches!(
                    e,
                    E::AbsurdSize {
                        line: 3,
                        bytes: 2_000_000_000_000_000_000
                    }
                )
            }),
        ),
        (
            "bad/overflow.trace",
            Box::new(|e| {
                matches!(
                    e,
                    E::BadNumber {
                        line: 2,
                        field: "id",
                        ..
                    }
                )
            }),
        ),
        (
            "bad/size-mismatch.trace",
            Box::new(|e| {
                matches!(
                    e,
                    E::SizeMismatch {
                        line: 3,
                        id: 1,
                        expected: 4096,
                        found: 4097
                    }
                )
            }),
        ),
        (
            "bad/extra-field.trace",
            Box::new(|e| matches!(e, E::ExtraField { line: 2, text } if text == "9")),
        ),
        (
            "bad/truncated.trace.gz",
            Box::new(|e| matches!(e, E::Gzip { line, .. } if *line > 1)),
        ),
        (
            "bad/not-a-snapshot.pickle",
            Box::new(|e| matches!(e, E::Snapshot(m) if m.contains("not a dict"))),
        ),
        (
            "bad/no-device-traces.pickle",
            Box::new(|e| matches!(e, E::Snapshot(m) if m.contains("device_traces"))),
        ),
        (
            "bad/garbage.pickle",
            Box::new(|e| matches!(e, E::Snapshot(m) if m.contains("unpickle"))),
        ),
        (
            "bad/snapshot-missing-addr.pickle",
            Box::new(
                |e| matches!(e, E::SnapshotEvent { device: 0, index: 2, message } if message.contains("addr")),
            ),
        ),
    ];
    for (file, ok) in cases {
        let e = read(file).expect_err(file);
        assert!(ok(&e), "{file}: unexpected error {e:?}");
        // The message names the place.
        let msg = e.to_string();
        assert!(
            msg.contains("line") || msg.contains("event") || msg.contains("snapshot"),
            "{file}: {msg}"
        );
    }
}

#[test]
fn missing_file_is_an_error() {
    let e = trace::read_path(data("no-such-file.trace"), ReadOptions::default()).unwrap_err();
    assert!(matches!(e, TraceError::Io { .. }));
}

#[test]
fn garbage_never_panics() {
    let good = gen::generate(Kind::Adversarial, 5, Scale::Small)
        .to_text()
        .into_bytes();
    let gz = {
        let p = tmp("g.trace.gz");
        gen::generate(Kind::Train, 5, Scale::Small)
            .write_path(&p)
            .unwrap();
        std::fs::read(p).unwrap()
    };
    let pickle = std::fs::read(data("torch-small.pickle")).unwrap();
    let mut r = Rng::new(99);
    for round in 0..300 {
        let base: &[u8] = match round % 3 {
            0 => &good[..good.len().min(4000)],
            1 => &gz,
            _ => &pickle,
        };
        let mut v = base.to_vec();
        // Mutate a few bytes, sometimes truncate.
        for _ in 0..r.range(1, 8) {
            let i = r.below(v.len() as u64) as usize;
            v[i] = r.next_u64() as u8;
        }
        if r.chance(0.3) {
            v.truncate(r.below(v.len() as u64) as usize);
        }
        for format in [Format::Auto, Format::Text, Format::PyTorch] {
            let _ = trace::read_bytes(
                &v,
                ReadOptions {
                    format,
                    device: None,
                },
            );
        }
    }
    // Pure random bytes.
    for _ in 0..100 {
        let n = r.below(300) as usize;
        let v: Vec<u8> = (0..n).map(|_| r.next_u64() as u8).collect();
        let _ = trace::read_bytes(&v, ReadOptions::default());
    }
}

// ----- PyTorch snapshots -----

#[test]
fn real_pytorch_snapshot() {
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(data("torch-small.expected.json")).unwrap())
            .unwrap();
    let n_alloc = expected["actions"]["alloc"].as_u64().unwrap();
    let n_free = expected["actions"]["free_requested"].as_u64().unwrap();
    for name in ["torch-small.pickle", "torch-small.pickle.gz"] {
        let t = read(name).unwrap();
        t.validate().unwrap();
        let s = t.summary();
        // One tensor was allocated before recording began and freed during it.
        assert_eq!(s.allocs, n_alloc + 1, "{name}");
        assert_eq!(s.frees, n_free, "{name}");
        assert_eq!(s.streams, expected["alloc_streams"].as_u64().unwrap());
        assert!(
            matches!(t.events[0], Event::Alloc { bytes, stream: 0, .. } if bytes == 3 * (1 << 20) + 512)
        );
        let a = Allocator::new(SimDriver::new(), Config::default().with_paranoid(true)).unwrap();
        let r = replay(&t, &a, &ReplayOptions::default());
        assert_eq!(r.failed_allocs + r.failed_frees, 0);
        a.validate().unwrap();
    }
}

/// Hands out at most `chunk` bytes per read, so the streaming decoder refills its buffer
/// in the middle of opcodes and arguments.
struct Trickle<'a> {
    rest: &'a [u8],
    chunk: usize,
}

impl std::io::Read for Trickle<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = buf.len().min(self.chunk).min(self.rest.len());
        buf[..n].copy_from_slice(&self.rest[..n]);
        self.rest = &self.rest[n..];
        Ok(n)
    }
}

#[test]
fn snapshots_read_in_small_pieces_decode_the_same() {
    use stitch_alloc::trace::pytorch::{parse_snapshot_recorded, read_snapshot};
    let gunzip = |name: &str| {
        let mut v = Vec::new();
        let f = std::fs::File::open(data(name)).unwrap();
        std::io::Read::read_to_end(&mut flate2::read::MultiGzDecoder::new(f), &mut v).unwrap();
        v
    };
    // A snapshot with stack traces, and one of the zoo's (stacks off, 142 k entries).
    for bytes in [
        std::fs::read(data("torch-small.pickle")).unwrap(),
        gunzip("zoo/bert-encode.pickle.gz"),
    ] {
        let whole = parse_snapshot_recorded(&bytes, None).unwrap();
        assert!(whole.1.is_some());
        for chunk in [1, 7, 4093] {
            if chunk == 1 && bytes.len() > 100_000 {
                continue;
            }
            let rest = &bytes[..];
            let got = read_snapshot(Trickle { rest, chunk }, None).unwrap();
            assert_eq!(got, whole, "chunk {chunk}");
        }
        // Cut anywhere: an error naming the truncation, never a panic or a trace.
        for cut in [1, bytes.len() / 3, bytes.len() - 1] {
            let e = parse_snapshot_recorded(&bytes[..cut], None).unwrap_err();
            assert!(
                matches!(&e, TraceError::Snapshot(m) if m.contains("truncated pickle")),
                "{cut}: {e}"
            );
        }
    }
    // A cut gzip stream is a read error that says so.
    let gz = std::fs::read(data("torch-small.pickle.gz")).unwrap();
    let e = trace::read_bytes(&gz[..gz.len() / 2], ReadOptions::default()).unwrap_err();
    assert!(
        matches!(&e, TraceError::Snapshot(m) if m.contains("gzip") || m.contains("truncated")),
        "{e}"
    );
}

fn d(pairs: &[(&str, Value)]) -> Value {
    Value::Dict(
        pairs
            .iter()
            .map(|(k, v)| (HashableValue::String(k.to_string()), v.clone()))
            .collect::<BTreeMap<_, _>>(),
    )
}

fn ev(action: &str, addr: i64, size: i64, stream: Value) -> Value {
    d(&[
        ("action", Value::String(action.into())),
        ("addr", Value::I64(addr)),
        ("size", Value::I64(size)),
        ("stream", stream),
        ("time_us", Value::I64(12345)),
        (
            "frames",
            Value::List(vec![d(&[("name", Value::String("f".into()))])]),
        ),
    ])
}

fn snapshot(devices: Vec<Vec<Value>>) -> Vec<u8> {
    let v = d(&[
        ("segments", Value::List(vec![])),
        (
            "device_traces",
            Value::List(devices.into_iter().map(Value::List).collect()),
        ),
        ("allocator_settings", d(&[])),
    ]);
    serde_pickle::value_to_vec(&v, SerOptions::new()).unwrap()
}

#[test]
fn synthetic_pytorch_snapshots() {
    let s0 = || Value::I64(0);
    let big_stream = Value::I64(0x7f00_dead_beef);
    // free_requested is the free; free_completed is ignored; pre-recording memory is
    // allocated first; streams are kept; extra keys are fine.
    let bytes = snapshot(vec![
        vec![],
        vec![
            ev("alloc", 4096, 100, s0()),
            ev("segment_alloc", 0, 2 << 20, s0()),
            ev("free_requested", 8192, 300, big_stream.clone()),
            ev("free_completed", 8192, 300, big_stream.clone()),
            ev("alloc", 16384, 50, big_stream.clone()),
            ev("free_requested", 4096, 100, s0()),
            ev("oom", 0, 0, s0()),
            ev("free_completed", 4096, 100, s0()),
            ev("alloc", 4096, 70, s0()),
        ],
    ]);
    let t = trace::read_bytes(&bytes, ReadOptions::default()).unwrap();
    let bs = 0x7f00_dead_beef;
    assert_eq!(
        t.events,
        vec![
            Event::Alloc {
                id: 1,
                bytes: 300,
                stream: bs
            },
            Event::Alloc {
                id: 0,
                bytes: 100,
                stream: 0
            },
            Event::Free {
                id: 1,
                stream: Some(bs)
            },
            Event::Alloc {
                id: 2,
                bytes: 50,
                stream: bs
            },
            Event::Free {
                id: 0,
                stream: Some(0)
            },
            Event::Alloc {
                id: 3,
                bytes: 70,
                stream: 0
            },
        ]
    );
    // Device selection: device 0 is empty.
    let e = trace::read_bytes(
        &bytes,
        ReadOptions {
            device: Some(0),
            ..Default::default()
        },
    )
    .unwrap();
    assert!(e.events.is_empty());
    let e = trace::read_bytes(
        &bytes,
        ReadOptions {
            device: Some(5),
            ..Default::default()
        },
    )
    .unwrap_err();
    assert!(
        matches!(&e, TraceError::Snapshot(m) if m.contains("device 5 asked for")),
        "{e}"
    );
    // Only free_completed recorded: it is taken as the free.
    let only_completed = snapshot(vec![vec![
        ev("alloc", 4096, 100, s0()),
        ev("free_completed", 4096, 100, s0()),
        ev("free_completed", 9999, 10, s0()),
    ]]);
    let t = trace::read_bytes(&only_completed, ReadOptions::default()).unwrap();
    assert_eq!(t.summary().allocs, 2);
    assert_eq!(t.summary().frees, 2);
    // Gzipped snapshots work too.
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    std::io::Write::write_all(&mut gz, &only_completed).unwrap();
    let gz = gz.finish().unwrap();
    assert_eq!(trace::read_bytes(&gz, ReadOptions::default()).unwrap(), t);
    // Errors name the event index.
    let bad = snapshot(vec![vec![
        ev("alloc", 4096, 100, s0()),
        ev("alloc", 4096, 100, s0()),
    ]]);
    let e = trace::read_bytes(&bad, ReadOptions::default()).unwrap_err();
    assert!(
        matches!(e, TraceError::SnapshotEvent { index: 1, .. }),
        "{e}"
    );
    let neg = snapshot(vec![vec![ev("alloc", -5, 100, s0())]]);
    let e = trace::read_bytes(&neg, ReadOptions::default()).unwrap_err();
    assert!(
        matches!(e, TraceError::SnapshotEvent { index: 0, .. }),
        "{e}"
    );
    let zero = snapshot(vec![vec![ev("alloc", 5, 0, s0())]]);
    let e = trace::read_bytes(&zero, ReadOptions::default()).unwrap_err();
    assert!(
        matches!(&e, TraceError::SnapshotEvent { index: 0, message, .. }
            if message.contains("0 bytes")),
        "{e}"
    );
}

// ----- generators -----

#[test]
fn generators_are_deterministic() {
    for kind in Kind::ALL {
        let a = gen::generate(kind, 42, Scale::Small).to_text();
        let b = gen::generate(kind, 42, Scale::Small).to_text();
        let c = gen::generate(kind, 43, Scale::Small).to_text();
        assert_eq!(a, b, "{kind:?}");
        if kind != Kind::Train || a != c {
            assert_ne!(a, c, "{kind:?}: the seed should matter");
        }
    }
    // The shipped traces are exactly what `stitch gen KIND --small --seed 1` writes.
    for (file, kind) in [
        ("llm-small.trace.gz", Kind::Llm),
        ("train-small.trace", Kind::Train),
        ("checkerboard-small.trace", Kind::Checkerboard),
        ("adversarial-small.trace.gz", Kind::Adversarial),
        ("serve-small.trace.gz", Kind::Serve),
    ] {
        assert_eq!(
            read(file).unwrap(),
            gen::generate(kind, 1, Scale::Small),
            "{file}"
        );
    }
}

#[test]
fn full_size_generators_match_the_brief() {
    let llm = gen::generate(Kind::Llm, 1, Scale::Full).summary();
    let events = llm.allocs + llm.frees;
    assert!((75_000..95_000).contains(&events), "{events} events");
    assert!(
        (36 * GIB..44 * GIB).contains(&llm.peak_live_bytes),
        "peak live {}",
        llm.peak_live_bytes
    );
    assert!(llm.small_allocs > llm.allocs / 2, "many small tensors");
    assert_eq!(llm.final_live_bytes, 0);
    let cb = gen::generate(Kind::Checkerboard, 1, Scale::Full).summary();
    assert!(cb.peak_live_bytes >= 129_000_000_000 - (300 << 20));
    assert_eq!(cb.probes, 1);
    let churn = gen::generate(Kind::Churn, 1, Scale::Full).summary();
    assert!(
        (8_000..10_000).contains(&(churn.allocs + churn.frees)),
        "{} churn events",
        churn.allocs + churn.frees
    );
    assert!(
        (24 * GIB..30 * GIB).contains(&churn.peak_live_bytes),
        "churn peak live {}",
        churn.peak_live_bytes
    );
    assert_eq!((churn.streams, churn.final_live_bytes), (1, 0));
    let adv = gen::generate(Kind::Adversarial, 1, Scale::Full).summary();
    assert_eq!(adv.streams, 4);
    assert!(adv.largest_alloc > GIB);
    serve_is_the_zoo_serving_loop();
}

/// `gen serve` at full size is the zoo's `serve` (design/zoo.md: 0.72 GiB peak): a 4-layer
/// model of 1536, 48 requests; each decode step re-allocates every layer's K and V one
/// token (3 KiB) longer, so the caches cross the 1 MiB small threshold as they grow.
fn serve_is_the_zoo_serving_loop() {
    let t = gen::generate(Kind::Serve, 1, Scale::Full);
    let s = t.summary();
    assert!(
        (600 * MIB..850 * MIB).contains(&s.peak_live_bytes),
        "peak live {}",
        s.peak_live_bytes
    );
    assert_eq!(s.final_live_bytes, 0);
    assert!(s.allocs > 200_000, "{} allocations", s.allocs);
    // Consecutive K re-allocations of one layer differ by one token: count allocations of
    // 1-4 MiB whose size is a multiple of 3 KiB (K and V of 342-1365 tokens, prefills).
    let row = 3 * 1024;
    let caches = t
        .events
        .iter()
        .filter(|e| {
            matches!(e, Event::Alloc { bytes, .. }
                if (MIB..4 * MIB).contains(bytes) && bytes % row == 0)
        })
        .count();
    assert!(caches > 10_000, "{caches} large K/V allocations");
}

// ----- replay -----

fn shipped() -> Vec<(&'static str, u64)> {
    vec![
        ("llm-small.trace.gz", 4 * GIB),
        ("train-small.trace", 4 * GIB),
        ("checkerboard-small.trace", 2 * GIB),
        ("adversarial-small.trace.gz", 4 * GIB),
        ("torch-small.pickle.gz", 4 * GIB),
        ("serve-small.trace.gz", GIB),
    ]
}

/// With the device lagging behind (simulated work that stays in flight for 200 events),
/// every shipped trace still replays without a failure under paranoid checks: the simulator
/// refuses any unmap of memory that queued work uses, so a stitch that moved memory still in
/// use would show up as a failed allocation. Some traces then stitch by aliasing.
#[test]
fn shipped_traces_replay_with_a_lagging_device() {
    let mut aliased = 0;
    for (file, cap) in shipped() {
        let t = read(file).unwrap();
        let sim = std::sync::Arc::new(SimDriver::with_capacity(cap));
        let a = Allocator::new(sim.clone(), Config::default().with_paranoid(true)).unwrap();
        let opts = ReplayOptions {
            gpu_lag: 200,
            ..Default::default()
        };
        let r = replay(&t, &a, &opts);
        assert_eq!(r.failed_allocs, 0, "{file}: {:?}", r.first_error);
        assert_eq!(r.failed_frees, 0, "{file}");
        assert_eq!(r.gpu_lag, 200);
        assert_eq!(
            sim.in_flight(),
            0,
            "{file}: the replay completes its work at the end"
        );
        a.validate().unwrap();
        aliased += a.stats().aliased_handles;
    }
    assert!(
        aliased > 0,
        "no trace stitched memory the device was still using"
    );
}

#[test]
fn shipped_traces_replay_cleanly_under_paranoid_checks() {
    for (file, cap) in shipped() {
        let t = read(file).unwrap();
        for stitching in [true, false] {
            let meter = Meter::new(Default::default());
            let a = Allocator::new(
                Metered::new(SimDriver::with_capacity(cap), meter.clone()),
                Config::default()
                    .with_paranoid(true)
                    .with_stitching(stitching),
            )
            .unwrap();
            let r = replay(
                &t,
                &a,
                &ReplayOptions {
                    meter: Some(meter),
                    timeline: true,
                    ..Default::default()
                },
            );
            assert_eq!(r.failed_allocs, 0, "{file}: {:?}", r.first_error);
            assert_eq!(r.failed_frees, 0, "{file}");
            assert_eq!(r.events as usize, t.op_count());
            a.validate().unwrap();
            assert!(r.ratio >= 1.0 && r.ratio < 3.0, "{file}: ratio {}", r.ratio);
            assert_eq!(r.peak_live_bytes, t.summary().peak_live_bytes, "{file}");
            assert!(r.modeled_driver_us > 0.0);
            assert_eq!(r.cost_basis, "exact-sizes");
            let tl = r.timeline.as_ref().unwrap();
            assert_eq!(tl.live.len(), t.events.len());
            assert!(tl.stitches.len() as u64 <= r.stitches);
            if !stitching {
                assert_eq!(r.stitches, 0);
            }
        }
    }
}

/// The checkerboard guarantee (issue 11 item 5), measured as `stitch demo` and `stitch replay`
/// do (the probe after the fill-and-free-every-other-one trace, on a simulated H200): the
/// largest tensor is at least 99.8% of free memory with either growth layout. With
/// contiguous growth this needs large tensors to start at a handle boundary instead of
/// inside their live neighbour's last handle (placement.rs `ALIGN_RATIO`): sharing it left
/// 98.9-99.1%.
#[test]
fn checkerboard_largest_tensor_is_998_permille_of_free_with_either_layout() {
    for seed in 1..=3 {
        let t = gen::generate(Kind::Checkerboard, seed, Scale::Full);
        for contiguous in [false, true] {
            let cfg = Config::default().with_contiguous(contiguous);
            let a = Allocator::new(SimDriver::new(), cfg).unwrap();
            let r = replay(&t, &a, &ReplayOptions::default());
            let p = r.probes.last().expect("the trace probes");
            assert!(
                p.fraction_of_free >= 0.998,
                "seed {seed}, contiguous {contiguous}: {p:?}"
            );
        }
    }
}

#[test]
fn checkerboard_probe_finds_all_reclaimable_memory() {
    let t = read("checkerboard-small.trace").unwrap();
    let a = Allocator::new(SimDriver::with_capacity(2 * GIB), Config::default()).unwrap();
    let r = replay(&t, &a, &ReplayOptions::default());
    let p = &r.probes[0];
    assert_eq!(r.largest_alloc_after, Some(p.largest_bytes));
    assert!(p.fraction_of_reclaimable >= 0.999, "{p:?}");
    assert!(p.fraction_of_free > 0.95, "{p:?}");
    assert!(p.first_success_us > 0.0);
    // The probe left what is live unchanged.
    assert_eq!(r.final_live_bytes, 0);
    assert_eq!(a.stats().live_allocations.current, 0);
    // Counted cost basis without a meter.
    assert_eq!(r.cost_basis, "counts");
}

#[test]
fn replay_stops_where_asked_and_counts_failures() {
    let t = Trace::parse_str("a 1 1048576000\na 2 1048576000\na 3 1048576000\nf 3\nf 1\n").unwrap();
    let a = Allocator::new(SimDriver::with_capacity(2 * GIB), Config::default()).unwrap();
    let r = replay(&t, &a, &ReplayOptions::default());
    assert_eq!((r.allocs, r.failed_allocs, r.skipped_frees), (3, 1, 1));
    assert!(r.first_error.unwrap().contains("event 2"));
    let a = Allocator::new(SimDriver::with_capacity(2 * GIB), Config::default()).unwrap();
    let r = replay(
        &t,
        &a,
        &ReplayOptions {
            stop_after: Some(2),
            ..Default::default()
        },
    );
    assert_eq!((r.events, r.failed_allocs), (2, 0));
    assert_eq!(a.stats().live_allocations.current, 2);
}

// ----- the command line -----

/// The `stitch` binary: Cargo's, or `STITCH_BIN` where the test binary runs elsewhere (the
/// GPU bundle of scripts/gpu-check.sh).
fn stitch(args: &[&str]) -> std::process::Output {
    let bin = std::env::var_os("STITCH_BIN")
        .unwrap_or_else(|| std::ffi::OsString::from(env!("CARGO_BIN_EXE_stitch")));
    Command::new(bin).args(args).output().expect("run stitch")
}

fn json(args: &[&str]) -> serde_json::Value {
    let out = stitch(args);
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(text.trim().lines().count(), 1, "exactly one JSON line");
    serde_json::from_str(text.trim()).unwrap()
}

#[test]
fn cli_replay_json_has_every_key() {
    let f = data("llm-small.trace.gz");
    let v = json(&["replay", f.to_str().unwrap(), "--json"]);
    for k in [
        "events",
        "allocs",
        "failed_allocs",
        "peak_live_bytes",
        "peak_reserved_bytes",
        "ratio",
        "repeated_stitches",
        "stranded_bytes_at_peak",
        "driver_calls",
        "modeled_driver_us",
        "wall_ms",
    ] {
        assert!(v.get(k).is_some(), "missing key {k}: {v}");
    }
    for k in ["reserve", "create", "release", "map", "unmap", "set_access"] {
        assert!(v["driver_calls"][k].is_u64(), "driver_calls.{k}: {v}");
    }
    assert_eq!(v["failed_allocs"], 0);
    assert!(v["ratio"].as_f64().unwrap() >= 1.0);
    assert!(v["modeled_driver_us"].as_f64().unwrap() > 0.0);
    // The CLI replays through a meter: the driver time by tenth of the events is there and
    // adds up to no more than the whole.
    let tenths: Vec<f64> = v["modeled_driver_us_by_tenth"]
        .as_array()
        .expect("modeled_driver_us_by_tenth")
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    assert_eq!(tenths.len(), 10);
    assert!(tenths.iter().sum::<f64>() <= v["modeled_driver_us"].as_f64().unwrap() + 1e-6);
    // PyTorch snapshots replay from the command line too.
    let p = data("torch-small.pickle");
    let v = json(&["replay", p.to_str().unwrap(), "--json", "--backend", "sim"]);
    assert_eq!(v["failed_allocs"], 0);
}

#[test]
fn cli_replay_names_the_prealloc_for_a_loop_stitching_every_step() {
    let f = data("llm-train-s-b2.pickle.gz");
    let peak = read("llm-train-s-b2.pickle.gz")
        .unwrap()
        .summary()
        .peak_live_bytes;
    let out = stitch(&["replay", f.to_str().unwrap()]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    let want = format!("try --prealloc {}MiB", (peak + peak / 20).div_ceil(1 << 20));
    assert!(text.contains(&want), "{want} not in:\n{text}");
    let f = data("llm-small.trace.gz");
    let out = stitch(&["replay", f.to_str().unwrap()]);
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(!text.contains("--prealloc"), "{text}");
}

#[test]
fn cli_no_stitch_is_no_better_on_the_checkerboard() {
    let f = data("checkerboard-small.trace");
    let f = f.to_str().unwrap();
    let on = json(&["replay", f, "--json", "--capacity", "2GiB", "--no-recreate"]);
    let off = json(&["replay", f, "--json", "--capacity", "2GiB", "--no-stitch"]);
    assert!(
        off["ratio"].as_f64().unwrap() >= on["ratio"].as_f64().unwrap(),
        "{on}\n{off}"
    );
    assert_eq!(on["stitching"], true);
    assert_eq!(off["stitching"], false);
    assert!(on["stitches"].as_u64().unwrap() >= 1);
    assert_eq!(off["stitches"], 0);
    assert!(on["largest_alloc_after"].as_u64().unwrap() > GIB);
}

#[test]
fn cli_human_output_plot_and_map() {
    let f = data("llm-small.trace.gz");
    let svg = tmp("llm.svg");
    let out = stitch(&[
        "replay",
        f.to_str().unwrap(),
        "--plot",
        svg.to_str().unwrap(),
    ]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    for word in ["peak reserved", "ratio", "modeled driver", "stranded"] {
        assert!(text.contains(word), "{word} in\n{text}");
    }
    let s = std::fs::read_to_string(&svg).unwrap();
    assert!(s.starts_with("<svg") && s.trim_end().ends_with("</svg>"));
    assert!(s.contains("reserved (physical)") && s.contains("<path"));
    let map = tmp("map.svg");
    let out = stitch(&[
        "map",
        f.to_str().unwrap(),
        "--at",
        "1500",
        "--out",
        map.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let s = std::fs::read_to_string(&map).unwrap();
    assert!(s.starts_with("<svg") && s.contains("stranded") && s.contains("<rect"));
}

#[test]
fn cli_gen_is_deterministic_and_readable() {
    let a = tmp("gen-a.trace.gz");
    let b = tmp("gen-b.trace.gz");
    for p in [&a, &b] {
        let out = stitch(&[
            "gen",
            "adversarial",
            "--small",
            "--seed",
            "9",
            "--out",
            p.to_str().unwrap(),
        ]);
        assert!(out.status.success());
    }
    let (x, y) = (std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
    assert!(trace::is_gzip(&x));
    assert_eq!(x, y, "same seed, same bytes");
    assert_eq!(
        trace::read_path(&a, ReadOptions::default()).unwrap(),
        gen::generate(Kind::Adversarial, 9, Scale::Small)
    );
    assert!(!stitch(&["gen", "nonsense", "--out", "/dev/null"])
        .status
        .success());
}

#[test]
fn cli_errors_are_clear() {
    let f = data("bad/unknown-id.trace");
    let out = stitch(&["replay", f.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(
        err.contains("line 4") && err.contains("unknown id 9"),
        "{err}"
    );
    if !stitch_alloc::CudaDriver::available() {
        // No GPU here: asking for CUDA is a clear error, not a silent fallback.
        let ok = data("train-small.trace");
        let out = stitch(&["replay", ok.to_str().unwrap(), "--backend", "cuda"]);
        assert_eq!(out.status.code(), Some(2));
        let err = String::from_utf8(out.stderr).unwrap();
        assert!(err.contains("CUDA backend is unavailable"), "{err}");
    }
}

#[test]
fn cli_info_and_host_backend() {
    let out = stitch(&["info"]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("granularity") && text.contains("2097152") && text.contains("capacity"));
    // A short replay on real host memory.
    let f = data("train-small.trace");
    let v = json(&[
        "replay",
        f.to_str().unwrap(),
        "--json",
        "--backend",
        "host",
        "--capacity",
        "1GiB",
    ]);
    assert_eq!(v["backend"], "host");
    assert_eq!(v["failed_allocs"], 0);
}

#[test]
fn cli_demo_runs() {
    let out = stitch(&["demo"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("stitching on") && text.contains("stitching off"));
    assert!(text.contains("What you are looking at"));
}

/// The demo quotes the real workloads' figures measured through torch (`tests/data/zoo/torch.json`)
/// beside each shipped snapshot replayed on the simulated H200, and the replayed ratio is the
/// one `stitch replay` gives for the same snapshot; a folder without the figures is named in
/// the text, not an error.
#[test]
fn cli_demo_quotes_the_zoo_beside_its_replays() {
    let dir = data("zoo");
    let d = json(&[
        "demo",
        "--backend",
        "sim",
        "--json",
        "--zoo",
        dir.to_str().unwrap(),
    ]);
    let rows = d["zoo"]["workloads"].as_array().expect("zoo rows");
    assert_eq!(rows.len(), 11, "{}", d["zoo"]);
    let mut replayed = 0;
    for r in rows {
        let w = r["workload"].as_str().unwrap();
        for k in [
            "torch_pytorch_default",
            "torch_expandable_segments",
            "torch_stitch_alloc",
        ] {
            assert!(r[k].as_f64().unwrap() >= 1.0, "{w} {k}");
        }
        let snap = dir.join(format!("{w}.pickle.gz"));
        if !snap.exists() {
            assert!(r["replay_lag0"].is_null(), "{w}");
            continue;
        }
        replayed += 1;
        for (lag, key) in [("0", "replay_lag0"), ("1000", "replay_lag1000")] {
            let alone = json(&["replay", snap.to_str().unwrap(), "--json", "--gpu-lag", lag]);
            let (a, b) = (r[key].as_f64().unwrap(), alone["ratio"].as_f64().unwrap());
            assert!((a - b).abs() < 1e-12, "{w} lag {lag}: demo {a}, replay {b}");
        }
    }
    assert_eq!(replayed, 10);
    let empty = tmp("no-zoo");
    std::fs::create_dir_all(&empty).unwrap();
    let out = stitch(&["demo", "--backend", "sim", "--zoo", empty.to_str().unwrap()]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("real PyTorch workloads skipped"), "{text}");
}

/// The demo's checkerboard fills a device-sized host backend (139.8 GiB, one open file per
/// handle) without a failed allocation, and its table says how many failed. Before the host
/// backend reported its handle limit, the fill ran out of open files (147 failed
/// allocations with handles of request / 32, 378 with request / 64) and the largest
/// tensor was measured over a different, emptier checkerboard.
#[test]
fn cli_demo_checkerboard_fills_the_host_backend() {
    let d = json(&["demo", "--backend", "host", "--json"]);
    for side in ["stitching_on", "stitching_off"] {
        let r = &d["checkerboard"][side];
        assert_eq!(r["failed_allocs"], 0, "{side}: {}", r["first_error"]);
        assert!(
            r["probes"][0]["fraction_of_free"].as_f64().unwrap() >= 0.998,
            "{side}"
        );
    }
    let out = stitch(&["demo", "--backend", "host"]);
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("checkerboard: failed allocations"), "{text}");
}

/// `--prealloc` replays with `Config::prealloc`: the pool is created before the first event,
/// so fewer of the trace's allocations call the driver, and the peak holds the pool.
#[test]
fn cli_prealloc_creates_the_pool_before_the_trace() {
    let f = data("llm-small.trace.gz");
    let f = f.to_str().unwrap();
    let plain = json(&["replay", f, "--json"]);
    let pre = json(&["replay", f, "--json", "--prealloc", "2GiB"]);
    assert_eq!(pre["failed_allocs"], 0);
    assert!(pre["peak_reserved_bytes"].as_u64().unwrap() >= 2 << 30);
    let slow = |v: &serde_json::Value| v["slow_allocs"].as_u64().unwrap();
    assert!(
        slow(&pre) * 4 < slow(&plain),
        "{} allocations called the driver with the pool, {} without",
        slow(&pre),
        slow(&plain)
    );
}

#[test]
fn cli_cost_model_override() {
    let f = data("llm-small.trace.gz");
    let f = f.to_str().unwrap();
    let base = json(&["replay", f, "--json"]);
    let cost = tmp("cost.json");
    std::fs::write(
        &cost,
        r#"{"set_access": {"at_2mib": 0, "at_64mib": 0, "at_1gib": 0}, "set_access_quadratic": 0}"#,
    )
    .unwrap();
    let cheap = json(&[
        "replay",
        f,
        "--json",
        "--cost-model",
        cost.to_str().unwrap(),
    ]);
    // Kinds that cost nothing are left out of the breakdown.
    assert!(cheap["modeled_driver_by_call"].get("set_access").is_none());
    assert!(
        cheap["modeled_driver_us"].as_f64().unwrap() < base["modeled_driver_us"].as_f64().unwrap()
    );
    assert_eq!(
        cheap["driver_calls"], base["driver_calls"],
        "same calls, different prices"
    );
    std::fs::write(&cost, "not json").unwrap();
    assert_eq!(
        stitch(&["replay", f, "--cost-model", cost.to_str().unwrap()])
            .status
            .code(),
        Some(2)
    );
}

/// The meter's modeled microseconds and calls before and after a replay ([`Meter::totals`]).
type MeterSpan = ((f64, CallCounts), (f64, CallCounts));

/// Replay `t` on a simulated H200 under `cfg`, the GPU `lag` events behind, with every
/// driver call metered; returns the report, the meter's readings around the replay alone
/// (starting the allocator excluded) and the allocator's statistics at the end.
fn metered_replay_with(
    t: &Trace,
    cfg: Config,
    lag: usize,
) -> (
    stitch_alloc::replay::ReplayReport,
    MeterSpan,
    stitch_alloc::Stats,
) {
    let meter = Meter::new(Default::default());
    let a = Allocator::new(Metered::new(SimDriver::new(), meter.clone()), cfg).unwrap();
    let start = meter.totals(); // after what starting the allocator cost
    let r = replay(
        t,
        &a,
        &ReplayOptions {
            gpu_lag: lag,
            meter: Some(meter.clone()),
            ..Default::default()
        },
    );
    (r, (start, meter.totals()), a.stats())
}

/// Replay `t` with the device `lag` events behind on an allocator over a simulated device
/// of `capacity` bytes with `cfg`; the report and the allocator.
fn lagged_replay(
    t: &Trace,
    capacity: u64,
    cfg: Config,
    lag: usize,
) -> (stitch_alloc::replay::ReplayReport, Allocator<SimDriver>) {
    let a = Allocator::new(SimDriver::with_capacity(capacity), cfg).unwrap();
    let r = replay(
        t,
        &a,
        &ReplayOptions {
            gpu_lag: lag,
            ..Default::default()
        },
    );
    (r, a)
}

/// [`metered_replay_with`] under the default policy with no GPU lag, without the
/// statistics: the oracle the per-allocation and per-tenth figures are checked on.
fn metered_replay_span(t: &Trace) -> (stitch_alloc::replay::ReplayReport, MeterSpan) {
    let (r, span, _) = metered_replay_with(t, Config::default(), 0);
    (r, span)
}

/// [`metered_replay_span`] with the modeled time over the replay only.
fn metered_replay(t: &Trace) -> (stitch_alloc::replay::ReplayReport, f64) {
    let (r, ((us0, _), (us1, _))) = metered_replay_span(t);
    (r, us1 - us0)
}

/// `ReplayReport::modeled_us_per_alloc` (issue #11's slowest-allocation figure on the
/// simulator): two allocations that each create memory and one that reuses it; the oracle
/// is the meter's own total over the replay, which only those two requests added to (frees
/// of a single stream call nothing), so the two per-allocation figures must sum to it.
#[test]
fn replay_reports_the_modeled_driver_time_of_each_allocation() {
    let t = Trace::parse_str("a 1 104857600\na 2 314572800\nf 1\na 3 104857600\n").unwrap();
    let (r, total) = metered_replay(&t);
    assert_eq!(r.failed_allocs, 0);
    assert_eq!(
        r.fast_allocs, 1,
        "the third allocation reuses the first's memory"
    );
    let p = r.modeled_us_per_alloc.expect("a meter was given");
    assert_eq!(p.count, 2, "{p:?}");
    assert!(
        p.p50_us > 0.0 && p.p50_us <= p.max_us && p.p99_us == p.max_us,
        "{p:?}"
    );
    assert!(
        (p.p50_us + p.max_us - total).abs() < 1e-6,
        "{p:?} against the meter's {total} us"
    );
    // The same time by tenth of the events (four events: tenths 2, 4, 7 and 9 hold one
    // each, the others none); the two slow allocations are the first two events.
    let tenths = &r.modeled_driver_us_by_tenth;
    assert_eq!(tenths.len(), 10);
    assert!(
        (tenths.iter().sum::<f64>() - total).abs() < 1e-6,
        "{tenths:?}"
    );
    let busy: Vec<usize> = (0..10).filter(|&k| tenths[k] > 0.0).collect();
    assert_eq!(busy, vec![2, 4], "{tenths:?}");
    // Without a meter there is nothing to report.
    let b = Allocator::new(SimDriver::new(), Config::default()).unwrap();
    let plain = replay(&t, &b, &ReplayOptions::default());
    assert!(plain.modeled_us_per_alloc.is_none());
    assert!(plain.modeled_driver_us_by_tenth.is_empty());
}

/// A loop of ten identical steps: the first step creates the memory and the nine after it
/// reuse it, so all the modeled driver time lies in the first tenth of the events (the
/// warm-up), none in the steady state.
#[test]
fn replay_splits_the_modeled_driver_time_by_tenth_of_the_events() {
    let mut text = String::new();
    for step in 0..10u64 {
        let (x, y) = (2 * step + 1, 2 * step + 2);
        text += &format!("a {x} 104857600\na {y} 314572800\nf {y}\nf {x}\n");
    }
    let t = Trace::parse_str(&text).unwrap();
    let (r, total) = metered_replay(&t);
    assert_eq!(r.failed_allocs, 0);
    let tenths = &r.modeled_driver_us_by_tenth;
    assert_eq!(tenths.len(), 10);
    assert!(tenths[0] > 0.0, "{tenths:?}");
    assert!(
        tenths[1..].iter().all(|&t| t == 0.0),
        "steps after the first reuse their memory: {tenths:?}"
    );
    assert!((tenths[0] - total).abs() < 1e-6);
}

/// `ReplayReport::slowest_allocs`: five allocations that each create memory, of different
/// sizes, and one reuse. All five are kept (the report keeps `SLOWEST_KEPT` = 5), slowest
/// first; each names its own event and size in the trace; and the oracle for the calls is
/// the meter itself: over the replay only these five allocations called the driver, so
/// their calls must add up to the meter's counts and their times to its total.
#[test]
fn replay_names_the_slowest_allocations_and_their_calls() {
    use stitch_alloc::driver::DriverOp;
    use stitch_alloc::replay::SLOWEST_KEPT;
    let sizes = [300u64, 100, 700, 200, 500].map(|m| m << 20);
    let mut text = String::new();
    for (i, b) in sizes.iter().enumerate() {
        text += &format!("a {} {b}\n", i + 1);
    }
    text += "f 2\na 9 104857600\n"; // reuses the 100 MiB block: no driver call
    let t = Trace::parse_str(&text).unwrap();
    let (r, ((us0, calls0), (us1, calls1))) = metered_replay_span(&t);
    assert_eq!(r.failed_allocs, 0);
    let slow = &r.slowest_allocs;
    assert_eq!(slow.len(), SLOWEST_KEPT, "{slow:?}");
    assert!(
        slow.windows(2).all(|w| w[0].modeled_us >= w[1].modeled_us),
        "{slow:?}"
    );
    let mut events: Vec<usize> = slow.iter().map(|s| s.event).collect();
    events.sort();
    assert_eq!(
        events,
        vec![0, 1, 2, 3, 4],
        "the reuse (event 6) called nothing"
    );
    for s in slow {
        assert_eq!(s.bytes, sizes[s.event], "{s:?}");
        assert!(s.calls.get("create").is_some_and(|&n| n > 0), "{s:?}");
    }
    assert_eq!(
        slow[0].modeled_us,
        r.modeled_us_per_alloc.unwrap().max_us,
        "the first is the slowest"
    );
    let sum_us: f64 = slow.iter().map(|s| s.modeled_us).sum();
    assert!(
        (sum_us - (us1 - us0)).abs() < 1e-6,
        "{sum_us} against {}",
        us1 - us0
    );
    for op in [DriverOp::Create, DriverOp::Map, DriverOp::SetAccess] {
        let sum: u64 = slow.iter().filter_map(|s| s.calls.get(op.name())).sum();
        assert_eq!(sum, calls1.get(op) - calls0.get(op), "{op:?}");
    }
    // Without a meter there is nothing to report.
    let b = Allocator::new(SimDriver::new(), Config::default()).unwrap();
    assert!(replay(&t, &b, &ReplayOptions::default())
        .slowest_allocs
        .is_empty());
}

/// `ReplayReport::driver_allocs` and `stitch replay --calls-log`: the trajectory that
/// `scripts/trajectory.py` compares with a history recorded on the card. Three allocations
/// create memory; two of them are freed around a live one, so the fourth (150 MiB, larger
/// than either free block, within the growth budget of 210 MiB live) is stitched from their
/// handles, which unmaps them. The oracle is the meter: only these four allocations called
/// the driver (frees on one stream call nothing), so their maps and unmaps add up to its
/// counts over the replay; entries are numbered among the allocations (the stitch is the
/// fourth allocation but the sixth event). The CLI writes the same list.
#[test]
fn replay_lists_each_allocation_that_called_the_driver() {
    use stitch_alloc::driver::DriverOp;
    let m = 1u64 << 20;
    let text = format!(
        "a 1 {}\na 2 {}\na 3 {}\nf 1\nf 3\na 4 {}\n",
        100 * m,
        10 * m,
        100 * m,
        150 * m
    );
    let t = Trace::parse_str(&text).unwrap();
    let (r, ((_, calls0), (_, calls1))) = metered_replay_span(&t);
    assert_eq!(r.failed_allocs, 0);
    let d = &r.driver_allocs;
    let idx: Vec<usize> = d.iter().map(|c| c.alloc).collect();
    assert_eq!(idx, vec![0, 1, 2, 3], "{d:?}");
    assert_eq!(d[3].bytes, 150 * m);
    assert!(
        d[3].unmaps > 0,
        "the stitch moved or released mapped handles: {d:?}"
    );
    assert_eq!(
        d.iter().map(|c| c.maps).sum::<u64>(),
        calls1.get(DriverOp::Map) - calls0.get(DriverOp::Map)
    );
    assert_eq!(
        d.iter().map(|c| c.unmaps).sum::<u64>(),
        calls1.get(DriverOp::Unmap) - calls0.get(DriverOp::Unmap)
    );
    let f = tmp("calls-log.trace");
    std::fs::write(&f, &text).unwrap();
    let out = tmp("calls-log.txt");
    json(&[
        "replay",
        f.to_str().unwrap(),
        "--json",
        "--calls-log",
        out.to_str().unwrap(),
    ]);
    let log = std::fs::read_to_string(&out).unwrap();
    let rows: Vec<Vec<u64>> = log
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| l.split(' ').map(|x| x.parse().unwrap()).collect())
        .collect();
    let want: Vec<Vec<u64>> = d
        .iter()
        .map(|c| vec![c.alloc as u64, c.bytes, c.maps, c.unmaps])
        .collect();
    assert_eq!(rows, want, "{log}");
}

/// `stitch replay --small-threshold`: a hundred live 600 KiB tensors. Under the default
/// threshold (256 KiB) they are large-pool requests placed back to back: 58.6 MiB live in 30
/// granules, 60 MiB. Under 1 MiB they are small-pool requests, three to a 2 MiB page (3 x 600
/// KiB fits, 4 does not): 34 pages, 68 MiB. A threshold the configuration refuses is a clear
/// error, not a replay.
#[test]
fn cli_small_threshold_moves_requests_between_the_pools() {
    let f = tmp("six-hundred-kib.trace");
    let text: String = (0..100).map(|i| format!("a {i} 614400\n")).collect();
    std::fs::write(&f, text).unwrap();
    let f = f.to_str().unwrap();
    let reserved = |extra: &[&str]| {
        let mut args = vec!["replay", f, "--json"];
        args.extend_from_slice(extra);
        json(&args)["peak_reserved_bytes"].as_u64().unwrap()
    };
    assert_eq!(reserved(&[]), 60 << 20);
    assert_eq!(reserved(&["--small-threshold", "1MiB"]), 68 << 20);
    let o = stitch(&["replay", f, "--small-threshold", "100GiB"]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("small_threshold"), "{err}");
}

/// On a serving loop whose KV caches grow one token at a time (`gen serve`, the small size,
/// three seeds), stitch-alloc holds less at its peak than the replay models of PyTorch's
/// default allocator and of expandable segments, with the device in step and 1,000 events
/// behind (2026-12-02: 1.047-1.126 against default 1.213-1.253 and expandable 1.270-1.322
/// at this size; the full size 1.05-1.08 against 1.17-1.28 and 1.09-1.12, design/zoo.md).
#[test]
fn a_growing_kv_cache_serving_loop_holds_less_than_both_pytorch_models() {
    for seed in 1..=3 {
        let t = gen::generate(Kind::Serve, seed, Scale::Small);
        replays_below_both_pytorch_models(&t, &format!("serve seed {seed}"));
    }
}

/// Replays `t` (on a 4 GiB device) at GPU lags 0 and 1000 with the default configuration,
/// asserting that no allocation fails and that each peak is below the replay models of
/// PyTorch's default allocator and of expandable segments; returns each lag's report.
fn replays_below_both_pytorch_models(
    t: &Trace,
    what: &str,
) -> Vec<(usize, stitch_alloc::replay::ReplayReport)> {
    use stitch_alloc::replay::models::{simulate, Model};
    let cap = 4 * GIB;
    let default = simulate(t, Model::PyTorchDefault, cap).ratio;
    let expandable = simulate(t, Model::PyTorchExpandable, cap).ratio;
    [0, 1000]
        .into_iter()
        .map(|lag| {
            let (r, _) = lagged_replay(t, cap, Config::default(), lag);
            assert_eq!(r.failed_allocs, 0, "{what} lag {lag}");
            assert!(
                r.ratio < expandable && r.ratio < default,
                "{what} lag {lag}: {:.4} against default {default:.4}, expandable \
                 {expandable:.4}",
                r.ratio
            );
            (lag, r)
        })
        .collect()
}

/// Random churn under a fixed live budget (`gen churn`, the small size, three seeds): every
/// large miss gathers free memory, so stitch-alloc holds less than the replay models of both
/// PyTorch allocators at lags 0 and 1000 (2026-12-05: 1.020-1.041 against expandable
/// 1.29-1.34), and it pays in driver time; a growth slack is the user's way to trade
/// memory back for it, so 20% of slack must cost less modeled driver time than none
/// (measured 121-151 ms against 223-300 ms, at 1.16-1.19; design/zoo.md, eighteenth
/// session).
#[test]
fn random_churn_holds_less_than_both_models_and_slack_buys_driver_time() {
    for seed in 1..=3 {
        let t = gen::generate(Kind::Churn, seed, Scale::Small);
        for (lag, r) in replays_below_both_pytorch_models(&t, &format!("churn seed {seed}")) {
            let mut slack = Config::default();
            slack.reserve_slack = 0.2;
            let (s, _) = lagged_replay(&t, 4 * GIB, slack, lag);
            assert_eq!(s.failed_allocs, 0, "seed {seed} lag {lag}, slack");
            assert!(
                s.modeled_driver_us < r.modeled_driver_us && s.ratio > r.ratio,
                "seed {seed} lag {lag}: slack 0.2 {:.4} / {:.0} us against {:.4} / {:.0} us",
                s.ratio,
                s.modeled_driver_us,
                r.ratio,
                r.modeled_driver_us
            );
        }
    }
}

/// The same loop at batch 2 (`tests/data/llm-train-s-b2.pickle.gz`, recorded on the H200 by
/// `scripts/record-fixed-llm.py`, run 85) stitches at the same points of every step without
/// the loop region (design/zoo.md, "Fourteenth session": the repeat allowance, a growth
/// slack of up to 5% and address reuse per size do not settle it at lag 1000).
/// `Stats::repeated_stitches` counts those stitches; pre-allocating 1.05 x the trace's
/// peak of live bytes (computed from the trace, not by the allocator) ends every driver
/// call after the first tenth of the trace, at every lag, and no stitch repeats.
#[test]
fn a_loop_stitching_every_step_is_counted_and_prealloc_ends_it() {
    let t = read("llm-train-s-b2.pickle.gz").unwrap();
    let peak = t.summary().peak_live_bytes;
    let run = |cfg: Config, lag: usize| {
        let (r, _, stats) = metered_replay_with(&t, cfg, lag);
        assert_eq!(r.failed_allocs, 0, "lag {lag}");
        assert_eq!(r.repeated_stitches, stats.repeated_stitches, "lag {lag}");
        r
    };
    for lag in [0, 100, 1000] {
        let r = run(Config::default().with_loop_region(false), lag);
        assert!(
            r.repeated_stitches >= 8,
            "lag {lag}: {} of {} stitches counted as repeats",
            r.repeated_stitches,
            r.stitches
        );
        let mut cfg = Config::default();
        cfg.prealloc = peak + peak / 20;
        let r = run(cfg, lag);
        let late = &r.modeled_driver_us_by_tenth[1..];
        assert!(
            late.iter().all(|&us| us == 0.0),
            "lag {lag}: driver time after the first tenth {late:?}"
        );
        assert_eq!(r.repeated_stitches, 0, "lag {lag}");
        assert!(r.ratio <= 1.051, "lag {lag}: ratio {}", r.ratio);
    }
}

/// The loop region (`Config::loop_region`, on by default; `engine/region.rs`) settles that
/// batch-2 loop by itself: from its first repeated stitch the loop's large requests are
/// placed in one run that only grows, and in the second half of the trace no allocation
/// reaches the driver, at GPU lags 0, 100 and 1000, where without it every step stitches
/// twice (checked here too). Reserved memory stays within the region's budget, 2% above
/// the trace's peak of live bytes (the ratio is computed by the replay from the trace's own
/// figures).
#[test]
fn the_loop_region_settles_a_loop_that_stitches_every_step() {
    let t = read("llm-train-s-b2.pickle.gz").unwrap();
    for lag in [0, 100, 1000] {
        let (r, _, stats) = metered_replay_with(&t, Config::default(), lag);
        assert_eq!(r.failed_allocs, 0, "lag {lag}");
        assert!(stats.loop_region_entries >= 1, "lag {lag}: never entered");
        let late = &r.modeled_driver_us_by_tenth[5..];
        assert!(
            late.iter().all(|&us| us == 0.0),
            "lag {lag}: driver time in the second half {late:?}"
        );
        assert!(r.ratio <= 1.02, "lag {lag}: ratio {}", r.ratio);
        let off = Config::default().with_loop_region(false);
        let (r, _, _) = metered_replay_with(&t, off, lag);
        let late: f64 = r.modeled_driver_us_by_tenth[5..].iter().sum();
        assert!(late > 0.0, "lag {lag}: the loop settled without the region");
    }
}

/// A loop whose shapes drift in a cycle (`tests/data/moe-drift.trace.gz`: the first 70% of
/// the mixture-of-experts loop of `scripts/torch-inproc-speed.py --workloads moe`, recorded
/// under PyTorch's default by `--record` on an H100, run 146; expert batches change every step
/// and repeat every twelve) needs more than the region's first 2% to stop moving: with that
/// budget alone it left the region and stitched to the end of the trace at every lag (through
/// torch, run 145: 10.8 ms of driver time a step, 0.79 of PyTorch's speed). Each time the
/// region is left for want of budget, the budget is raised to the smallest doubling of 2% that
/// holds the need, up to `MAX_GROWTH` (8%), and the loop settles: no driver call
/// in the last fifth of the trace at GPU lags 0, 3, 100 and 1000, and reserved memory stays
/// within 6% of the trace's peak of live bytes (the ratio is the replay's, from the trace).
#[test]
fn the_loop_region_settles_a_loop_whose_shapes_drift_in_a_cycle() {
    let t = read("moe-drift.trace.gz").unwrap();
    for lag in [0, 3, 100, 1000] {
        let (r, _, stats) = metered_replay_with(&t, Config::default(), lag);
        assert_eq!(r.failed_allocs, 0, "lag {lag}");
        assert!(
            stats.loop_region_exits >= 2,
            "lag {lag}: left the region fewer than twice"
        );
        let late = &r.modeled_driver_us_by_tenth[8..];
        assert!(
            late.iter().all(|&us| us == 0.0),
            "lag {lag}: driver time in the last fifth {late:?}"
        );
        assert!(r.ratio <= 1.06, "lag {lag}: ratio {}", r.ratio);
    }
}

/// A sampling loop whose shapes change per request (`tests/data/unet-denoise.trace.gz`: the
/// first 60% of the unet-denoise holdout of `scripts/torch-zoo.py`, 20 guided UNet steps per
/// request at a new latent size and batch, recorded under PyTorch's default on an H200,
/// 2026-12-07) keeps running out of the loop region's 2% budget for a request of 19% of its
/// peak. Doubling the budget at each such exit (caec488) gave it 8% it could not settle with:
/// 1.054-1.063 through torch (2026-12-07) where it held 1.014 before, and 1.060-1.077 here at
/// lags 0-100. The budget is now raised only for a need `MAX_GROWTH` holds; the ratio (the
/// replay's, from the trace) stays within 2% of the peak of live bytes.
#[test]
fn the_loop_region_budget_is_not_raised_for_a_need_it_cannot_hold() {
    let t = read("unet-denoise.trace.gz").unwrap();
    for lag in [0, 3, 100, 1000] {
        let (r, _, stats) = metered_replay_with(&t, Config::default(), lag);
        assert_eq!(r.failed_allocs, 0, "lag {lag}");
        assert!(
            stats.loop_region_exits >= 1,
            "lag {lag}: never left the region"
        );
        assert!(r.ratio <= 1.02, "lag {lag}: ratio {}", r.ratio);
    }
}

/// A workload whose shapes recur in blocks (bert-encode: about ten batches of one shape,
/// then the next, so its stitches repeat in streaks of 8-10) enters the loop region and
/// leaves it when the shape changes; it must not pay for it in memory. Its peak with the
/// region is the same as without it, at lags 0 and 1000 (design/zoo.md, "Fifteenth
/// session": a region without the exit rule took it from 1.0145 to 1.19-1.32).
#[test]
fn the_loop_region_leaves_recurring_shapes_as_they_were() {
    let t = read("zoo/bert-encode.pickle.gz").unwrap();
    for lag in [0, 1000] {
        let (on, _, stats) = metered_replay_with(&t, Config::default(), lag);
        let cfg = Config::default().with_loop_region(false);
        let (off, _, _) = metered_replay_with(&t, cfg, lag);
        assert_eq!(on.failed_allocs + off.failed_allocs, 0);
        assert!(stats.loop_region_entries >= 1, "lag {lag}: never entered");
        assert!(stats.loop_region_exits >= 1, "lag {lag}: never left");
        assert!(
            on.peak_reserved_bytes <= off.peak_reserved_bytes,
            "lag {lag}: {} with the region, {} without",
            on.peak_reserved_bytes,
            off.peak_reserved_bytes
        );
    }
}

/// A checkerboard loop (four 4 MiB tensors, two freed, then 8 MiB), which needs 1.5 x its
/// peak to stop stitching, enters and leaves the loop region again and again; every
/// structure stays consistent throughout (`paranoid`: `validate` after every operation),
/// the waits between entries grow, and `empty_cache` gives every free handle back.
#[test]
fn the_loop_region_stays_consistent_on_a_loop_it_cannot_settle() {
    let m = 1u64 << 20;
    let mut text = String::new();
    let mut id = 0;
    for _ in 0..60 {
        let xs: Vec<u64> = (0..4).map(|k| id + k).collect();
        for &x in &xs {
            text += &format!("a {x} {}\n", 4 * m);
        }
        text += &format!("f {}\nf {}\na {} {}\n", xs[0], xs[2], id + 4, 8 * m);
        text += &format!("f {}\nf {}\nf {}\n", xs[1], xs[3], id + 4);
        id += 5;
    }
    let t = Trace::parse_str(&text).unwrap();
    for lag in [0, 100] {
        let (r, a) = lagged_replay(&t, 1 << 30, Config::default().with_paranoid(true), lag);
        assert_eq!(r.failed_allocs, 0, "lag {lag}");
        let s = a.stats();
        assert!(s.loop_region_entries >= 2, "lag {lag}: {s:?}");
        assert!(
            s.loop_region_exits >= s.loop_region_entries - 1,
            "lag {lag}"
        );
        // Entries wait 1, 2, 4, ... repeats: fewer entries than repeated stitches.
        assert!(
            s.loop_region_entries < s.repeated_stitches / 2,
            "lag {lag}: {} entries for {} repeats",
            s.loop_region_entries,
            s.repeated_stitches
        );
        a.empty_cache().unwrap();
        let s = a.stats();
        assert_eq!(s.loop_region_exits, s.loop_region_entries, "lag {lag}");
        assert_eq!(s.reserved.current, 0, "lag {lag}: {s:?}");
    }
}

/// A training loop with the same shapes every step (llm-train-s, batch and sequence fixed:
/// `tests/data/llm-train-s-fixed.pickle.gz`, recorded on the H200 under PyTorch's default
/// by `scripts/torch-zoo.py --fixed-shapes --record`, 2026-12-02) settles: in the second half
/// of the trace no allocation reaches the driver. Before the repeat allowance
/// (`engine/repeats.rs`), with the GPU 100 events behind, its 531 MiB logits tensor was
/// stitched anew every step (3.6-10 ms of modeled driver time per tenth of the trace to the
/// end; on the H200, 8 ms per step and 0.80-0.85 of PyTorch's speed). The peak stays within
/// the allowance's 1% above the old figure (1.0090).
#[test]
fn a_fixed_shape_training_loop_stops_stitching() {
    let t = read("llm-train-s-fixed.pickle.gz").unwrap();
    for lag in [0, 100, 1000] {
        let (r, _, _) = metered_replay_with(&t, Config::default(), lag);
        assert_eq!(r.failed_allocs, 0);
        assert_eq!(r.modeled_driver_us_by_tenth.len(), 10);
        let late = &r.modeled_driver_us_by_tenth[5..];
        assert!(
            late.iter().all(|&us| us == 0.0),
            "lag {lag}: driver time in the later tenths {late:?}"
        );
        assert!(r.ratio < 1.0090 + 0.0100, "lag {lag}: ratio {}", r.ratio);
    }
}

#[test]
/// Growing chains placed by next fit (`Config::chain_fit`, design/zoo.md "Nineteenth
/// session"): on the full-size serving loop, whose every decode step re-allocates each
/// layer's K and V one token longer, the allocator holds less at the peak with it than with
/// best fit for every request, at GPU lags 0 and 1000 (before it, best fit gave 1.05-1.08).
fn growing_chains_by_next_fit_hold_less_than_best_fit_on_the_serving_loop() {
    for seed in [1, 3] {
        let t = gen::generate(Kind::Serve, seed, Scale::Full);
        for lag in [0, 1000] {
            let run = |on: bool| {
                let a =
                    Allocator::new(SimDriver::new(), Config::default().with_chain_fit(on)).unwrap();
                let r = replay(
                    &t,
                    &a,
                    &ReplayOptions {
                        gpu_lag: lag,
                        skip_stranded: true,
                        ..Default::default()
                    },
                );
                assert_eq!(r.failed_allocs, 0);
                (r.ratio, a.stats().chain_fits)
            };
            let (best, none) = run(false);
            let (next, fits) = run(true);
            assert_eq!(none, 0);
            assert!(fits > 10_000, "seed {seed} lag {lag}: {fits} chain fits");
            assert!(
                next + 0.005 < best,
                "seed {seed} lag {lag}: next fit {next:.4} against best fit {best:.4}"
            );
        }
    }
}
