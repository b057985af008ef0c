//! Deterministic synthetic traces.
//!
//! Every generator is a pure function of its parameters and a seed: the same seed gives the
//! same trace, byte for byte, on every machine: the random numbers come from a hand-written
//! SplitMix64, and the log-uniform sizes use only IEEE-754 `+ - * /` (correctly rounded, so
//! identical everywhere), not the platform's `ln`/`exp`, whose last bits may differ.
//!
//! | kind | what it models |
//! |---|---|
//! | [`Kind::Llm`] | LLM inference serving: weights, KV-cache tensors that grow by realloc (allocate bigger, copy, free the old one), 1 MiB–512 MiB temporaries freed out of order, many small tensors |
//! | [`Kind::Train`] | training iterations: parameters and optimizer state allocated once, forward activations freed in reverse during backward, gradients, a different sequence length each iteration |
//! | [`Kind::Checkerboard`] | fill ~129 GB with 100–300 MiB tensors, free every other one, then probe the largest single allocation |
//! | [`Kind::Adversarial`] | a random mix of 512 B – 2 GiB requests and random frees on several streams |
//! | [`Kind::Churn`] | random churn under a fixed live budget: KV tensors grown by realloc by 2–16 MiB, 1 MiB–512 MiB temporaries allocated and freed in random order with up to a cap of them live, small tensors (the GPU bench's replay; every large miss needs a stitch) |
//! | [`Kind::Serve`] | serving as Hugging Face's `DynamicCache` does it: requests of different lengths admitted and retired, each layer's K and V re-allocated one token longer at every decode step (`torch.cat`), a prefill's activations and logits per admitted request |
//!
//! ```
//! use stitch_alloc::trace::gen::{generate, Kind, Scale};
//! let a = generate(Kind::Train, 7, Scale::Small);
//! let b = generate(Kind::Train, 7, Scale::Small);
//! assert_eq!(a, b);
//! assert!(a.validate().is_ok());
//! ```

use super::{Event, Trace};
use std::str::FromStr;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// SplitMix64: a tiny, fast, well-mixed generator; enough for workloads.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// A generator from a seed.
    pub fn new(seed: u64) -> Self {
        Rng(seed ^ 0x5851_f42d_4c95_7f2d)
    }
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in `[0, n)` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }
    /// Uniform in `[lo, hi]`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }
    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        self.unit() < p
    }
    /// Log-uniform in `[lo, hi]` (`1 <= lo <= hi`), rounded down to an integer.
    pub fn log_uniform(&mut self, lo: u64, hi: u64) -> u64 {
        let (a, b) = (log2(lo as f64), log2(hi as f64));
        (exp2(a + (b - a) * self.unit()) as u64).clamp(lo, hi)
    }
    /// Shuffle a slice (Fisher-Yates).
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            v.swap(i, j);
        }
    }
}

/// `log2(x)` for `x >= 1`, with basic arithmetic only (reproducible on every machine).
fn log2(x: f64) -> f64 {
    let mut e = 0.0;
    let mut m = x;
    while m >= 2.0 {
        m /= 2.0;
        e += 1.0;
    }
    // ln(m) = 2 atanh(t), t = (m-1)/(m+1) in [0, 1/3).
    let t = (m - 1.0) / (m + 1.0);
    let t2 = t * t;
    let mut term = t;
    let mut sum = 0.0;
    let mut k = 1.0;
    while k < 60.0 {
        sum += term / k;
        term *= t2;
        k += 2.0;
    }
    e + 2.0 * sum / std::f64::consts::LN_2
}

/// `2^y` for `y >= 0`, with basic arithmetic only.
fn exp2(y: f64) -> f64 {
    let mut whole = 1.0;
    let mut f = y;
    while f >= 1.0 {
        whole *= 2.0;
        f -= 1.0;
    }
    // e^(f ln 2) by its Taylor series; f ln 2 < 0.7, 30 terms are plenty.
    let x = f * std::f64::consts::LN_2;
    let mut term = 1.0;
    let mut sum = 1.0;
    for k in 1..30 {
        term *= x / k as f64;
        sum += term;
    }
    whole * sum
}

/// The kinds of generated trace.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Kind {
    /// LLM inference serving.
    Llm,
    /// Training iterations.
    Train,
    /// The checkerboard fragmentation test.
    Checkerboard,
    /// A random adversarial mix.
    Adversarial,
    /// Serving with KV caches grown one token at a time by concatenation.
    Serve,
    /// Random churn of large temporaries under a fixed live budget.
    Churn,
}

