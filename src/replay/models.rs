//! Models of PyTorch's two CUDA caching allocators, to answer "what would stitch-alloc save
//! against what I run today?" for any trace.
//!
//! [`simulate`] replays a [`Trace`]'s allocations and frees through a model of
//! [`Model::PyTorchDefault`] (the caching allocator) or [`Model::PyTorchExpandable`]
//! (`expandable_segments:True`) and reports the peak reserved bytes. The models are
//! accounting only (no memory is touched) and follow the rules of
//! `c10/cuda/CUDACachingAllocator.cpp` as `../shared/anchors.md` section 3 summarises them;
//! the constants below name the C++ constants they stand for.
//!
//! What both models leave out: GPU lag (a freed block is reused on its stream at once, as if
//! every recorded stream event had completed), `max_split_size`, `roundup_power2_divisions`,
//! garbage collection thresholds and `empty_cache` calls the program made (none are in a
//! trace). Segments get model addresses, placed downward as cudaMalloc mostly places them
//! (best fit breaks size ties by address, so the order matters; see `State::next_base`).
//! Each stream has its own pools; a block freed on another stream goes back to the
//! pool of the stream that allocated it.
//!
//! ```
//! use stitch_alloc::replay::models::{simulate, Model};
//! use stitch_alloc::trace::Trace;
//! // Two 1 MiB tensors share one 2 MiB small segment.
//! let t = Trace::parse_str("a 1 1048576\na 2 1048576\n").unwrap();
//! let r = simulate(&t, Model::PyTorchDefault, 1 << 40);
//! assert_eq!(r.peak_reserved_bytes, 2 << 20);
//! ```
#![forbid(unsafe_code)]

use crate::trace::{Event, Trace};
use rustc_hash::FxHashMap;
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};

const MIB: u64 = 1 << 20;
/// `kMinBlockSize`: every request is rounded up to a multiple of 512 B.
const MIN_BLOCK: u64 = 512;
/// `kSmallSize`: requests up to 1 MiB (after rounding) are served from the small pool.
const SMALL_SIZE: u64 = MIB;
/// `kSmallBuffer`: the small pool's segment size (and expandable page size).
const SMALL_BUFFER: u64 = 2 * MIB;
/// `kLargeBuffer`: the segment size for large-pool requests under `kMinLargeAlloc` (and the
/// large pool's expandable page size).
const LARGE_BUFFER: u64 = 20 * MIB;
/// `kMinLargeAlloc`: requests of 10 MiB or more get a segment of their own.
const MIN_LARGE_ALLOC: u64 = 10 * MIB;
/// `kRoundLarge`: such segments are rounded up to 2 MiB.
const ROUND_LARGE: u64 = 2 * MIB;
/// The model address space's top: segments are placed downward from here.
const FIRST_BASE: u64 = 1 << 62;

/// Which allocator to model.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize)]
pub enum Model {
    /// PyTorch's default caching allocator: cudaMalloc'd segments, split and coalesced,
    /// cached for the whole run.
    #[serde(rename = "pytorch-default")]
    PyTorchDefault,
    /// PyTorch with `expandable_segments:True`: one growing segment per stream and pool,
    /// mapped in 2 MiB (small) or 20 MiB (large) pages.
    #[serde(rename = "pytorch-expandable")]
    PyTorchExpandable,
}

impl Model {
    /// The name the tables print.
    pub fn name(self) -> &'static str {
        match self {
            Model::PyTorchDefault => "PyTorch default (model)",
            Model::PyTorchExpandable => "PyTorch expandable (model)",
        }
    }
}

/// What a model's replay found.
#[derive(Clone, Debug, Serialize)]
pub struct ModelReport {
    /// The allocator modeled.
    pub model: Model,
    /// The most bytes held in segments (default) or mapped pages (expandable) at once.
    pub peak_reserved_bytes: u64,
    /// The most requested bytes live at once (allocations the model could not serve
    /// excluded).
    pub peak_live_bytes: u64,
    /// `peak_reserved_bytes / peak_live_bytes` (0 when nothing was live).
    pub ratio: f64,
    /// Segments created (cudaMalloc calls) or pages mapped.
    pub device_allocs: u64,
    /// Times a request over the capacity made the model release its cached memory and
    /// retry (PyTorch's `num_alloc_retries`).
    pub alloc_retries: u64,
    /// Requests that still did not fit after the retry (PyTorch's `num_ooms`).
    pub failed_allocs: u64,
}

