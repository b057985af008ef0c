#!/usr/bin/env python3
"""Record a zoo workload's allocation sequence on the CPU, as a `stitch replay` text trace.

No GPU is needed: the workload of scripts/torch-zoo.py runs with its tensors on the CPU
under `torch.profiler` with `profile_memory=True`, which reports every allocation and free
of torch's CPU allocator (address and size); each becomes an `a <id> <bytes>` or `f <id>`
line, sizes rounded up to 512 bytes as torch's CUDA caching allocator rounds them.

    pip install torch transformers          # a CPU build is enough
    scripts/cpu-record.py spec-decode --out /tmp/spec-decode.cpu.trace.gz [--quick]
    stitch replay /tmp/spec-decode.cpu.trace.gz --gpu-lag 3

What such a trace is and is not (design/zoo.md, "Thirty-fourth session"): the same model
code, shapes and order of tensors as on the GPU, so the same kind of allocation pattern; but
the CPU's kernels differ from CUDA's (no cuBLAS or cuDNN workspaces, other attention and
reduction temporaries), CPU autocast casts fewer ops, and a free is immediate where a CUDA
stream frees later (replay it at several `--gpu-lag`s). It shortlists on kinds that no
device session has recorded yet; a figure through torch on the GPU decides.
"""
import argparse
import gzip
import importlib.util
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def load_zoo():
    spec = importlib.util.spec_from_file_location("torch_zoo", os.path.join(HERE, "torch-zoo.py"))
    zoo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(zoo)
    zoo.DEVICE = "cpu"
    return zoo


def allocation_events(prof):
    """(time ns, address, signed bytes) of every CPU allocation and free, in time order."""
    from torch._C._profiler import _EventType

    out, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        n = stack.pop()
        if n.tag == _EventType.Allocation and n.extra_fields.device.type == "cpu":
            e = n.extra_fields
            out.append((n.start_time_ns, e.ptr, e.alloc_size))
        stack.extend(n.children)
    out.sort(key=lambda x: x[0])
    return out


def write_trace(events, path, title):
    """Events as a text trace: ids per allocation, frees of memory allocated before the
    profiler started are left out, sizes rounded up to 512 bytes. Returns (allocations,
    peak live bytes)."""
    live, next_id, allocs, cur, peak = {}, 0, 0, 0, 0
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "wt") as f:
        f.write(f"# {title}\n")
        for _, ptr, size in events:
            if size > 0:
                if ptr in live:  # a free the profiler did not see
                    cur -= live[ptr][1]
                    f.write(f"f {live.pop(ptr)[0]}\n")
                rs = (size + 511) // 512 * 512
                live[ptr] = (next_id, rs)
                f.write(f"a {next_id} {rs}\n")
                next_id += 1
                allocs += 1
                cur += rs
                peak = max(peak, cur)
            elif size < 0 and ptr in live:
                i, rs = live.pop(ptr)
                cur -= rs
                f.write(f"f {i}\n")
    return allocs, peak


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("workload")
    p.add_argument("--out", required=True, help="the trace to write (gzipped when it ends in .gz)")
    p.add_argument("--quick", action="store_true", help="the workload's quick variant")
    p.add_argument("--seed", type=int, default=None,
                   help="the workload's seed (default: torch-zoo.py's, so the shapes are its runs')")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's own)")
    a = p.parse_args(argv)

    zoo = load_zoo()
    if a.workload not in zoo.WORKLOADS:
        p.error(f"unknown workload {a.workload}; known: {', '.join(zoo.WORKLOADS)}")
    import torch
    from torch.profiler import ProfilerActivity, profile

    if a.threads:
        torch.set_num_threads(a.threads)
    if a.seed is None:
        a.seed = zoo.SEED
    rng = zoo.seed_workload(torch, a.seed, a.workload)
    fn, _ = zoo.WORKLOADS[a.workload]
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        r = fn(torch, rng, a.quick)
        r.pop("_keep", None)
    secs = time.perf_counter() - t0
    events = allocation_events(prof)
    title = (f"{a.workload} on the CPU (scripts/cpu-record.py, seed {a.seed}"
             f"{', quick' if a.quick else ''}, torch {torch.__version__})")
    allocs, peak = write_trace(events, a.out, title)
    print(f"wrote {a.out}: {a.workload}, {allocs:,} allocations, peak live "
          f"{peak / 2**20:,.1f} MiB, {secs:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