impl Kind {
    /// Every kind.
    pub const ALL: [Kind; 6] = [
        Kind::Llm,
        Kind::Train,
        Kind::Checkerboard,
        Kind::Adversarial,
        Kind::Serve,
        Kind::Churn,
    ];
    /// The command-line name.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Llm => "llm",
            Kind::Train => "train",
            Kind::Checkerboard => "checkerboard",
            Kind::Adversarial => "adversarial",
            Kind::Serve => "serve",
            Kind::Churn => "churn",
        }
    }
}

impl FromStr for Kind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Kind::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| {
                format!(
                    "unknown trace kind {s:?} (expected llm, train, checkerboard, adversarial, serve or churn)"
                )
            })
    }
}

/// How big a trace to generate.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Scale {
    /// Full size, for a device of H200 capacity (139.8 GiB).
    Full,
    /// Scaled down for tests (a few thousand events, a few GiB at most).
    Small,
}

/// Generate a trace of `kind` from `seed`.
pub fn generate(kind: Kind, seed: u64, scale: Scale) -> Trace {
    let small = scale == Scale::Small;
    match kind {
        Kind::Llm => llm(
            &if small {
                LlmParams::small()
            } else {
                LlmParams::default()
            },
            seed,
        ),
        Kind::Train => train(
            &if small {
                TrainParams::small()
            } else {
                TrainParams::default()
            },
            seed,
        ),
        Kind::Checkerboard => checkerboard(
            &if small {
                CheckerboardParams::small()
            } else {
                CheckerboardParams::default()
            },
            seed,
        ),
        Kind::Adversarial => adversarial(
            &if small {
                AdversarialParams::small()
            } else {
                AdversarialParams::default()
            },
            seed,
        ),
        Kind::Serve => serve(
            &if small {
                ServeParams::small()
            } else {
                ServeParams::default()
            },
            seed,
        ),
        Kind::Churn => churn(
            &if small {
                ChurnParams::small()
            } else {
                ChurnParams::default()
            },
            seed,
        ),
    }
}

/// Builds a trace, handing out ids.
#[derive(Default)]
struct Builder {
    events: Vec<Event>,
    next: u64,
}

impl Builder {
    fn alloc(&mut self, bytes: u64, stream: u64) -> u64 {
        let id = self.next;
        self.next += 1;
        self.events.push(Event::Alloc {
            id,
            bytes: bytes.max(1),
            stream,
        });
        id
    }
    fn free(&mut self, id: u64) {
        self.events.push(Event::Free { id, stream: None });
    }
    fn free_on(&mut self, id: u64, stream: u64) {
        self.events.push(Event::Free {
            id,
            stream: Some(stream),
        });
    }
    fn finish(self) -> Trace {
        Trace {
            events: self.events,
        }
    }
}

/// Parameters of the LLM-inference generator.
#[derive(Clone, Debug)]
pub struct LlmParams {
    /// Number of weight tensors, allocated first and kept.
    pub weight_tensors: u64,
    /// Their total size.
    pub weight_bytes: u64,
    /// Decode steps to run.
    pub steps: u64,
    /// Most sequences served at once.
    pub max_seqs: u64,
    /// KV-cache bytes per token of one sequence.
    pub kv_bytes_per_token: u64,
    /// Prompt length range (tokens).
    pub prompt_tokens: (u64, u64),
    /// Generated length range (tokens).
    pub gen_tokens: (u64, u64),
    /// KV tensors are allocated in multiples of this many tokens and regrown by a quarter
    /// (at least this much) when full.
    pub kv_chunk_tokens: u64,
    /// Temporaries per step (range), each log-uniform in `temp_bytes`.
    pub temps_per_step: (u64, u64),
    /// Size range of temporaries.
    pub temp_bytes: (u64, u64),
    /// Small tensors (< 1 MiB) per step (range).
    pub small_per_step: (u64, u64),
}

impl Default for LlmParams {
    /// About 85k events with a peak of about 40 GiB live.
    fn default() -> Self {
        LlmParams {
            weight_tensors: 400,
            weight_bytes: 16 * GIB,
            steps: 1720,
            max_seqs: 32,
            kv_bytes_per_token: 424 * KIB,
            prompt_tokens: (64, 2048),
            gen_tokens: (16, 768),
            kv_chunk_tokens: 256,
            temps_per_step: (2, 6),
            temp_bytes: (MIB, 512 * MIB),
            small_per_step: (10, 30),
        }
    }
}