/// Pool key: (stream, small pool?).
type PoolKey = (u64, bool);

/// A block: a run of bytes inside one segment, free or handed out.
#[derive(Copy, Clone, Debug)]
struct Block {
    /// Bytes, a multiple of [`MIN_BLOCK`].
    size: u64,
    /// Index into `State::segments`; blocks coalesce only within one segment.
    seg: usize,
    /// Free blocks are also in their pool's `free` set, keyed by (size, address).
    free: bool,
}

/// A segment: a cudaMalloc'd range (default) or an expandable segment's mapped prefix.
#[derive(Copy, Clone, Debug)]
struct Segment {
    /// Start address (model addresses: segments never adjoin).
    base: u64,
    /// Bytes held: the whole segment (default) or its mapped pages (expandable). Blocks
    /// tile `[base, base + size)` exactly.
    size: u64,
    key: PoolKey,
    /// False once released (default model, OOM path only).
    live: bool,
}

struct State {
    model: Model,
    capacity: u64,
    /// Every block by address; blocks of one segment tile it with no gap.
    blocks: BTreeMap<u64, Block>,
    /// Free blocks of each pool, by (size, address): the best fit is the first at or above
    /// the request.
    free: FxHashMap<PoolKey, BTreeSet<(u64, u64)>>,
    segments: Vec<Segment>,
    /// Expandable model: the one segment of each pool.
    expandable: FxHashMap<PoolKey, usize>,
    /// Start of the lowest segment so far: each new segment goes below it, with a gap.
    /// Addresses decrease because cudaMalloc on the H200 mostly hands them out top down
    /// (41 of the 45 steps between hf-generate's segments, 138 of lora's 222, in the zoo
    /// snapshots), and best fit breaks ties between equal sizes by the lower address: with
    /// increasing addresses the default model was 5.5% high on hf-generate, exact with
    /// decreasing ones (design/replay-results.md).
    next_base: u64,
    /// Sum of live segments' sizes; at most `capacity`.
    reserved: u64,
    device_allocs: u64,
    retries: u64,
}

fn round_up(x: u64, to: u64) -> u64 {
    x.div_ceil(to) * to
}

/// `round_size`: requests rounded up to 512 B (at least 512 B).
fn round_size(bytes: u64) -> u64 {
    round_up(bytes.max(1), MIN_BLOCK)
}

/// `get_allocation_size`: the default allocator's segment size for a rounded request.
fn segment_size(size: u64) -> u64 {
    if size <= SMALL_SIZE {
        SMALL_BUFFER
    } else if size < MIN_LARGE_ALLOC {
        LARGE_BUFFER
    } else {
        round_up(size, ROUND_LARGE)
    }
}

impl State {
    fn new(model: Model, capacity: u64) -> Self {
        State {
            model,
            capacity,
            blocks: BTreeMap::new(),
            free: FxHashMap::default(),
            segments: Vec::new(),
            expandable: FxHashMap::default(),
            next_base: FIRST_BASE,
            reserved: 0,
            device_allocs: 0,
            retries: 0,
        }
    }

    /// `should_split`: the small pool (and every pool under expandable segments) splits
    /// when at least 512 B remain; the default large pool only when more than 1 MiB remains.
    fn should_split(&self, small: bool, remaining: u64) -> bool {
        if small || self.model == Model::PyTorchExpandable {
            remaining >= MIN_BLOCK
        } else {
            remaining > SMALL_SIZE
        }
    }

    fn free_set(&mut self, key: PoolKey) -> &mut BTreeSet<(u64, u64)> {
        self.free.entry(key).or_default()
    }

