"""Build a large PyTorch memory snapshot from a real one, for timing `stitch replay`.

    python3 scripts/make_big_snapshot.py SRC OUT [--frames N] [--copies C] [--gzip]

SRC is a real snapshot (a pickle from torch.cuda.memory._dump_snapshot(), gzipped or not;
the zoo's serve.pickle.gz was recorded with stacks off). OUT gets the same snapshot with

* every device-trace entry given a stack trace (`frames`) like torch records with
  stacks="all": a new list per entry (torch builds one per traceback) of about N frame dicts
  ({"name", "filename", "line"}) drawn from a pool of shared frames (torch deduplicates
  frames, so the pickle refers back to them through its memo), mixing Python frames and
  long demangled C++ names;
* the device trace repeated C times (C > 1): copy i has its addresses moved up by i << 44,
  ends with a free of everything it left live, and drops the frees of memory allocated
  before the recording (those belong to the first copy only).

Written with Python's pickle at its default protocol, as torch's _dump_snapshot does; with
--gzip also OUT.gz. No torch needed. Deterministic (seeded).
"""
import argparse
import gzip
import pickle
import random
import shutil

ap = argparse.ArgumentParser()
ap.add_argument("src")
ap.add_argument("out")
ap.add_argument("--frames", type=int, default=64, help="mean frames per entry")
ap.add_argument("--copies", type=int, default=1)
ap.add_argument("--gzip", action="store_true")
a = ap.parse_args()

with open(a.src, "rb") as f:
    head = f.read(2)
opener = gzip.open if head == b"\x1f\x8b" else open
with opener(a.src, "rb") as f:
    snap = pickle.load(f)

rng = random.Random(12)
py_files = [
    "/usr/lib/python3.12/site-packages/torch/nn/modules/module.py",
    "/usr/lib/python3.12/site-packages/torch/nn/modules/linear.py",
    "/usr/lib/python3.12/site-packages/torch/nn/functional.py",
    "/usr/lib/python3.12/site-packages/transformers/models/llama/modeling_llama.py",
    "/usr/lib/python3.12/site-packages/transformers/generation/utils.py",
    "/usr/lib/python3.12/site-packages/torch/_tensor.py",
    "/srv/app/serve.py",
    "/srv/app/batching.py",
]
py_names = ["forward", "_call_impl", "_wrapped_call_impl", "generate", "_sample",
            "linear", "attention", "rotate_half", "step", "__call__", "run_batch", "<module>"]
cpp_names = [
    "at::native::empty_cuda(c10::ArrayRef<long>, std::optional<c10::ScalarType>, "
    "std::optional<c10::Layout>, std::optional<c10::Device>, std::optional<bool>, "
    "std::optional<c10::MemoryFormat>)",
    "at::_ops::empty_memory_format::call(c10::ArrayRef<c10::SymInt>, "
    "std::optional<c10::ScalarType>, std::optional<c10::Layout>, std::optional<c10::Device>, "
    "std::optional<bool>, std::optional<c10::MemoryFormat>)",
    "c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc(signed char, "
    "unsigned long, CUstream_st*)",
    "at::native::structured_mm_out_cuda::impl(at::Tensor const&, at::Tensor const&, "
    "at::Tensor const&)",
    "torch::autograd::THPVariable_matmul(_object*, _object*, _object*)",
    "_PyEval_EvalFrameDefault",
    "PyObject_Call",
    "at::TensorIteratorBase::build(at::TensorIteratorConfig&)",
]
pool = []
for i in range(4000):
    if rng.random() < 0.5:
        pool.append({"name": rng.choice(cpp_names), "filename": "??", "line": 0})
    else:
        pool.append({"name": rng.choice(py_names), "filename": rng.choice(py_files),
                     "line": rng.randrange(1, 3000)})
# Stack templates: an allocation site's stack; entries pick one and share its frame dicts.
templates = []
for i in range(2000):
    n = max(4, int(rng.gauss(a.frames, a.frames / 4)))
    templates.append([rng.choice(pool) for _ in range(n)])


def with_frames(e):
    e = dict(e)
    e["frames"] = list(templates[(e.get("size", 0) * 2654435761 + hash(e["action"])) % len(templates)])
    return e


def live_after(entries):
    live = {}
    for e in entries:
        act = e["action"]
        if act == "alloc":
            live[e["addr"]] = e
        elif act in ("free_requested", "free") and e["addr"] in live:
            del live[e["addr"]]
    return live


traces = snap["device_traces"]
dev = next(i for i, t in enumerate(traces) if t)
base = traces[dev]
out = []
for c in range(a.copies):
    shift = c << 44
    allocated = set()
    for e in base:
        act = e["action"]
        if act == "alloc":
            allocated.add(e["addr"])
        elif act in ("free_requested", "free_completed", "free") and e["addr"] not in allocated:
            if c > 0:
                continue  # freed memory from before the recording: the first copy's only
        e = dict(e)
        if act in ("alloc", "free_requested", "free_completed", "free"):
            e["addr"] = e["addr"] + shift
        out.append(with_frames(e))
    if c + 1 < a.copies:
        left = live_after(e2 for e2 in out if e2["addr"] >> 44 == c)
        for addr, e in left.items():
            for act in ("free_requested", "free_completed"):
                f = dict(e)
                f["action"] = act
                out.append(with_frames(f))
traces[dev] = out
with open(a.out, "wb") as f:
    pickle.dump(snap, f)
if a.gzip:
    with open(a.out, "rb") as f, gzip.open(a.out + ".gz", "wb", compresslevel=6) as g:
        shutil.copyfileobj(f, g, 1 << 20)
print(f"{a.out}: {len(out)} entries")