impl LlmParams {
    /// A scaled-down variant: a few thousand events, under 2 GiB live.
    pub fn small() -> Self {
        LlmParams {
            weight_tensors: 40,
            weight_bytes: 512 * MIB,
            steps: 120,
            max_seqs: 8,
            kv_bytes_per_token: 40 * KIB,
            prompt_tokens: (32, 1024),
            gen_tokens: (8, 256),
            kv_chunk_tokens: 128,
            temps_per_step: (1, 4),
            temp_bytes: (MIB, 96 * MIB),
            small_per_step: (4, 12),
        }
    }
}

/// LLM inference: weights; sequences admitted over time, each with a KV-cache tensor that
/// grows by realloc; per-step temporaries freed out of order (some outlive their step); small
/// tensors. Everything is freed at the end.
pub fn llm(p: &LlmParams, seed: u64) -> Trace {
    struct Seq {
        kv: u64,
        cap: u64,
        len: u64,
        end: u64,
    }
    let mut r = Rng::new(seed);
    let mut b = Builder::default();
    let mut weights = Vec::new();
    // Weights: sizes drawn log-uniform, then scaled to the total.
    let raw: Vec<u64> = (0..p.weight_tensors)
        .map(|_| r.log_uniform(64 * KIB, 512 * MIB))
        .collect();
    let sum: u64 = raw.iter().sum();
    for w in raw {
        let bytes = ((w as u128 * p.weight_bytes as u128) / sum as u128) as u64;
        weights.push(b.alloc(bytes.max(512), 0));
    }
    let mut seqs: Vec<Seq> = Vec::new();
    let mut carry: Vec<u64> = Vec::new(); // temporaries outliving their step
    let mut small_carry: Vec<u64> = Vec::new();
    let chunk = p.kv_chunk_tokens;
    for _step in 0..p.steps {
        // Admit new sequences (prefill).
        while (seqs.len() as u64) < p.max_seqs && r.chance(0.35) {
            let prompt = r.range(p.prompt_tokens.0, p.prompt_tokens.1);
            let gen = r.range(p.gen_tokens.0, p.gen_tokens.1);
            let cap = prompt.div_ceil(chunk) * chunk;
            let kv = b.alloc(cap * p.kv_bytes_per_token, 0);
            // Prefill activations, proportional to the prompt, freed at once.
            let act = b.alloc(prompt * p.kv_bytes_per_token / 4 + 4096, 0);
            let act2 = b.alloc(prompt * p.kv_bytes_per_token / 2 + 4096, 0);
            b.free(act);
            b.free(act2);
            seqs.push(Seq {
                kv,
                cap,
                len: prompt,
                end: prompt + gen,
            });
        }
        // Decode one token for each sequence; grow KV by realloc when full.
        for s in seqs.iter_mut() {
            s.len += 1;
            if s.len > s.cap {
                let cap = s.cap + (s.cap / 4).max(chunk).div_ceil(chunk) * chunk;
                let bigger = b.alloc(cap * p.kv_bytes_per_token, 0);
                b.free(s.kv); // after the copy
                s.kv = bigger;
                s.cap = cap;
            }
        }
        // Temporaries of this step, and small tensors.
        let nt = r.range(p.temps_per_step.0, p.temps_per_step.1);
        let mut temps: Vec<u64> = (0..nt)
            .map(|_| {
                let bytes = r.log_uniform(p.temp_bytes.0, p.temp_bytes.1);
                b.alloc(bytes, 0)
            })
            .collect();
        let ns = r.range(p.small_per_step.0, p.small_per_step.1);
        let mut smalls: Vec<u64> = (0..ns)
            .map(|_| {
                let bytes = r.log_uniform(512, MIB - 1);
                b.alloc(bytes, 0)
            })
            .collect();
        // Free out of order; a few outlive the step.
        temps.append(&mut carry);
        r.shuffle(&mut temps);
        for t in temps {
            if r.chance(0.15) {
                carry.push(t);
            } else {
                b.free(t);
            }
        }
        smalls.append(&mut small_carry);
        r.shuffle(&mut smalls);
        for t in smalls {
            if r.chance(0.1) {
                small_carry.push(t);
            } else {
                b.free(t);
            }
        }
        // Finished sequences release their KV cache.
        let mut i = 0;
        while i < seqs.len() {
            if seqs[i].len >= seqs[i].end {
                let s = seqs.swap_remove(i);
                b.free(s.kv);
            } else {
                i += 1;
            }
        }
    }
    for t in carry.into_iter().chain(small_carry) {
        b.free(t);
    }
    for s in seqs {
        b.free(s.kv);
    }
    for w in weights.into_iter().rev() {
        b.free(w);
    }
    b.finish()
}

