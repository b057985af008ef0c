//! Handle-aware placement of a large allocation inside a larger free block.
#![forbid(unsafe_code)]

use super::arena::{Arena, State, NIL, UNIT};
use super::handles::Handles;

/// At most this many handles are examined; with more, the block's start is used (many
/// small handles: stranding is small anyway).
const MAX_HANDLES: usize = 32;

/// Where to put `rsize` bytes inside the free block `[a, a+size)` (an offset from `a`): the
/// place that leaves the fewest bytes of wholly free handles stranded (pinned by the new
/// allocation but not used by it). `handles` are the mapped handles as `[start, end)` in
/// address order, from the one containing `a` (or the first after it) up to the block's end.
/// Candidates: either end of the block, and every handle boundary inside it as the
/// allocation's start or end. Ties keep the block's start.
pub(crate) fn best_offset(
    a: u64,
    size: u64,
    rsize: u64,
    handles: impl IntoIterator<Item = (u64, u64)>,
) -> u64 {
    let e = a + size;
    let mut hs = [(0u64, 0u64); MAX_HANDLES];
    let mut n = 0;
    for h in handles {
        if n == MAX_HANDLES {
            return 0;
        }
        hs[n] = h;
        n += 1;
    }
    if n <= 1 {
        return 0;
    }
    let hs = &hs[..n];
    // Bytes of handles wholly inside the block that an allocation at `p` touches but does
    // not use.
    let cost = |p: u64| -> u64 {
        let q = p + rsize;
        hs.iter()
            .filter(|h| h.0 >= a && h.1 <= e && h.0 < q && p < h.1)
            .map(|h| (h.1 - h.0) - (h.1.min(q) - h.0.max(p)))
            .sum()
    };
    let mut best = (cost(a), a);
    let mut consider = |p: u64| {
        if p >= a && p + rsize <= e && p % UNIT == 0 {
            let c = cost(p);
            if c < best.0 {
                best = (c, p);
            }
        }
    };
    consider(e - rsize);
    for h in hs {
        for x in [h.0, h.1] {
            consider(x);
            if x >= rsize {
                consider(x - rsize);
            }
        }
    }
    best.1 - a
}

/// A large allocation skips the free part of a handle it would share with a live
/// neighbour when that part is at most this fraction (1 / `ALIGN_RATIO`) of the request:
/// the hole left costs at most 2% of the request while the neighbour lives, and freeing
/// either one then frees whole handles. Smaller requests share (the piece is a larger part
/// of them, and reusing it is what makes contiguous growth pay on training loops). Measured
/// in design/zoo.md ("boundary-aligned contiguous growth"): ratios 1 / 25 / 50 / 100 / 200
/// / never give zoo geomeans 1.059 / 1.022 / 1.020 / 1.022 / 1.021 / 1.022 and
/// checkerboards 99.82% up to 100, 99.30% at 200, 98.91% never.
pub(crate) const ALIGN_RATIO: u64 = 50;

/// Whether `rsize` bytes should skip the `piece` bytes below the first handle boundary
/// (see [`ALIGN_RATIO`]).
pub(crate) fn align(piece: u64, rsize: u64) -> bool {
    piece.saturating_mul(ALIGN_RATIO) <= rsize
}

/// With contiguous growth: the first handle boundary above the start of free block `i`
/// when the handle holding that start also holds bytes of a block that is not free (live
/// or pending); `None` when the start is a handle boundary or the handle's part below it is
/// free.
pub(crate) fn shared_start(arena: &Arena, handles: &Handles, i: u32) -> Option<u64> {
    let b = &arena.blocks[i as usize];
    let (&hs, &id) = handles.mapped.range(..=b.addr).next_back()?;
    if hs == b.addr {
        return None;
    }
    let mut j = b.prev;
    while j != NIL {
        let p = &arena.blocks[j as usize];
        if p.addr + p.size <= hs {
            break;
        }
        if !matches!(p.state, State::Free { .. }) {
            return Some(hs + handles.size(id));
        }
        j = p.prev;
    }
    None
}

/// Where `rsize` bytes go in free block `i` (an offset from its start) under contiguous
/// growth: the block's start, unless it shares a handle with a block that holds bytes
/// ([`shared_start`]), the request does not fit in that handle's free part, and [`align`]
/// says skip it; then the first handle boundary, if the request fits from there.
///
/// Handles start at granule (`g`) multiples, so the piece below the first handle boundary
/// is at least the distance to the next granule boundary (a whole granule when the start
/// is on one). When even that smallest piece could not be skipped (no block before it in
/// the run, too little room past the request, or [`align`] refuses it), the answer is 0
/// without the handle lookup, the hot path's most expensive step (callgrind, llm-train-s
/// replayed in a loop: 1,977 -> 1,712 instructions per allocation + free, the same
/// decisions; test `the_early_answer_agrees_with_the_handle_lookup`).
pub(crate) fn contiguous_offset(
    arena: &Arena,
    handles: &Handles,
    g: u64,
    i: u32,
    rsize: u64,
) -> u64 {
    let b = &arena.blocks[i as usize];
    let min_piece = g - b.addr % g;
    if b.prev == NIL || b.size.saturating_sub(rsize) < min_piece || !align(min_piece, rsize) {
        return 0;
    }
    offset_by_handle_lookup(arena, handles, i, rsize)
}

