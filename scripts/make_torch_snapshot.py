"""Produce a small, real PyTorch memory snapshot pickle for stitch-alloc's tests.

Run on a machine with a CUDA GPU and torch:

    python3 scripts/make_torch_snapshot.py OUT_DIR

It writes OUT_DIR/torch-small.pickle (plain) and OUT_DIR/torch-small.pickle.gz, plus
OUT_DIR/torch-small.expected.json with what the test expects (counts and peaks computed
from torch's own bookkeeping). The workload: a tensor allocated *before* recording starts
and freed during it (so the trace holds a free with no matching alloc), tensors on two
streams, a growing "KV" tensor reallocated bigger a few times, and small temporaries.
"""
import gzip
import json
import os
import pickle
import sys

import torch

out = sys.argv[1] if len(sys.argv) > 1 else "."
os.makedirs(out, exist_ok=True)
dev = torch.device("cuda:0")
MiB = 1 << 20

before = torch.empty(3 * MiB + 512, dtype=torch.uint8, device=dev)  # allocated before recording
torch.cuda.synchronize()
torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=100000)

side = torch.cuda.Stream()
keep = []
kv = torch.empty(4 * MiB, dtype=torch.uint8, device=dev)
for step in range(6):
    # grow the KV tensor by realloc: allocate bigger, copy, free the old one
    bigger = torch.empty(kv.numel() + 4 * MiB, dtype=torch.uint8, device=dev)
    bigger[: kv.numel()].copy_(kv)
    kv = bigger
    tmp = [torch.empty((step + 1) * 100_000 + i * 4096, dtype=torch.uint8, device=dev) for i in range(5)]
    big = torch.empty((step + 2) * 7 * MiB, dtype=torch.uint8, device=dev)
    with torch.cuda.stream(side):
        s = torch.empty(2 * MiB + step * 1000, dtype=torch.uint8, device=dev)
        s.fill_(1)
    side.synchronize()
    keep.append(s)
    del tmp[2], tmp[0]
    del big
    del tmp
    if step == 3:
        del before  # freed during recording: its alloc is not in the trace
del keep
torch.cuda.synchronize()

snap = torch.cuda.memory._snapshot()
torch.cuda.memory._record_memory_history(enabled=None)
path = os.path.join(out, "torch-small.pickle")
with open(path, "wb") as f:
    pickle.dump(snap, f)
with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as g:
    g.write(f.read())

traces = snap["device_traces"]
dev_trace = traces[0]
actions = {}
for e in dev_trace:
    actions[e["action"]] = actions.get(e["action"], 0) + 1
streams = sorted({e["stream"] for e in dev_trace if e["action"] == "alloc"})
summary = {
    "torch": torch.__version__,
    "devices": len(traces),
    "entries": len(dev_trace),
    "actions": actions,
    "alloc_streams": len(streams),
    "keys_of_first_entry": sorted(dev_trace[0].keys()) if dev_trace else [],
}
with open(os.path.join(out, "torch-small.expected.json"), "w") as f:
    json.dump(summary, f, indent=1, sort_keys=True)
print(json.dumps(summary, indent=1, sort_keys=True))
print("bytes:", os.path.getsize(path), os.path.getsize(path + ".gz"))