    /// Hand out `size` bytes from the start of the free block at `addr`, splitting off the
    /// rest when [`Self::should_split`] says so.
    fn take(&mut self, addr: u64, size: u64) -> u64 {
        let b = self.blocks[&addr];
        let key = self.segments[b.seg].key;
        self.free_set(key).remove(&(b.size, addr));
        let remaining = b.size - size;
        let mut used = b;
        used.free = false;
        if self.should_split(key.1, remaining) {
            used.size = size;
            let rest = Block {
                size: remaining,
                seg: b.seg,
                free: true,
            };
            self.blocks.insert(addr + size, rest);
            self.free_set(key).insert((remaining, addr + size));
        }
        self.blocks.insert(addr, used);
        addr
    }

    /// A new segment of `size` bytes for `key`, as one free block (0 bytes: no block).
    fn new_segment(&mut self, key: PoolKey, size: u64, span: u64) -> usize {
        let seg = self.segments.len();
        // Below the previous segment, with a gap (see `State::next_base`).
        self.next_base -= span + LARGE_BUFFER;
        let base = self.next_base;
        self.segments.push(Segment {
            base,
            size,
            key,
            live: true,
        });
        if size > 0 {
            self.blocks.insert(
                base,
                Block {
                    size,
                    seg,
                    free: true,
                },
            );
            self.free_set(key).insert((size, base));
        }
        seg
    }

    /// The OOM path: give back every wholly free cached segment (default) or the free
    /// pages at the end of every expandable segment (expandable).
    fn release_cached(&mut self) {
        self.retries += 1;
        for seg in 0..self.segments.len() {
            let s = self.segments[seg];
            if !s.live || s.size == 0 {
                continue;
            }
            match self.model {
                Model::PyTorchDefault => {
                    let b = self.blocks[&s.base];
                    if b.free && b.size == s.size {
                        self.blocks.remove(&s.base);
                        self.free_set(s.key).remove(&(b.size, s.base));
                        self.segments[seg].live = false;
                        self.reserved -= s.size;
                    }
                }
                Model::PyTorchExpandable => {
                    let end = s.base + s.size;
                    let (&addr, &b) = self.blocks.range(..end).next_back().expect("tiled");
                    if !b.free {
                        continue;
                    }
                    let page = page_size(s.key.1);
                    let keep_to = round_up(addr, page).max(s.base);
                    let cut = end - keep_to;
                    if cut == 0 {
                        continue;
                    }
                    self.free_set(s.key).remove(&(b.size, addr));
                    if keep_to > addr {
                        let mut k = b;
                        k.size = keep_to - addr;
                        self.blocks.insert(addr, k);
                        self.free_set(s.key).insert((k.size, addr));
                    } else {
                        self.blocks.remove(&addr);
                    }
                    self.segments[seg].size -= cut;
                    self.reserved -= cut;
                }
            }
        }
    }

    /// Make room for `need` more reserved bytes, through the OOM path if needed.
    fn fits(&mut self, need: impl Fn(&Self) -> u64) -> bool {
        if self.reserved + need(self) <= self.capacity {
            return true;
        }
        self.release_cached();
        self.reserved + need(self) <= self.capacity
    }