/// [`contiguous_offset`] by the rule itself: look up the handle that holds the block's
/// start.
fn offset_by_handle_lookup(arena: &Arena, handles: &Handles, i: u32, rsize: u64) -> u64 {
    let b = &arena.blocks[i as usize];
    match shared_start(arena, handles, i) {
        Some(nb)
            if b.addr + rsize > nb
                && nb + rsize <= b.addr + b.size
                && align(nb - b.addr, rsize) =>
        {
            nb - b.addr
        }
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::Stream;
    use crate::engine::Engine;
    use crate::{Config, Pool};

    const M: u64 = 1 << 20;

    /// Every free large block, after each step of a mixed workload whose blocks start on
    /// and off granule boundaries and whose handles are one to four granules, gives the
    /// same offset with the early answer as by the handle lookup, for requests from
    /// sub-granule to many handles; the skip (a nonzero offset) must occur, or the test
    /// would not test it.
    #[test]
    fn the_early_answer_agrees_with_the_handle_lookup() {
        let mut cfg = Config::default().with_contiguous(true);
        cfg.handle_divisor = 16;
        cfg.max_handle = 8 * M;
        let (d, mut e) = Engine::on_sim(4 << 30, &cfg);
        let g = e.cfg.granularity;
        let s = Stream::DEFAULT;
        let mut live: Vec<u64> = Vec::new();
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let rsizes = [M / 2, 3 * M, 10 * M, 49 * M, 101 * M, 257 * M];
        let (mut checked, mut skipped) = (0u64, 0u64);
        for step in 0..3_000 {
            let v = next();
            if live.len() < 40 && (v % 3 != 0 || live.is_empty()) {
                let size = match v % 5 {
                    0 => 1 + (v >> 8) % (2 * M),
                    1 => 2 * M + (v >> 8) % (6 * M),
                    2 => 20 * M + (v >> 8) % (80 * M),
                    _ => 100 * M + (v >> 8) % (200 * M),
                };
                if let Ok(p) = e.alloc(&d, size, s) {
                    live.push(p);
                }
            } else {
                let k = (v >> 8) as usize % live.len();
                e.free(&d, live.swap_remove(k), s).unwrap();
            }
            if step % 7 != 0 {
                continue;
            }
            for i in 0..e.arena.blocks.len() as u32 {
                let b = &e.arena.blocks[i as usize];
                if b.pool != Pool::Large || !matches!(b.state, State::Free { .. }) {
                    continue;
                }
                for &rs in rsizes.iter().filter(|&&rs| rs <= b.size) {
                    let full = offset_by_handle_lookup(&e.arena, &e.handles, i, rs);
                    assert_eq!(
                        contiguous_offset(&e.arena, &e.handles, g, i, rs),
                        full,
                        "block {i} at {:#x} of {} bytes, request {rs}",
                        b.addr,
                        b.size
                    );
                    checked += 1;
                    skipped += u64::from(full > 0);
                }
            }
        }
        assert!(
            checked > 1_000 && skipped > 0,
            "{checked} checked, {skipped} skipped"
        );
        for p in live {
            e.free(&d, p, s).unwrap();
        }
        e.teardown(&d);
    }

    #[test]
    fn one_handle_or_none_keeps_the_start() {
        assert_eq!(best_offset(0, 8 * M, 2 * M, []), 0);
        assert_eq!(best_offset(0, 8 * M, 2 * M, [(0, 8 * M)]), 0);
    }

    #[test]
    fn uses_one_handle_exactly_instead_of_straddling() {
        // Handles of 3, 2 and 3 MiB: at the start a 2 MiB request strands 1 MiB of the
        // first handle; on the middle handle it strands nothing.
        let hs = [(0, 3 * M), (3 * M, 5 * M), (5 * M, 8 * M)];
        assert_eq!(best_offset(0, 8 * M, 2 * M, hs), 3 * M);
    }

    #[test]
    fn prefers_the_end_when_it_strands_less() {
        // 1 MiB then 4 MiB: a 4 MiB request at the start strands 1 MiB of the second
        // handle; at the end it uses the second handle exactly.
        let hs = [(0, M), (M, 5 * M)];
        assert_eq!(best_offset(0, 5 * M, 4 * M, hs), M);
    }

    #[test]
    fn ties_keep_the_start() {
        let hs = [(0, 2 * M), (2 * M, 4 * M)];
        assert_eq!(best_offset(0, 4 * M, 2 * M, hs), 0);
    }

    #[test]
    fn gives_up_past_the_handle_limit() {
        // Half a MiB, then 1 MiB handles: a 1 MiB request is best placed at M/2 ...
        let hs = |n: u64| {
            std::iter::once((0, M / 2)).chain((0..n).map(|i| (M / 2 + i * M, M / 2 + (i + 1) * M)))
        };
        assert_eq!(best_offset(0, 3 * M / 2, M, hs(1)), M / 2);
        // (with 32 handles, the block's end strands nothing either and is tried first)
        assert_eq!(best_offset(0, 31 * M + M / 2, M, hs(31)), 30 * M + M / 2);
        // ... unless there are more handles than are examined.
        assert_eq!(best_offset(0, 32 * M + M / 2, M, hs(32)), 0);
    }

    #[test]
    fn handles_not_wholly_inside_the_block_cost_nothing() {
        // Block [2M, 8M) starts inside handle [0, 4M), which holds other bytes.
        let hs = [(0, 4 * M), (4 * M, 6 * M), (6 * M, 8 * M)];
        assert_eq!(best_offset(2 * M, 6 * M, 2 * M, hs), 0);
        // 3 MiB ending at 6M uses [4M, 6M) whole and the rest of the partial handle.
        assert_eq!(best_offset(2 * M, 6 * M, 3 * M, hs), M);
    }
}
