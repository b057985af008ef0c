#!/usr/bin/env python3
"""The allocator's own cost inside torch (issue #11 item 4): nanoseconds per
``torch.empty(n, device="cuda")`` + ``del`` pair of cached sizes, under torch's default
allocator and under stitch-alloc, in fresh processes of the same kind, interleaved.

    python3 scripts/torch-alloc-cost.py --lib .gpu/libstitch_alloc.so --runs 3

Each process warms each size up (so the pair is served from the cache: no driver call),
then times ``--pairs`` pairs per size in ``--rounds`` rounds and reports the median round
in ns per pair. The pairs include torch's own work around the allocator (tensor and
storage objects, the Python call); the difference between the two allocators is the
allocator's share. Prints one ``RESULT {json}`` line per process and a table.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SIZES = [512, 4096, 1 << 20, 16 << 20, 64 << 20]

CHILD = r"""
import json, os, sys, time
lib = os.environ.get("COST_LIB")
if lib:
    sys.path.insert(0, os.path.join({repo!r}, "python"))
    import stitch_alloc
    stitch_alloc.enable(path=lib)
import torch
mode = stitch_alloc.mode() if lib else "default"
pairs, rounds = {pairs}, {rounds}
out = {{}}
for n in {sizes}:
    for _ in range(100):
        x = torch.empty(n, dtype=torch.uint8, device="cuda"); del x
    torch.cuda.synchronize()
    per = []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        for _ in range(pairs):
            x = torch.empty(n, dtype=torch.uint8, device="cuda"); del x
        per.append((time.perf_counter_ns() - t0) / pairs)
    out[str(n)] = sorted(per)[len(per) // 2]
print("RESULT " + json.dumps({{"mode": mode, "ns": out}}), flush=True)
"""


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lib", required=True)
    p.add_argument("--runs", type=int, default=3, help="processes per allocator, interleaved")
    p.add_argument("--pairs", type=int, default=20000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    code = CHILD.format(repo=os.path.dirname(HERE), pairs=a.pairs, rounds=a.rounds, sizes=SIZES)
    rows = {"default": [], "stitch": []}
    for _ in range(a.runs):
        for cfg in ("default", "stitch"):
            env = dict(os.environ)
            env.pop("COST_LIB", None)
            if cfg == "stitch":
                env["COST_LIB"] = a.lib
                env.setdefault("STITCH_ALLOC_CONF", "backend:cuda,log:error")
            r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                               env=env, timeout=300)
            line = next((l for l in r.stdout.splitlines() if l.startswith("RESULT ")), None)
            if line is None:
                print(f"{cfg}: exit {r.returncode}: {r.stderr[-500:]}", flush=True)
                continue
            print(line, flush=True)
            rows[cfg].append(json.loads(line[7:]))
    print(f"{'size':>10} | {'default ns/pair (runs)':<30} | {'stitch-alloc ns/pair (runs)':<30} | ratio of medians")
    table = []
    for n in SIZES:
        d = [r["ns"][str(n)] for r in rows["default"]]
        s = [r["ns"][str(n)] for r in rows["stitch"]]
        if not d or not s:
            continue
        dm, sm = statistics.median(d), statistics.median(s)
        fmt = lambda v: ", ".join(f"{x:.0f}" for x in v)  # noqa: E731
        print(f"{n:>10} | {fmt(d):<30} | {fmt(s):<30} | {sm / dm:.3f}")
        table.append({"size": n, "default": d, "stitch": s, "ratio": sm / dm})
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"rows": rows, "table": table}, f, indent=1)


if __name__ == "__main__":
    main()
