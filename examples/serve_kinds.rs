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
    let base = ServeParams::default();
    // (name, what it is, parameters): K and V are `hidden * 2` bytes per token.
    let kinds = [
        (
            "zoo",
            "the zoo's serve: 4 x 1536, prompts 32-1024",
            base.clone(),
        ),
        (
            "long",
            "8 x 2048, prompts 256-4096: caches of 1-16 MiB",
            ServeParams {
                layers: 8,
                hidden: 2048,
                intermediate: 5632,
                requests: 32,
                max_active: 8,
                prompt_tokens: (256, 4096),
                gen_tokens: (16, 128),
                ..base.clone()
            },
        ),
        (
            "short",
            "16 x 1024, prompts 16-256: caches of 32 KiB-1 MiB",
            ServeParams {
                layers: 16,
                hidden: 1024,
                intermediate: 2816,
                requests: 64,
                max_active: 16,
                prompt_tokens: (16, 256),
                gen_tokens: (16, 256),
                ..base.clone()
            },
        ),
        (
            "wide",
            "4 x 2048, 32 at once, prompts 64-512",
            ServeParams {
                hidden: 2048,
                intermediate: 5632,
                requests: 96,
                max_active: 32,
                admit_per_step: 4,
                prompt_tokens: (64, 512),
                gen_tokens: (16, 96),
                ..base.clone()
            },
        ),
        (
            "small",
            "12 x 768, prompts 32-512",
            ServeParams {
                layers: 12,
                hidden: 768,
                intermediate: 3072,
                requests: 48,
                max_active: 16,
                prompt_tokens: (32, 512),
                gen_tokens: (32, 128),
                ..base
            },
        ),
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
