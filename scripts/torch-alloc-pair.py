#!/usr/bin/env python3
"""The allocator's own cost, PyTorch's and stitch-alloc's, in **one process** (issue #11 item
4): nanoseconds per malloc + free pair of a training-step-like mix of 1,200 sizes, after
warm-up (every size cached, no driver call). The two alternate in rounds in the same
process, so the process's CPU pace, which differs by up to 1.9x between processes on the
GPU machine (design/gpu-results.md run 60), is the same for both.

    python3 scripts/torch-alloc-pair.py --lib .gpu/libstitch_alloc.so --rounds 7

PyTorch's side is ``c10::cuda::CUDACachingAllocator::raw_alloc_with_stream`` /
``raw_delete`` (its default caching allocator: nothing else is installed in this process);
stitch-alloc's is ``stitch_malloc`` / ``stitch_free`` called directly from C++
(scripts/torch-alloc-pair.cpp), without torch's ``CUDAPluggableAllocator`` wrapper, whose
own cost (a mutex and a hash map per call) comes on top under ``stitch_alloc.enable``.
Prints one ``RESULT {json}`` line and a table: each side's median and range over the
rounds, and the median over rounds of stitch-alloc's pair / PyTorch's pair.

With ``--through-torch`` both sides are torch's allocator interface instead
(``CUDAAllocator::allocate`` and the release of the ``DataPtr`` it returns: what
``torch.empty`` and ``del`` reach): torch's own caching allocator, kept before
``stitch_alloc.enable`` installs the extension, against the installed extension, in the
same process.

    python3 scripts/torch-alloc-pair.py --lib .gpu/libstitch_alloc.so --through-torch
"""
import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lib", required=True, help="libstitch_alloc.so")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=20, help="timed steps per round")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before each round")
    p.add_argument("--sizes", type=int, default=1200, help="allocations per step")
    p.add_argument("--through-torch", action="store_true",
                   help="both sides through torch's CUDAAllocator interface (the extension "
                        "installed by stitch_alloc.enable against torch's own)")
    a = p.parse_args()
    os.environ.setdefault("STITCH_ALLOC_CONF", "backend:cuda,log:error")

    import torch
    from torch.utils.cpp_extension import load

    t0 = time.time()
    # The CUDA headers and libraries as the package's own extension finds them (CUDA_HOME,
    # else torch's CUDA wheels: the GPU machine has no CUDA toolkit headers of its own).
    sys.path.insert(0, os.path.join(HERE, "..", "python"))
    from stitch_alloc import cuda_build_flags

    incs, ldflags, with_cuda = cuda_build_flags()
    ext = load(name="stitch_alloc_pair", sources=[os.path.join(HERE, "torch-alloc-pair.cpp")],
               extra_include_paths=incs, extra_ldflags=ldflags + ["-ldl"], with_cuda=with_cuda,
               verbose=False)
    built = time.time() - t0
    lib = os.path.abspath(a.lib)
    if a.through_torch:
        import stitch_alloc

        ext.grab_native()
        stitch_alloc.enable(path=lib, extension=True)
        if not ext.another_installed():
            raise SystemExit("stitch_alloc.enable did not install another allocator")
        labels = ("PyTorch default (CUDAAllocator::allocate, DataPtr released)",
                  "stitch-alloc extension (CUDAAllocator::allocate, DataPtr released)")
    else:
        labels = ("PyTorch default (raw_alloc / raw_delete)",
                  "stitch-alloc (stitch_malloc / stitch_free)")
    torch.cuda.init()
    rows = []
    for r in range(a.rounds):
        # Alternate which goes first, so neither always follows the other's cache traffic.
        order = ("torch", "stitch") if r % 2 == 0 else ("stitch", "torch")
        got = {}
        for side in order:
            if a.through_torch:
                got[side] = ext.iface_pair_ns(side == "torch", a.steps, a.warmup, a.sizes)
            elif side == "torch":
                got[side] = ext.torch_pair_ns(a.steps, a.warmup, a.sizes)
            else:
                got[side] = ext.stitch_pair_ns(lib, a.steps, a.warmup, a.sizes)
        rows.append(got)
        print(f"round {r + 1}: PyTorch {got['torch']:.1f} ns, stitch-alloc {got['stitch']:.1f} ns "
              f"per pair", flush=True)
    t = [x["torch"] for x in rows]
    s = [x["stitch"] for x in rows]
    ratio = [x["stitch"] / x["torch"] for x in rows]
    res = {"rounds": rows, "torch_median_ns": statistics.median(t),
           "stitch_median_ns": statistics.median(s), "ratio_median": statistics.median(ratio),
           "ratio_range": [min(ratio), max(ratio)], "sizes_per_step": a.sizes,
           "steps": a.steps, "build_seconds": round(built, 1),
           "through_torch": a.through_torch,
           "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    print("RESULT " + json.dumps(res))
    print()
    print("| allocator | ns per malloc + free pair, median | range over rounds |")
    print("|---|---|---|")
    print(f"| {labels[0]} | {res['torch_median_ns']:.1f} | {min(t):.1f}-{max(t):.1f} |")
    print(f"| {labels[1]} | {res['stitch_median_ns']:.1f} | {min(s):.1f}-{max(s):.1f} |")
    print(f"\nstitch-alloc / PyTorch, per round: median {res['ratio_median']:.3f}, "
          f"range {min(ratio):.3f}-{max(ratio):.3f} ({a.rounds} rounds, one process)")


if __name__ == "__main__":
    main()
