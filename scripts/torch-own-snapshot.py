#!/usr/bin/env python3
"""Issue #12 item 5: a memory history recorded under stitch-alloc is a torch-format snapshot
that torch's own memory_viz renders and `stitch replay` reads back.

Runs a small training loop and a few large tensors under stitch-alloc (the C++ extension)
with `torch.cuda.memory._record_memory_history`, dumps the snapshot, renders it with
`torch.cuda._memory_viz.trace_plot` and `segment_plot`, and replays it with the stitch
binary (simulator). Prints one JSON line; exit status 0 only if every step worked, the
trace holds the allocator's own `segment_map` entries (the library's maps, drained by the
extension from `stitch_segment_events`) and the replay's peak of live bytes equals the
peak the trace itself shows (computed here from the trace entries, not from the
allocator).

    python3 scripts/torch-own-snapshot.py --stitch .gpu/bin/stitch --out DIR
"""
import argparse
import json
import os
import pickle
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--stitch", default=os.path.join(HERE, "..", ".gpu", "bin", "stitch"))
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    import stitch_alloc
    import torch

    stitch_alloc.enable(extension=True)
    torch.cuda.memory._record_memory_history(max_entries=200000)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).cuda()
    opt = torch.optim.AdamW(model.parameters())
    for step in range(6):
        x = torch.randn(64 * (step + 1), 1024, device="cuda")
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    big = [torch.empty(n << 20, dtype=torch.uint8, device="cuda") for n in (3, 50, 7, 120)]
    del big[1]
    del big
    path = os.path.join(a.out, "own-snapshot.pickle")
    torch.cuda.memory._dump_snapshot(path)
    torch.cuda.memory._record_memory_history(enabled=None)
    res = {"mode": stitch_alloc.mode(), "bytes": os.path.getsize(path)}
    with open(path, "rb") as f:
        snap = pickle.load(f)
    trace = next((t for t in snap.get("device_traces", []) if t), [])
    res["events"] = len(trace)
    # The peak of live requested bytes, from the trace alone, as torch defines a free: the
    # program drops the tensor at free_requested (free_completed when none is recorded).
    free_action = ("free_requested" if any(e["action"] == "free_requested" for e in trace)
                   else "free_completed")
    cur = peak = 0
    live = {}
    for e in trace:
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
            cur += e["size"]
            peak = max(peak, cur)
        elif e["action"] == free_action and e["addr"] in live:
            cur -= live.pop(e["addr"])
    res["trace_peak_requested"] = peak
    # The library's own maps and unmaps (stitch_segment_events), as segment_map / unmap.
    res["segment_maps"] = sum(e["action"] == "segment_map" for e in trace)
    res["segment_unmaps"] = sum(e["action"] == "segment_unmap" for e in trace)
    from torch.cuda import _memory_viz

    try:
        res["trace_plot_chars"] = len(_memory_viz.trace_plot(snap))
        res["segment_plot_chars"] = len(_memory_viz.segment_plot(snap))
    except Exception as e:  # noqa: BLE001
        res["memory_viz_error"] = f"{type(e).__name__}: {e}"
    r = subprocess.run([a.stitch, "replay", path, "--json"], capture_output=True, text=True)
    res["replay_exit"] = r.returncode
    try:
        rep = json.loads(r.stdout)
        res["replay_peak_requested"] = rep.get("peak_live_bytes")
        res["replay_events"] = rep.get("events")
        res["replay_ratio"] = rep.get("ratio")
    except ValueError:
        res["replay_error"] = (r.stderr or r.stdout)[-500:]
    ok = (res["mode"] == "extension" and res["events"] > 0 and "memory_viz_error" not in res
          and res["trace_plot_chars"] > 1000 and res["replay_exit"] == 0
          and res["segment_maps"] > 0
          and res.get("replay_peak_requested") == peak)
    res["result"] = "PASS" if ok else "FAIL"
    print(json.dumps(res))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