    fn alloc(&mut self, bytes: u64, stream: u64) -> Option<u64> {
        let size = round_size(bytes);
        let key = (stream, size <= SMALL_SIZE);
        if let Some(&(_, addr)) = self.free_set(key).range((size, 0)..).next() {
            return Some(self.take(addr, size));
        }
        match self.model {
            Model::PyTorchDefault => {
                let seg_size = segment_size(size);
                if !self.fits(|_| seg_size) {
                    return None;
                }
                let seg = self.new_segment(key, seg_size, seg_size);
                self.reserved += seg_size;
                self.device_allocs += 1;
                Some(self.take(self.segments[seg].base, size))
            }
            Model::PyTorchExpandable => {
                let page = page_size(key.1);
                let seg = match self.expandable.get(&key) {
                    Some(&s) => s,
                    None => {
                        let span = round_up(self.capacity, LARGE_BUFFER);
                        let s = self.new_segment(key, 0, span);
                        self.expandable.insert(key, s);
                        s
                    }
                };
                // The free bytes at the segment's end, which the new pages extend.
                let tail = |st: &Self| -> Option<(u64, Block)> {
                    let s = st.segments[seg];
                    let (&a, &b) = st.blocks.range(s.base..s.base + s.size).next_back()?;
                    b.free.then_some((a, b))
                };
                let grow = |st: &Self| {
                    let have = tail(st).map_or(0, |(_, b)| b.size);
                    round_up(size - have, page)
                };
                if !self.fits(grow) {
                    return None;
                }
                let add = grow(self);
                let end = self.segments[seg].base + self.segments[seg].size;
                let addr = match tail(self) {
                    Some((a, mut b)) => {
                        self.free_set(key).remove(&(b.size, a));
                        b.size += add;
                        self.blocks.insert(a, b);
                        self.free_set(key).insert((b.size, a));
                        a
                    }
                    None => {
                        let b = Block {
                            size: add,
                            seg,
                            free: true,
                        };
                        self.blocks.insert(end, b);
                        self.free_set(key).insert((add, end));
                        end
                    }
                };
                self.segments[seg].size += add;
                self.reserved += add;
                self.device_allocs += add / page;
                Some(self.take(addr, size))
            }
        }
    }

    /// Free the block at `addr`, coalescing it with free neighbours in its segment.
    fn free(&mut self, addr: u64) {
        let mut b = self.blocks[&addr];
        let key = self.segments[b.seg].key;
        let mut start = addr;
        if let Some((&n, &nb)) = self.blocks.range(addr + 1..).next() {
            if n == addr + b.size && nb.seg == b.seg && nb.free {
                self.free_set(key).remove(&(nb.size, n));
                self.blocks.remove(&n);
                b.size += nb.size;
            }
        }
        if let Some((&p, &pb)) = self.blocks.range(..addr).next_back() {
            if p + pb.size == addr && pb.seg == b.seg && pb.free {
                self.free_set(key).remove(&(pb.size, p));
                self.blocks.remove(&addr);
                b.size += pb.size;
                start = p;
            }
        }
        b.free = true;
        self.blocks.insert(start, b);
        self.free_set(key).insert((b.size, start));
    }
}

/// The expandable segment page size of a pool.
fn page_size(small: bool) -> u64 {
    if small {
        SMALL_BUFFER
    } else {
        LARGE_BUFFER
    }
}

/// Replay `trace` through a model of `model` on a device of `capacity` bytes.
///
/// A free with no stream goes back to its allocation's pool (so does every free: blocks
/// return to the stream that allocated them). An allocation the model cannot serve is
/// counted in `failed_allocs` and its free skipped. Probe events are ignored.
///
/// ```
/// use stitch_alloc::replay::models::{simulate, Model};
/// use stitch_alloc::trace::Trace;
/// // A 30 MiB tensor: its own 30 MiB segment, or two 20 MiB pages.
/// let t = Trace::parse_str("a 1 31457280\n").unwrap();
/// assert_eq!(simulate(&t, Model::PyTorchDefault, 1 << 40).peak_reserved_bytes, 30 << 20);
/// assert_eq!(simulate(&t, Model::PyTorchExpandable, 1 << 40).peak_reserved_bytes, 40 << 20);
/// ```
pub fn simulate(trace: &Trace, model: Model, capacity: u64) -> ModelReport {
    let mut st = State::new(model, capacity);
    // Trace id -> (address, requested bytes); None for an allocation that failed.
    let mut live_ids: FxHashMap<u64, Option<(u64, u64)>> = FxHashMap::default();
    let (mut live, mut peak_live, mut peak_reserved, mut failed) = (0u64, 0u64, 0u64, 0u64);
    for ev in &trace.events {
        match *ev {
            Event::Alloc { id, bytes, stream } => match st.alloc(bytes, stream) {
                Some(addr) => {
                    live_ids.insert(id, Some((addr, bytes)));
                    live += bytes;
                    peak_live = peak_live.max(live);
                    peak_reserved = peak_reserved.max(st.reserved);
                }
                None => {
                    failed += 1;
                    live_ids.insert(id, None);
                }
            },
            Event::Free { id, .. } => {
                if let Some(Some((addr, bytes))) = live_ids.remove(&id) {
                    st.free(addr);
                    live -= bytes;
                }
            }
            Event::ProbeLargest => {}
        }
    }
    ModelReport {
        model,
        peak_reserved_bytes: peak_reserved,
        peak_live_bytes: peak_live,
        ratio: if peak_live > 0 {
            peak_reserved as f64 / peak_live as f64
        } else {
            0.0
        },
        device_allocs: st.device_allocs,
        alloc_retries: st.retries,
        failed_allocs: failed,
    }
}