/// Parameters of the training generator.
#[derive(Clone, Debug)]
pub struct TrainParams {
    /// Transformer layers.
    pub layers: u64,
    /// Hidden size.
    pub hidden: u64,
    /// Training iterations.
    pub iterations: u64,
    /// Batch size range.
    pub batch: (u64, u64),
    /// Sequence length range (drawn per iteration).
    pub seq: (u64, u64),
    /// Bytes per parameter (4: fp32 master weights).
    pub param_bytes: u64,
    /// Bytes per activation element (2: bf16 autocast).
    pub act_bytes: u64,
}

impl Default for TrainParams {
    fn default() -> Self {
        TrainParams {
            layers: 24,
            hidden: 2048,
            iterations: 40,
            batch: (1, 8),
            seq: (88, 2046),
            param_bytes: 4,
            act_bytes: 2,
        }
    }
}

impl TrainParams {
    /// A scaled-down variant.
    pub fn small() -> Self {
        TrainParams {
            layers: 4,
            hidden: 512,
            iterations: 8,
            batch: (1, 4),
            seq: (32, 512),
            param_bytes: 4,
            act_bytes: 2,
        }
    }
}

/// Training: parameters allocated once; optimizer state (two tensors per parameter, like
/// Adam) allocated at the first optimizer step; each iteration draws a batch and sequence
/// length, runs a forward pass (activations kept, temporaries freed at once), a backward pass
/// in reverse layer order (activation gradients, parameter gradients; each layer's
/// activations freed after its backward), an optimizer step, and `zero_grad(set_to_none)`.
pub fn train(p: &TrainParams, seed: u64) -> Trace {
    let mut r = Rng::new(seed);
    let mut b = Builder::default();
    let h = p.hidden;
    // Per layer: q, k, v, o (h x h), mlp up and down (h x 4h), two norms (h).
    let shapes: Vec<u64> = vec![h * h, h * h, h * h, h * h, 4 * h * h, 4 * h * h, h, h];
    let embed = 32_000 * h * p.param_bytes;
    let mut params = vec![b.alloc(embed, 0)];
    let mut sizes = vec![embed];
    for _ in 0..p.layers {
        for &s in &shapes {
            params.push(b.alloc(s * p.param_bytes, 0));
            sizes.push(s * p.param_bytes);
        }
    }
    let mut opt_state: Vec<u64> = Vec::new();
    let per_layer = shapes.len();
    for _it in 0..p.iterations {
        let batch = r.range(p.batch.0, p.batch.1);
        let seq = r.range(p.seq.0, p.seq.1);
        let tok = batch * seq;
        let unit = tok * h * p.act_bytes;
        let input = b.alloc(tok * 8, 0);
        // Forward.
        let mut acts: Vec<Vec<u64>> = Vec::new();
        for _l in 0..p.layers {
            let mut a = Vec::new();
            a.push(b.alloc(unit, 0)); // norm out
            a.push(b.alloc(3 * unit, 0)); // qkv
            let scores = b.alloc(batch * 16 * seq * seq.min(512) * p.act_bytes, 0);
            a.push(b.alloc(unit, 0)); // attention out
            b.free(scores);
            a.push(b.alloc(unit, 0)); // residual
            a.push(b.alloc(4 * unit, 0)); // mlp up
            let tmp = b.alloc(4 * unit, 0); // activation fn temporary
            a.push(b.alloc(4 * unit, 0)); // activation out
            b.free(tmp);
            a.push(b.alloc(unit, 0)); // mlp down
                                      // A few small tensors (bias views, masks, scalars).
            for _ in 0..r.range(2, 6) {
                let s = b.alloc(r.log_uniform(512, 64 * KIB), 0);
                a.push(s);
            }
            acts.push(a);
        }
        let logits = b.alloc(tok * 32_000 * p.act_bytes, 0);
        let loss = b.alloc(512, 0);
        b.free(logits);
        // Backward, in reverse.
        let mut grads = vec![0u64; params.len()];
        let mut dout = b.alloc(unit, 0);
        for l in (0..p.layers as usize).rev() {
            let a = acts.pop().expect("one per layer");
            for (j, id) in a.into_iter().enumerate().rev() {
                if j % 3 == 0 {
                    let t = b.alloc(unit * if j == 4 || j == 5 { 4 } else { 1 }, 0);
                    b.free(t);
                }
                b.free(id);
            }
            for k in 0..per_layer {
                let pi = 1 + l * per_layer + k;
                grads[pi] = b.alloc(sizes[pi], 0);
            }
            let d2 = b.alloc(unit, 0);
            b.free(dout);
            dout = d2;
        }
        grads[0] = b.alloc(sizes[0], 0);
        b.free(dout);
        b.free(loss);
        b.free(input);
        // Optimizer step: state on first use, a temporary per parameter group.
        if opt_state.is_empty() {
            for &s in &sizes {
                opt_state.push(b.alloc(s, 0));
                opt_state.push(b.alloc(s, 0));
            }
        }
        for chunk in sizes.chunks(per_layer) {
            let biggest = chunk.iter().copied().max().unwrap_or(512);
            let t = b.alloc(biggest, 0);
            b.free(t);
        }
        // zero_grad(set_to_none=True).
        for g in grads {
            b.free(g);
        }
    }
    for s in opt_state.into_iter().rev() {
        b.free(s);
    }
    for q in params.into_iter().rev() {
        b.free(q);
    }
    b.finish()
}

