#!/usr/bin/env python3
"""Record PyTorch default's allocation history of llm-train-s at one fixed batch (the model
and step of scripts/torch-zoo.py and scripts/torch-inproc-speed.py) as a snapshot that
`stitch replay` reads, to study on the simulator a fixed-shape loop seen on the GPU.

    python3 scripts/record-fixed-llm.py --batch 2 --steps 14 --out llm-train-s-b2.pickle.gz

Run 84 (design/gpu-results.md): at batch 2, stitch-alloc called the driver in every step.
"""
import argparse
import gzip
import os
import pickle
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torchcases import zoo_module  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    import torch

    zoo = zoo_module()
    torch.manual_seed(0)
    # As scripts/torch-zoo.py --record: no stacks (the replay does not read them).
    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python",
                                             max_entries=20_000_000)
    model, opt = zoo.llm_model(torch, 8, 768)
    ids = torch.randint(3, 32000, (a.batch, a.seq), device="cuda")
    for _ in range(a.steps):
        zoo.llm_step(torch, model, opt, ids)
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    with gzip.open(a.out, "wb") as f:
        pickle.dump(snap, f)
    print(f"wrote {a.out}: {sum(len(t) for t in snap['device_traces'])} trace entries")


if __name__ == "__main__":
    main()