/// One row of `stitch replay --compare`.
#[derive(Clone, Debug, Serialize)]
pub struct CompareRow {
    /// The allocator ([`Model::name`], or `"stitch-alloc"`).
    pub allocator: String,
    /// Its peak reserved bytes over the trace.
    pub peak_reserved_bytes: u64,
    /// `peak_reserved_bytes / peak_live_bytes`.
    pub ratio: f64,
    /// `peak_reserved_bytes` minus stitch-alloc's: what stitch-alloc saves against this
    /// allocator (negative: what it costs; 0 on stitch-alloc's own row).
    pub stitch_saves_bytes: i64,
    /// Allocations this allocator could not serve.
    pub failed_allocs: u64,
}

/// PyTorch's own recorded figure beside the model of the allocator that recorded it.
#[derive(Clone, Debug, Serialize)]
pub struct RecordedRow {
    /// The model of the recording allocator.
    pub model: Model,
    /// PyTorch's recorded peak reserved bytes.
    pub recorded_peak_reserved_bytes: u64,
    /// The model's peak reserved bytes over the same trace.
    pub model_peak_reserved_bytes: u64,
    /// `(model - recorded) / recorded`, in percent.
    pub model_error_pct: f64,
}

/// `stitch replay --compare`: stitch-alloc against models of PyTorch's allocators.
#[derive(Clone, Debug, Serialize)]
pub struct Comparison {
    /// The default model's row, the expandable model's row, stitch-alloc's row.
    pub rows: Vec<CompareRow>,
    /// For a PyTorch snapshot that records its segments: the recorded figure and the
    /// model's error.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub recorded: Option<RecordedRow>,
}