/// Parameters of the checkerboard generator.
#[derive(Clone, Debug)]
pub struct CheckerboardParams {
    /// Bytes to fill before freeing.
    pub fill_bytes: u64,
    /// Tensor size range, in whole MiB.
    pub tensor_mib: (u64, u64),
}

impl Default for CheckerboardParams {
    /// 129 GB (decimal) of 100–300 MiB tensors.
    fn default() -> Self {
        CheckerboardParams {
            fill_bytes: 129_000_000_000,
            tensor_mib: (100, 300),
        }
    }
}

impl CheckerboardParams {
    /// A scaled-down variant: 1.6 GB of 10–30 MiB tensors (replay it with a 2 GiB capacity
    /// to recreate the pressure of the full test).
    pub fn small() -> Self {
        CheckerboardParams {
            fill_bytes: 1_600_000_000,
            tensor_mib: (10, 30),
        }
    }
}

/// The checkerboard: fill `fill_bytes` with tensors of random whole-MiB sizes, free every
/// other one (the even ones), probe the largest single allocation ([`Event::ProbeLargest`]),
/// then free the rest.
pub fn checkerboard(p: &CheckerboardParams, seed: u64) -> Trace {
    let mut r = Rng::new(seed);
    let mut b = Builder::default();
    let mut ids = Vec::new();
    let mut total = 0;
    while total < p.fill_bytes {
        let bytes = r.range(p.tensor_mib.0, p.tensor_mib.1) * MIB;
        let bytes = bytes.min(p.fill_bytes - total).max(MIB);
        ids.push(b.alloc(bytes, 0));
        total += bytes;
    }
    for id in ids.iter().step_by(2) {
        b.free(*id);
    }
    b.events.push(Event::ProbeLargest);
    for id in ids.iter().skip(1).step_by(2) {
        b.free(*id);
    }
    b.finish()
}

/// Parameters of the adversarial generator.
#[derive(Clone, Debug)]
pub struct AdversarialParams {
    /// Number of events (allocations plus frees, before the final frees).
    pub events: u64,
    /// Keep live bytes under this (frees are forced above it).
    pub live_budget: u64,
    /// Largest request.
    pub max_bytes: u64,
    /// Streams used (0 ..= streams-1).
    pub streams: u64,
}

impl Default for AdversarialParams {
    fn default() -> Self {
        AdversarialParams {
            events: 200_000,
            live_budget: 100 * GIB,
            max_bytes: 2 * GIB,
            streams: 4,
        }
    }
}

