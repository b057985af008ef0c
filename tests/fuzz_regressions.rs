//! Inputs the fuzz targets once crashed on, replayed through the same harness, each with
//! the outcome it must have; and the `ops_faults` seed corpus through that target's body.

use stitch_alloc::driver::HostDriver;
use stitch_alloc::testing::{Harness, Op};
use stitch_alloc::{Capacity, Config};

const MIB: u64 = 1 << 20;

fn ops_host(data: &[u8]) -> Result<(), String> {
    let ops = Op::decode(data, 64 * MIB);
    let dev = HostDriver::with_capacity(64 * MIB).unwrap();
    let cfg = Config::default()
        .with_capacity(Capacity::Bytes(64 * MIB))
        .with_reserve_slack(0.0, 0)
        .with_handle_sizes(0, 8 * MIB);
    Harness::new(dev, cfg).unwrap().run(&ops).map(|_| ())
}

#[test]
fn ops_host_regressions() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/fuzz");
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with("ops_host")
        {
            let data = std::fs::read(&p).unwrap();
            ops_host(&data).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        }
    }
}

/// `trace_text` inputs, each with the outcome it must have (a new input needs a line here):
/// trace_text-oom-1 is 560 bytes of pickle whose nested references expanded to over 6 GB
/// under the serde-pickle reader; the streaming decoder copies nothing at a reference, and
/// refuses it as a pickle (protocol 154, then an unknown opcode) with a decoding error.
#[test]
fn trace_text_regressions() {
    use stitch_alloc::trace::TraceError;
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/fuzz");
    let mut seen = 0;
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        if !name.starts_with("trace_text") {
            continue;
        }
        let data = std::fs::read(&p).unwrap();
        let got = stitch_alloc::trace::read_bytes(&data, Default::default());
        match name.as_str() {
            "trace_text-oom-1" => assert!(
                matches!(&got, Err(TraceError::Snapshot(m)) if m.contains("cannot unpickle")),
                "{name}: {got:?}"
            ),
            _ => panic!("{name}: no expected outcome recorded for this input"),
        }
        seen += 1;
    }
    assert_eq!(seen, 1, "trace_text regression inputs");
}

/// The committed `ops_faults` corpus through the fuzz target's own body: every invariant,
/// and the faults fired against the rate, per input; over the corpus, faults must fire and
/// make operations fail.
#[test]
fn ops_faults_corpus() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/fuzz/corpus/ops_faults");
    let mut tally = stitch_alloc::testing::FaultTally::default();
    let (mut inputs, mut faulted) = (0, 0);
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        let data = std::fs::read(&p).unwrap();
        let counts = stitch_alloc::testing::ops_with_faults(&data)
            .unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        if let Some((c, t)) = counts {
            inputs += 1;
            faulted += c.faulted;
            tally.merge(&t);
        }
    }
    assert!(inputs >= 100, "only {inputs} usable inputs in {dir}");
    // No rate check over the whole corpus: the fuzzer kept inputs for the code they reached,
    // which favours runs with fewer faults than their rate (a long stitch is only reached
    // when its calls succeed), so the corpus as a whole is not a random sample.
    assert!(
        tally.expected >= 20.0 && tally.fired > 0 && faulted > 0,
        "{inputs} inputs: {tally:?}, {faulted} operations failed by faults"
    );
}