/// Compare stitch-alloc's replay (`stitch_reserved`, `stitch_live`, `stitch_failed`) of
/// `trace` with both models on a device of `capacity` bytes. `recorded` is PyTorch's own
/// peak reserved bytes and whether it ran with expandable segments.
///
/// ```
/// use stitch_alloc::replay::models::compare;
/// use stitch_alloc::trace::Trace;
/// let t = Trace::parse_str("a 1 31457280\n").unwrap();
/// let c = compare(&t, 1 << 40, 30 << 20, 30 << 20, 0, Some((32 << 20, false)));
/// assert_eq!(c.rows[1].stitch_saves_bytes, 10 << 20);
/// assert_eq!(c.recorded.unwrap().model_error_pct, -6.25);
/// ```
pub fn compare(
    trace: &Trace,
    capacity: u64,
    stitch_reserved: u64,
    stitch_live: u64,
    stitch_failed: u64,
    recorded: Option<(u64, bool)>,
) -> Comparison {
    let saves =
        |x: u64| i64::try_from(i128::from(x) - i128::from(stitch_reserved)).unwrap_or(i64::MAX);
    let models =
        [Model::PyTorchDefault, Model::PyTorchExpandable].map(|m| simulate(trace, m, capacity));
    let mut rows: Vec<CompareRow> = models
        .iter()
        .map(|r| CompareRow {
            allocator: r.model.name().to_string(),
            peak_reserved_bytes: r.peak_reserved_bytes,
            ratio: r.ratio,
            stitch_saves_bytes: saves(r.peak_reserved_bytes),
            failed_allocs: r.failed_allocs,
        })
        .collect();
    rows.push(CompareRow {
        allocator: "stitch-alloc".to_string(),
        peak_reserved_bytes: stitch_reserved,
        ratio: if stitch_live > 0 {
            stitch_reserved as f64 / stitch_live as f64
        } else {
            0.0
        },
        stitch_saves_bytes: 0,
        failed_allocs: stitch_failed,
    });
    let recorded = recorded.map(|(bytes, expandable)| {
        let m = &models[usize::from(expandable)];
        RecordedRow {
            model: m.model,
            recorded_peak_reserved_bytes: bytes,
            model_peak_reserved_bytes: m.peak_reserved_bytes,
            model_error_pct: if bytes > 0 {
                100.0 * (m.peak_reserved_bytes as f64 - bytes as f64) / bytes as f64
            } else {
                0.0
            },
        }
    });
    Comparison { rows, recorded }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(text: &str, model: Model, cap: u64) -> ModelReport {
        simulate(&Trace::parse_str(text).unwrap(), model, cap)
    }
    const BIG: u64 = 1 << 40;

    #[test]
    fn small_tensors_share_a_small_segment() {
        let r = run("a 1 1048576\na 2 1048576\n", Model::PyTorchDefault, BIG);
        assert_eq!((r.peak_reserved_bytes, r.device_allocs), (2 * MIB, 1));
        // A third does not fit: a second small segment.
        let r = run(
            "a 1 1048576\na 2 1048576\na 3 1\n",
            Model::PyTorchDefault,
            BIG,
        );
        assert_eq!(r.peak_reserved_bytes, 4 * MIB);
        let r = run(
            "a 1 1048576\na 2 1048576\na 3 1\n",
            Model::PyTorchExpandable,
            BIG,
        );
        assert_eq!((r.peak_reserved_bytes, r.device_allocs), (4 * MIB, 2));
    }

    #[test]
    fn large_requests_get_own_segment_or_pages() {
        let t = "a 1 31457280\n";
        assert_eq!(
            run(t, Model::PyTorchDefault, BIG).peak_reserved_bytes,
            30 * MIB
        );
        assert_eq!(
            run(t, Model::PyTorchExpandable, BIG).peak_reserved_bytes,
            40 * MIB
        );
        // 3 MiB requests come from one 20 MiB segment (6 of them fit: 18 MiB).
        let six = (1..=7)
            .map(|i| format!("a {i} 3145728\n"))
            .collect::<String>();
        assert_eq!(
            run(&six, Model::PyTorchDefault, BIG).peak_reserved_bytes,
            40 * MIB
        );
        // Expandable: 21 MiB live after 7 requests: two 20 MiB pages.
        assert_eq!(
            run(&six, Model::PyTorchExpandable, BIG).peak_reserved_bytes,
            40 * MIB
        );
    }

    #[test]
    fn free_blocks_coalesce_and_are_reused() {
        // Two 5 MiB blocks in one 20 MiB segment, freed, then 12 MiB: the coalesced 20 MiB
        // free segment serves it (best fit over the whole pool), no new segment.
        let t = "a 1 5242880\na 2 5242880\nf 1\nf 2\na 3 12582912\n";
        let r = run(t, Model::PyTorchDefault, BIG);
        assert_eq!((r.peak_reserved_bytes, r.device_allocs), (20 * MIB, 1));
        // Without coalescing (2 still live) the 12 MiB request needs its own segment.
        let t = "a 1 5242880\na 2 5242880\nf 1\na 3 12582912\n";
        assert_eq!(
            run(t, Model::PyTorchDefault, BIG).peak_reserved_bytes,
            32 * MIB
        );
    }

    #[test]
    fn split_thresholds() {
        // Default large pool: a remainder of 1 MiB stays in the block, more is split off.
        let mut st = State::new(Model::PyTorchDefault, BIG);
        st.alloc(15 * MIB, 0); // own 16 MiB segment, 1 MiB left: not split
        assert_eq!(st.blocks.len(), 1);
        st.alloc(11 * MIB, 0); // own 12 MiB segment, 1 MiB left: not split
        assert_eq!(st.blocks.len(), 2);
        st.alloc(5 * MIB, 0); // 20 MiB segment, 15 MiB left: split
        assert_eq!(st.blocks.len(), 4);
        // Small pool: 512 B remainders are split off, under expandable every pool is.
        let mut st = State::new(Model::PyTorchDefault, BIG);
        st.alloc(SMALL_BUFFER - 512, 0);
        assert_eq!(st.blocks.len(), 2);
        let mut st = State::new(Model::PyTorchExpandable, BIG);
        st.alloc(15 * MIB, 0);
        st.alloc(LARGE_BUFFER + 11 * MIB, 1);
        assert_eq!(st.blocks.len(), 4);
    }

    #[test]
    fn expandable_maps_only_the_missing_part() {
        // 15 MiB then 10 MiB: one page, then the tail's 5 MiB free + one more page.
        let t = "a 1 15728640\na 2 10485760\n";
        let r = run(t, Model::PyTorchExpandable, BIG);
        assert_eq!((r.peak_reserved_bytes, r.device_allocs), (40 * MIB, 2));
        // The default model: 15 MiB (>= 10 MiB) gets its own 16 MiB segment, 10 MiB its own
        // 10 MiB segment.
        let r = run(t, Model::PyTorchDefault, BIG);
        assert_eq!(r.peak_reserved_bytes, 26 * MIB);
    }

    #[test]
    fn equal_sizes_tie_break_on_the_lower_address_the_newer_segment() {
        let mut st = State::new(Model::PyTorchDefault, BIG);
        let a = st.alloc(12 * MIB, 0).unwrap();
        let b = st.alloc(12 * MIB, 0).unwrap();
        assert!(b < a, "segments are placed downward");
        st.free(a);
        st.free(b);
        assert_eq!(st.alloc(12 * MIB, 0), Some(b));
    }

    #[test]
    fn streams_have_their_own_pools() {
        let t = "a 1 1024 0\nf 1\na 2 1024 1\n";
        assert_eq!(
            run(t, Model::PyTorchDefault, BIG).peak_reserved_bytes,
            4 * MIB
        );
        assert_eq!(
            run(t, Model::PyTorchExpandable, BIG).peak_reserved_bytes,
            4 * MIB
        );
    }

    #[test]
    fn oom_path_releases_cached_segments_and_retries() {
        // Capacity 64 MiB: a 40 MiB segment cached and free is too small for 50 MiB, and
        // 40 + 50 MiB is over the capacity: release it and retry.
        let t = "a 1 41943040\nf 1\na 2 52428800\n";
        let r = run(t, Model::PyTorchDefault, 64 * MIB);
        assert_eq!((r.alloc_retries, r.failed_allocs), (1, 0));
        assert_eq!(r.peak_reserved_bytes, 50 * MIB);
        let r = run(t, Model::PyTorchExpandable, 64 * MIB);
        // 40 MiB mapped; 50 MiB reuses the 40 MiB free tail plus one page: 60 MiB, no retry.
        assert_eq!((r.alloc_retries, r.failed_allocs), (0, 0));
        assert_eq!(r.peak_reserved_bytes, 60 * MIB);
        // Too big even after the retry.
        let r = run(
            "a 1 41943040\na 2 41943040\n",
            Model::PyTorchDefault,
            64 * MIB,
        );
        assert_eq!((r.alloc_retries, r.failed_allocs), (1, 1));
    }

    #[test]
    fn expandable_oom_path_unmaps_free_tail_pages() {
        // Small pool on stream 1 holds 4 MiB of free pages; the 60 MiB request on stream 0
        // fits a 62 MiB device only once they are unmapped.
        let t = "a 1 1048576 1\na 2 1048576 1\na 3 1048576 1\nf 3\nf 2\nf 1\na 4 62914560\n";
        let r = run(t, Model::PyTorchExpandable, 62 * MIB);
        assert_eq!((r.alloc_retries, r.failed_allocs), (1, 0));
        assert_eq!(r.peak_reserved_bytes, 60 * MIB);
    }
}