impl AdversarialParams {
    /// A scaled-down variant.
    pub fn small() -> Self {
        AdversarialParams {
            events: 4_000,
            live_budget: 3 * GIB / 2,
            max_bytes: 256 * MIB,
            streams: 3,
        }
    }
}

/// A random mix: sizes from three classes (small 512 B–1 MiB, medium 1–64 MiB, large
/// 64 MiB–`max_bytes`, all log-uniform), random frees of random live allocations, allocations
/// on random streams and one free in ten on a different stream than its allocation.
pub fn adversarial(p: &AdversarialParams, seed: u64) -> Trace {
    let mut r = Rng::new(seed);
    let mut b = Builder::default();
    let mut live: Vec<(u64, u64, u64)> = Vec::new(); // (id, bytes, stream)
    let mut live_bytes = 0u64;
    let mut n = 0;
    while n < p.events {
        let want_alloc = live.is_empty() || r.chance(0.52);
        let bytes = match r.below(10) {
            0..=5 => r.log_uniform(512, MIB),
            6..=8 => r.log_uniform(MIB, 64 * MIB),
            _ => r.log_uniform(64 * MIB, p.max_bytes),
        };
        if want_alloc && live_bytes + bytes <= p.live_budget {
            let stream = r.below(p.streams);
            let id = b.alloc(bytes, stream);
            live.push((id, bytes, stream));
            live_bytes += bytes;
        } else if !live.is_empty() {
            let i = r.below(live.len() as u64) as usize;
            let (id, bytes, stream) = live.swap_remove(i);
            if r.chance(0.1) {
                b.free_on(id, (stream + 1) % p.streams);
            } else {
                b.free_on(id, stream);
            }
            live_bytes -= bytes;
        } else {
            continue;
        }
        n += 1;
    }
    for (id, _, stream) in live {
        b.free_on(id, stream);
    }
    b.finish()
}

/// Parameters of the serving generator (a decoder-only transformer, no grouped-query
/// attention: K and V are `hidden` wide).
#[derive(Clone, Debug)]
pub struct ServeParams {
    /// Transformer layers.
    pub layers: u64,
    /// Hidden size.
    pub hidden: u64,
    /// MLP width.
    pub intermediate: u64,
    /// Vocabulary size (embedding, LM head, logits).
    pub vocab: u64,
    /// Bytes per element (2: bf16).
    pub elem_bytes: u64,
    /// Requests served in all.
    pub requests: u64,
    /// Most requests decoding at once.
    pub max_active: u64,
    /// Most requests admitted (prefilled) per step.
    pub admit_per_step: u64,
    /// Prompt length range (tokens).
    pub prompt_tokens: (u64, u64),
    /// Generated length range (tokens).
    pub gen_tokens: (u64, u64),
}

impl Default for ServeParams {
    /// The zoo's `serve` workload (scripts/torch-zoo.py: 4 layers of 1536, 48 requests, 16
    /// at once, prompts of 32-1024 tokens, 8-160 new tokens): K and V tensors of 3 KiB per
    /// token, so that they cross the small threshold (256 KiB) and half a granule as they grow.
    fn default() -> Self {
        ServeParams {
            layers: 4,
            hidden: 1536,
            intermediate: 4096,
            vocab: 32_000,
            elem_bytes: 2,
            requests: 48,
            max_active: 16,
            admit_per_step: 2,
            prompt_tokens: (32, 1024),
            gen_tokens: (8, 160),
        }
    }
}

impl ServeParams {
    /// A scaled-down variant: a few ten thousand events, K and V tensors up to about 1.5 MiB.
    pub fn small() -> Self {
        ServeParams {
            layers: 2,
            hidden: 1024,
            intermediate: 2816,
            vocab: 8_000,
            elem_bytes: 2,
            requests: 10,
            max_active: 5,
            admit_per_step: 2,
            prompt_tokens: (16, 760),
            gen_tokens: (8, 48),
        }
    }
}

