//! Kinds of serving loop for `stitch replay`: `stitch gen serve`'s model (`trace::gen::serve`)
//! at other model shapes and request mixes, so that a placement rule is judged on a kind of
//! workload rather than on one trace. Writes `DIR/serve-<kind>-<seed>.trace.gz`.
//!
//! ```text
//! cargo run --release --example serve_kinds -- DIR [SEEDS]
//! ```
use stitch_alloc::trace::gen::{serve, ServeParams};

fn main() {
    let mut args = std::env::args().skip(1);
    let dir = args.next().expect("DIR");
    let seeds: u64 = args.next().map_or(3, |s| s.parse().expect("SEEDS"));
    // (name, what it is, the generator's parameters): K and V are `hidden * 2` bytes a token.
    #[rustfmt::skip]
    let kinds = [
        ("zoo", "the zoo's serve: 4 x 1536, prompts 32-1024", shape(4, 1536, 4096, (48, 16, 2), (32, 1024), (8, 160))),
        ("long", "8 x 2048, prompts 256-4096: caches of 1-16 MiB", shape(8, 2048, 5632, (32, 8, 2), (256, 4096), (16, 128))),
        ("short", "16 x 1024, prompts 16-256: caches of 32 KiB-1 MiB", shape(16, 1024, 2816, (64, 16, 2), (16, 256), (16, 256))),
        ("wide", "4 x 2048, 32 at once, prompts 64-512", shape(4, 2048, 5632, (96, 32, 4), (64, 512), (16, 96))),
        ("small", "12 x 768, prompts 32-512", shape(12, 768, 3072, (48, 16, 2), (32, 512), (32, 128))),
    ];
    for (name, what, p) in kinds {
        for seed in 1..=seeds {
            let t = serve(&p, seed);
            let path = format!("{dir}/serve-{name}-{seed}.trace.gz");
            t.write_path(&path).expect("write the trace");
            println!("{path}: {what}, {} events", t.events.len());
        }
    }
}

/// A model of `layers` x `hidden` (MLP `intermediate` wide) serving `(requests, at most at
/// once, admitted per step)` with prompts and generations of the given token ranges.
fn shape(
    layers: u64,
    hidden: u64,
    intermediate: u64,
    (requests, max_active, admit_per_step): (u64, u64, u64),
    prompt_tokens: (u64, u64),
    gen_tokens: (u64, u64),
) -> ServeParams {
    ServeParams {
        layers,
        hidden,
        intermediate,
        requests,
        max_active,
        admit_per_step,
        prompt_tokens,
        gen_tokens,
        ..ServeParams::default()
    }
}
