//! Convert any trace stitch-alloc reads (a PyTorch memory snapshot pickle or the text format,
//! gzipped or not) into the text format (`a <id> <bytes> [stream]` / `f <id> ...`), for tools
//! outside the crate such as `scripts/placement-bound.py`. A `.gz` output is gzipped.
//! `cargo run --release --example trace_to_text -- SNAPSHOT.pickle.gz OUT.trace.gz`
use stitch_alloc::trace::{read_path, ReadOptions};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [input, output] = args.as_slice() else {
        eprintln!("usage: trace_to_text INPUT OUTPUT");
        std::process::exit(2);
    };
    let trace = match read_path(input, ReadOptions::default()) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("{input}: {e}");
            std::process::exit(1);
        }
    };
    if let Err(e) = trace.write_path(output) {
        eprintln!("{output}: {e}");
        std::process::exit(1);
    }
}