/// Serving as a Hugging Face model with a `DynamicCache` does it: the weights; requests
/// admitted up to `max_active` (a prefill each: per layer the activations of the prompt,
/// its K and V kept as the cache, then the logits of every prompt token); then one decode
/// step for every active request per round, in which each layer's K and V are re-allocated
/// one token longer and the old ones freed after the copy (`torch.cat`), beside the step's
/// small activations; a finished request frees its cache.
pub fn serve(p: &ServeParams, seed: u64) -> Trace {
    struct Req {
        /// Per layer: the ids of its K and V tensors, `len` tokens long.
        kv: Vec<(u64, u64)>,
        len: u64,
        /// Tokens still to generate.
        left: u64,
    }
    let mut r = Rng::new(seed);
    let mut b = Builder::default();
    let e = p.elem_bytes;
    let row = p.hidden * e; // one token's hidden state, and one token of K (or V)
    let mlp_row = p.intermediate * e;
    // Weights: embedding and LM head; per layer four attention and three MLP matrices and
    // two norms.
    let mut weights = vec![b.alloc(p.vocab * row, 0)];
    for _ in 0..p.layers {
        for _ in 0..4 {
            weights.push(b.alloc(p.hidden * row, 0));
        }
        for _ in 0..3 {
            weights.push(b.alloc(p.hidden * mlp_row, 0));
        }
        weights.push(b.alloc(row, 0));
        weights.push(b.alloc(row, 0));
    }
    weights.push(b.alloc(row, 0));
    weights.push(b.alloc(p.vocab * row, 0));
    // One layer's forward over `t` tokens: the norm, the projections, attention, the MLP;
    // returns the new K and V (kept by the caller) and frees everything else.
    let layer = |b: &mut Builder, t: u64| -> (u64, u64) {
        let h = b.alloc(t * row, 0);
        let q = b.alloc(t * row, 0);
        let k = b.alloc(t * row, 0);
        let v = b.alloc(t * row, 0);
        let qr = b.alloc(t * row, 0);
        let kr = b.alloc(t * row, 0);
        b.free(q);
        b.free(k);
        b.free(h);
        let attn = b.alloc(t * row, 0);
        b.free(qr);
        let o = b.alloc(t * row, 0);
        b.free(attn);
        let res = b.alloc(t * row, 0);
        b.free(o);
        let h2 = b.alloc(t * row, 0);
        let gate = b.alloc(t * mlp_row, 0);
        let up = b.alloc(t * mlp_row, 0);
        let act = b.alloc(t * mlp_row, 0);
        b.free(gate);
        let mul = b.alloc(t * mlp_row, 0);
        b.free(act);
        b.free(up);
        let down = b.alloc(t * row, 0);
        b.free(mul);
        b.free(h2);
        let out = b.alloc(t * row, 0);
        b.free(down);
        b.free(res);
        b.free(out);
        (kr, v)
    };
    let mut active: Vec<Req> = Vec::new();
    let (mut arrived, mut done) = (0, 0);
    while done < p.requests {
        for _ in 0..p.admit_per_step {
            if arrived == p.requests || active.len() as u64 >= p.max_active {
                break;
            }
            let prompt = r.range(p.prompt_tokens.0, p.prompt_tokens.1);
            let gen = r.range(p.gen_tokens.0, p.gen_tokens.1);
            let ids = b.alloc(prompt * 8, 0);
            let kv: Vec<(u64, u64)> = (0..p.layers).map(|_| layer(&mut b, prompt)).collect();
            let logits = b.alloc(prompt * p.vocab * e, 0);
            let last = b.alloc(p.vocab * e, 0);
            b.free(logits);
            b.free(ids);
            b.free(last);
            active.push(Req {
                kv,
                len: prompt,
                left: gen,
            });
            arrived += 1;
        }
        for q in active.iter_mut() {
            for kv in q.kv.iter_mut() {
                let (k1, v1) = layer(&mut b, 1);
                // torch.cat: the longer tensor first, the old one freed after the copy.
                let k = b.alloc((q.len + 1) * row, 0);
                b.free(kv.0);
                b.free(k1);
                let v = b.alloc((q.len + 1) * row, 0);
                b.free(kv.1);
                b.free(v1);
                *kv = (k, v);
            }
            let logits = b.alloc(p.vocab * e, 0);
            b.free(logits);
            q.len += 1;
            q.left = q.left.saturating_sub(1);
        }
        let mut i = 0;
        while i < active.len() {
            if active[i].left == 0 {
                let q = active.swap_remove(i);
                for (k, v) in q.kv {
                    b.free(k);
                    b.free(v);
                }
                done += 1;
            } else {
                i += 1;
            }
        }
    }
    for w in weights.into_iter().rev() {
        b.free(w);
    }
    b.finish()
}

