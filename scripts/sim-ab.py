#!/usr/bin/env python3
"""One set of `stitch replay` flags against another on the simulator, over real snapshots.

Replays every snapshot of the zoo (tests/data/zoo) and of each extra folder given with
--set NAME=DIR (for example the holdout snapshots a `gpu-session.sh zoo` call brings back,
unpacked) at several GPU lags, once with flags A and once with flags B, and prints each
trace whose peak reserved / peak live moved, then per set and lag the geometric mean of
both sides and their modeled driver time.

    cargo build --release --features cli
    scripts/sim-ab.py --b="--no-chain-fit"
    scripts/sim-ab.py --a="" --b="--handle-divisor 32" --set hold=/tmp/hold/snapshots --lags 0,100
    scripts/sim-ab.py --stitch-a /tmp/main-stitch --b=""     # main's build against this one

The simulator shortlists; torch decides (design/zoo.md, "Which simulated lag predicts
torch" and "Twenty-second session": a lever 0.002-0.003 lower here came out higher through
torch). Lags 3-30 predict torch best (design/zoo.md, "Twenty-seventh session"); lag 1000 is
the issue's target lag.
"""
import argparse
import concurrent.futures
import glob
import json
import math
import os
import shlex
import subprocess
import sys


def replay(stitch, path, lag, flags):
    """(ratio, modeled driver ms) of one replay. Leading NAME=VALUE words of `flags` are set
    in the replay's environment (a throw-away build's experiment switch)."""
    words = shlex.split(flags)
    env = dict(os.environ)
    while words and "=" in words[0] and not words[0].startswith("-"):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    cmd = [stitch, "replay", path, "--json", "--gpu-lag", str(lag)] + words
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
    d = json.loads(out)
    return d["ratio"], d["modeled_driver_us"] / 1000.0


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--a", default="", help="flags of side A (default: none, the defaults)")
    p.add_argument("--b", default="", help="flags of side B, given as --b='--no-chain-fit' (with '=')")
    p.add_argument("--set", action="append", default=[], metavar="NAME=DIR",
                   help="another set of snapshots (*.pickle.gz, *.trace.gz) to replay")
    p.add_argument("--lags", default="3,10,30,1000")
    p.add_argument("--stitch", default="target/release/stitch")
    p.add_argument("--stitch-a", default=None,
                   help="another build's stitch binary for side A (default: --stitch), to compare "
                        "two builds, e.g. main's against a branch's")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    p.add_argument("--min-change", type=float, default=0.0005,
                   help="list a trace when its ratio moved by more than this")
    args = p.parse_args()

    sets = {"zoo": "tests/data/zoo"}
    for s in args.set:
        name, _, folder = s.partition("=")
        if not folder:
            sys.exit(f"--set {s!r}: expected NAME=DIR")
        sets[name] = folder
    traces = []
    for name, folder in sets.items():
        files = sorted(glob.glob(os.path.join(folder, "*.pickle.gz"))
                       + glob.glob(os.path.join(folder, "*.trace.gz")))
        if not files:
            sys.exit(f"no snapshots in {folder}")
        traces += [(name, f) for f in files]
    lags = [int(x) for x in args.lags.split(",")]
    jobs = [(s, f, lag, side) for s, f in traces for lag in lags for side in "ab"]
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        futs = {j: pool.submit(replay, (args.stitch_a or args.stitch) if j[3] == "a" else args.stitch,
                               j[1], j[2], args.a if j[3] == "a" else args.b)
                for j in jobs}
        res = {j: f.result() for j, f in futs.items()}

    print(f"A: {args.stitch_a or args.stitch} {args.a or '(defaults)'}\n"
          f"B: {args.stitch} {args.b or '(defaults)'}\n")
    for s, f in traces:
        for lag in lags:
            (ra, _), (rb, _) = res[(s, f, lag, "a")], res[(s, f, lag, "b")]
            if abs(rb - ra) > args.min_change:
                name = os.path.basename(f).split(".")[0]
                print(f"{s:>6} {name:<22} lag {lag:>5}: {ra:.4f} -> {rb:.4f} ({rb - ra:+.4f})")
    print()
    print("| set | lag | A geomean | B geomean | A driver ms | B driver ms |")
    print("|---|---|---|---|---|---|")
    for s in sets:
        for lag in lags:
            keys = [(s2, f, lag) for s2, f in traces if s2 == s]
            g = {side: math.exp(sum(math.log(res[k + (side,)][0]) for k in keys) / len(keys))
                 for side in "ab"}
            d = {side: sum(res[k + (side,)][1] for k in keys) for side in "ab"}
            print(f"| {s} | {lag} | {g['a']:.4f} | {g['b']:.4f} | {d['a']:,.0f} | {d['b']:,.0f} |")


if __name__ == "__main__":
    main()
