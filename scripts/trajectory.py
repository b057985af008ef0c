#!/usr/bin/env python3
"""Where the card and the simulator part: a history recorded under stitch-alloc against replays.

`torch-zoo.py --record-stitch` writes `snapshots/<workload>.stitch.pickle.gz`: torch's
allocations and frees as the program made them, plus the C ABI's own `segment_map` /
`segment_unmap` entries (every mapping the driver made or removed on the card). This script
replays the same history on the simulator at several GPU lags (`stitch replay --calls-log`)
and compares, allocation by allocation, how many mappings each made and removed. The first
allocation where the counts differ is where the simulated trajectory leaves the card's; a
lag that follows the card for longest is the one the card ran at (it may change during a
run, which no constant lag follows).

    cargo build --release --features cli
    scripts/trajectory.py /tmp/rec/snapshots/bert-encode.stitch.pickle.gz
    scripts/trajectory.py X.stitch.pickle.gz --lags 0,1,2,3,5,10,30,100,1000

Prints per lag: the first allocation that differs (with the card's and the simulator's
counts there), how many allocations differ in all, and the simulator's ratio. Found this way
(design/gpu-results.md runs 128-129): bert-encode's card followed lag 3 for 3,031 of 10,203
allocations and lag 2 for 3,613; gnn's parts from every lag within its first 25.
"""
import argparse
import gzip
import json
import os
import pickle
import subprocess
import sys
import tempfile


def card_calls(path):
    """[(bytes, maps, unmaps)] per allocation of the recorded history, maps and unmaps
    counted against the allocation they came before (the C ABI records its mappings during
    the call, torch the allocation after it returns)."""
    with gzip.open(path) if path.endswith(".gz") else open(path, "rb") as f:
        snap = pickle.load(f)
    out = []
    maps = unmaps = 0
    for e in snap["device_traces"][0]:
        a = e["action"]
        if a == "segment_map":
            maps += 1
        elif a == "segment_unmap":
            unmaps += 1
        elif a == "alloc":
            out.append((e["size"], maps, unmaps))
            maps = unmaps = 0
    if not any(m or u for _, m, u in out):
        sys.exit(f"{path}: no segment_map entries (record it with torch-zoo.py --record-stitch)")
    return out


def sim_calls(stitch, path, lag, n):
    """The same list from `stitch replay --calls-log` at `lag`, and the replay's ratio."""
    with tempfile.NamedTemporaryFile("r", suffix=".txt") as log:
        cmd = [stitch, "replay", path, "--json", "--skip-stranded",
               "--gpu-lag", str(lag), "--calls-log", log.name]
        ratio = json.loads(subprocess.run(cmd, capture_output=True, text=True,
                                          check=True).stdout)["ratio"]
        calls = [(0, 0)] * n
        for line in log:
            if line.startswith("#"):
                continue
            i, _, m, u = (int(x) for x in line.split())
            if i < n:
                calls[i] = (m, u)
    return calls, ratio


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("snapshot", help="a history recorded under stitch-alloc (*.stitch.pickle.gz)")
    p.add_argument("--lags", default="0,1,2,3,5,10,30,100,1000")
    p.add_argument("--stitch", default=os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "target", "release", "stitch"))
    a = p.parse_args()
    card = card_calls(a.snapshot)
    print(f"{a.snapshot}: {len(card)} allocations, "
          f"{sum(1 for _, m, u in card if m or u)} of them called the driver on the card")
    print("| lag | first allocation that differs: card (maps, unmaps) / simulator | "
          "allocations that differ | simulator's ratio |")
    print("|---|---|---|---|")
    for lag in (int(x) for x in a.lags.split(",")):
        sim, ratio = sim_calls(a.stitch, a.snapshot, lag, len(card))
        diff = [i for i, ((_, m, u), s) in enumerate(zip(card, sim)) if (m, u) != s]
        if diff:
            i = diff[0]
            first = (f"#{i} ({card[i][0]} bytes): {card[i][1:]} / {sim[i]}")
        else:
            first = "none"
        print(f"| {lag} | {first} | {len(diff)} | {ratio:.4f} |")


if __name__ == "__main__":
    main()