/// Parameters of the random-churn generator.
#[derive(Clone, Debug)]
pub struct ChurnParams {
    /// Steps; each allocates, grows a KV tensor or frees a temporary.
    pub steps: u64,
    /// KV tensors, each starting at `kv_start` bytes.
    pub kv_tensors: u64,
    /// A KV tensor's first size, and its size again once growing would pass `kv_max`.
    pub kv_start: u64,
    /// The largest KV tensor.
    pub kv_max: u64,
    /// Temporaries' sizes, log-uniform in this range.
    pub temp_bytes: (u64, u64),
    /// Live temporaries are freed at random while their bytes exceed this.
    pub temp_cap: u64,
}

impl Default for ChurnParams {
    /// About 9,200 events, peak live about 27 GiB.
    fn default() -> Self {
        ChurnParams {
            steps: 6000,
            kv_tensors: 24,
            kv_start: 16 * MIB,
            kv_max: GIB,
            temp_bytes: (MIB, 512 * MIB),
            temp_cap: 8 * GIB,
        }
    }
}

impl ChurnParams {
    /// A scaled-down variant: about 2,300 events, under 2 GiB live.
    pub fn small() -> Self {
        ChurnParams {
            steps: 1500,
            kv_tensors: 8,
            kv_start: 4 * MIB,
            kv_max: 96 * MIB,
            temp_bytes: (MIB, 64 * MIB),
            temp_cap: GIB,
        }
    }
}

/// Random churn under a fixed live budget, on one stream: at each step a KV tensor grows by
/// realloc (2–16 MiB more, back to `kv_start` past `kv_max`; the old one freed after the
/// copy), a temporary is allocated, a random live temporary is freed, or a small tensor
/// (4 KiB–1 MiB) is allocated, in proportions 35 / 35 / 25 / 5; temporaries are freed at
/// random while their bytes exceed `temp_cap`. Live bytes stay near their peak, so most large
/// requests miss every free block: the workload where an allocator either grows (a caching
/// allocator's fragmentation) or gathers free memory on every miss (stitching's driver time).
pub fn churn(p: &ChurnParams, seed: u64) -> Trace {
    let mut r = Rng::new(seed);
    let mut b = Builder::default();
    let mut kv: Vec<(u64, u64)> = (0..p.kv_tensors)
        .map(|_| (b.alloc(p.kv_start, 0), p.kv_start))
        .collect();
    let mut temps: Vec<(u64, u64)> = Vec::new();
    let mut temp_live = 0u64;
    for _ in 0..p.steps {
        match r.below(100) {
            0..=34 if !kv.is_empty() => {
                let i = r.below(kv.len() as u64) as usize;
                let (old, size) = kv[i];
                let grown = size + r.range(1, 8) * 2 * MIB;
                let size = if grown > p.kv_max { p.kv_start } else { grown };
                let id = b.alloc(size, 0);
                b.free(old);
                kv[i] = (id, size);
            }
            0..=69 => {
                let size = r.log_uniform(p.temp_bytes.0, p.temp_bytes.1);
                temps.push((b.alloc(size, 0), size));
                temp_live += size;
            }
            70..=94 => {
                if !temps.is_empty() {
                    let (id, size) = temps.swap_remove(r.below(temps.len() as u64) as usize);
                    b.free(id);
                    temp_live -= size;
                }
            }
            _ => {
                let size = r.log_uniform(4 * KIB, MIB);
                temps.push((b.alloc(size, 0), size));
                temp_live += size;
            }
        }
        while temp_live > p.temp_cap {
            let (id, size) = temps.swap_remove(r.below(temps.len() as u64) as usize);
            b.free(id);
            temp_live -= size;
        }
    }
    for (id, _) in temps.into_iter().chain(kv) {
        b.free(id);
    }
    b.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn math_matches_libm_closely() {
        for x in [1.0, 1.5, 2.0, 512.0, 1e6, 3.3e9, 2.1e12] {
            assert!((log2(x) - f64::log2(x)).abs() < 1e-12, "{x}");
        }
        for y in [0.0, 0.25, 0.999, 9.0, 20.5, 31.0] {
            assert!((exp2(y) / f64::exp2(y) - 1.0).abs() < 1e-12, "{y}");
        }
        let mut r = Rng::new(1);
        for _ in 0..1000 {
            let v = r.log_uniform(512, 1 << 30);
            assert!((512..=1 << 30).contains(&v));
        }
    }
}
