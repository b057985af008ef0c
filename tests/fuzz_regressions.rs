//! Inputs the fuzz targets once crashed on, replayed through the same harness.

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

/// `trace_text` inputs: each gives an error or a valid trace (trace_text-oom-1: 560 bytes of
/// pickle whose nested references expanded to over 6 GB before the expansion check).
#[test]
fn trace_text_regressions() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/fuzz");
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        if name.starts_with("trace_text") {
            let data = std::fs::read(&p).unwrap();
            match stitch_alloc::trace::read_bytes(&data, Default::default()) {
                Ok(t) => t.validate().unwrap(),
                // A memory bomb is refused before anything is built.
                Err(e) if name.contains("oom") => {
                    assert!(e.to_string().contains("expand"), "{name}: {e}")
                }
                Err(_) => {}
            }
        }
    }
}
