#!/usr/bin/env python3
"""How low placement alone can take a trace's peak reserved / peak live, independently of
stitch-alloc (design/zoo.md, "Eleventh session"): an idealised allocator with one unbounded
address space, placement at 512-byte units, and physical memory at 2 MiB pages that cost
nothing while no live allocation touches them (as if every free page were unmapped and
reused elsewhere at no price). Its figure is the peak count of pages touched by live
allocations over the peak of live bytes. It knows no handles, streams or driver, so it is
not a lower bound for every allocator, but it measures what a placement policy leaves
behind in partly used pages when nothing else costs anything.

    python3 scripts/placement-bound.py best trace.gz [trace ...]

Policies: ``best`` (smallest free range that fits, at its start), ``first`` (lowest
address that fits), ``best-end`` (smallest fit, at its end), ``fewest-pages`` (among the 64
smallest fits, the place at either end that touches the fewest pages no live allocation
touches yet), ``bump`` (always at the top, never reusing a freed range: log-structured
placement, whose freed pages cost nothing here). ``--small-apart BYTES`` keeps requests of
at most BYTES in an address space of their own (as stitch-alloc's small-block pages do).
Traces: stitch's text format (``a <id> <bytes> [stream]`` / ``f <id> [bytes] [stream]``),
optionally gzipped, as ``stitch gen`` writes them; a PyTorch snapshot converts with ``cargo
run --release --example trace_to_text -- SNAPSHOT OUT.trace.gz``. Needs
``sortedcontainers``.
"""
import argparse
import gzip

from sortedcontainers import SortedList

PAGE = 2 << 20
UNIT = 512


class Space:
    """Free ranges of one unbounded address space, coalesced, by address and by size."""

    def __init__(self):
        self.by_addr = SortedList()  # (start, length)
        self.by_size = SortedList()  # (length, start)
        self.top = 0  # everything at or above is free and never used yet

    def add(self, s, n):
        i = self.by_addr.bisect_left((s, 0))
        if i > 0:
            ps, pn = self.by_addr[i - 1]
            if ps + pn == s:
                self._drop(ps, pn)
                s, n = ps, n + pn
        j = self.by_addr.bisect_left((s, 0))
        if j < len(self.by_addr):
            ns, nn = self.by_addr[j]
            if s + n == ns:
                self._drop(ns, nn)
                n += nn
        self.by_addr.add((s, n))
        self.by_size.add((n, s))

    def _drop(self, s, n):
        self.by_addr.remove((s, n))
        self.by_size.remove((n, s))

    def take(self, rng, at, n):
        """Hand out [at, at+n) from free range `rng` (or from the top when None)."""
        if rng is None:
            self.top += n
            return
        s, ln = rng
        self._drop(s, ln)
        if at > s:
            self.add(s, at - s)
        if at + n < s + ln:
            self.add(at + n, s + ln - at - n)


def pages_of(a, n):
    return range(a // PAGE, (a + n - 1) // PAGE + 1)


def place(space, policy, n, touched):
    """(free range or None, address) for `n` bytes."""
    if policy == "bump":
        return None, space.top
    j = space.by_size.bisect_left((n, -1))
    if policy == "first":
        for s, ln in space.by_addr:
            if ln >= n:
                return (s, ln), s
    elif j < len(space.by_size):
        ln, s = space.by_size[j]
        if policy == "best":
            return (s, ln), s
        if policy == "best-end":
            return (s, ln), s + ln - n
        best = None
        for ln, s in space.by_size[j:j + 64]:
            for at in (s, s + ln - n):
                new = sum(1 for p in pages_of(at, n) if p not in touched)
                if best is None or (new, ln) < best[0]:
                    best = ((new, ln), (s, ln), at)
        return best[1], best[2]
    return None, space.top


SMALL_BASE = 1 << 50  # the small requests' address space, far above the large one


def bound(path, policy, small_apart=0):
    large = Space()
    small = Space()
    small.top = SMALL_BASE
    live = {}
    touched = {}  # page -> live allocations touching it
    cur = peak_live = pages = peak_pages = 0
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        for line in f:
            p = line.split()
            if not p or p[0] not in ("a", "f"):
                continue
            if p[0] == "a":
                size = int(p[2])
                n = max(UNIT, -(-size // UNIT) * UNIT)
                space = small if size <= small_apart else large
                rng, at = place(space, policy, n, touched)
                space.take(rng, at, n)
                live[p[1]] = (at, n, size)
                cur += size
                peak_live = max(peak_live, cur)
                for pg in pages_of(at, n):
                    c = touched.get(pg, 0)
                    pages += c == 0
                    touched[pg] = c + 1
                peak_pages = max(peak_pages, pages)
            else:
                at, n, size = live.pop(p[1])
                cur -= size
                for pg in pages_of(at, n):
                    c = touched[pg] - 1
                    if c == 0:
                        del touched[pg]
                        pages -= 1
                    else:
                        touched[pg] = c
                (small if at >= SMALL_BASE else large).add(at, n)
    return peak_pages * PAGE / peak_live


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("policy", choices=["best", "first", "best-end", "fewest-pages", "bump"])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--small-apart", type=int, default=0, metavar="BYTES",
                    help="requests of at most BYTES in an address space of their own")
    a = ap.parse_args()
    for t in a.traces:
        print(f"{t}\t{a.policy}\t{bound(t, a.policy, a.small_apart):.4f}")


if __name__ == "__main__":
    main()
