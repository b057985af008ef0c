#!/usr/bin/env python3
"""Real models through PyTorch with three allocators: PyTorch's default caching allocator,
``expandable_segments:True``, and stitch-alloc (through CUDAPluggableAllocator).

For each allocator and each workload, a FRESH Python process (the allocator is chosen before
the process's first CUDA allocation) runs:

* ``generate``: a Llama built from a config with random init (default 4 layers, hidden 2048,
  bf16), ``model.generate`` (greedy, KV cache) over a fixed, seeded list of batches: batch
  1-32, prompt 16-1024 tokens, 16-256 new tokens. Throughput in generated tokens per second.
* ``train``: a Llama (default 12 layers, hidden 1024, fp32 weights) trained with AdamW under
  bf16 autocast on a seeded list of steps: batch 1-16 x sequence 88-2046. Steps per second
  (and tokens per second).

Then, in the same process: peak reserved / peak allocated / peak requested bytes (torch's
``memory_stats()`` for its allocators, ``stitch_alloc.memory_stats()`` for ours; both over
the whole process, model weights included), and the largest single tensor still
allocatable at the end (binary search with ``torch.empty``; the model stays alive, the
workload's temporaries are gone), next to the memory that is in principle available
(driver free + reserved but unallocated).

Prints a table and writes JSON (``--out``). Needs torch (CUDA) and transformers; no
network (no weights are downloaded). Run from the repository root after
``cargo build --release --features capi`` (or pass ``--lib``)::

    python3 scripts/torch-validate.py --out design/torch-validate.json
    python3 scripts/torch-validate.py --quick            # a smoke run, about a minute
    python3 scripts/torch-validate.py --dry-run          # the plan only; needs no torch

Caveat for stitch-alloc (torch 2.11): a NULL from the allocator does not raise
``torch.cuda.OutOfMemoryError``; the tensor's first use raises ``RuntimeError`` ("... data
is not allocated yet"). The probe counts that as a failed allocation.
"""

import argparse
import datetime
import gc
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from statistics import median

MIB = 1 << 20
GIB = 1 << 30
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
PYDIR = os.path.join(REPO, "python")

CONFIGS = {
    "default": {"label": "PyTorch default", "alloc_conf": None, "stitch": False},
    "expandable": {
        "label": "expandable_segments",
        "alloc_conf": "expandable_segments:True",
        "stitch": False,
    },
    "stitch": {"label": "stitch-alloc", "alloc_conf": None, "stitch": True},
}
WORKLOADS = ("generate", "train", "replay")
DEFAULT_REPLAY = ",".join(
    os.path.join("tests", "data", n)
    for n in ("llm-small.trace.gz", "train-small.trace", "adversarial-small.trace.gz")
)
DEFAULT_STITCH_CONF = "backend:cuda,log:error"


# ---------------------------------------------------------------------------------------
# Arguments.


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--configs",
        default="default,expandable,stitch",
        help="comma-separated subset of: " + ", ".join(CONFIGS),
    )
    p.add_argument(
        "--workloads", default="generate,train",
        help="comma-separated subset of: generate, train, replay (stitch text traces through torch)"
    )
    p.add_argument("--out", default="torch-validate.json", help="JSON results file")
    p.add_argument("--lib", default=None, help="libstitch_alloc.so (default: stitch_alloc.find_library)")
    p.add_argument(
        "--stitch-conf",
        default=DEFAULT_STITCH_CONF,
        help=f"STITCH_ALLOC_CONF for the stitch-alloc runs (default {DEFAULT_STITCH_CONF!r})",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per child process")
    p.add_argument("--gen-batches", type=int, default=30)
    p.add_argument("--gen-layers", type=int, default=4)
    p.add_argument("--gen-hidden", type=int, default=2048)
    p.add_argument("--gen-max-batch", type=int, default=32)
    p.add_argument("--gen-max-prompt", type=int, default=1024)
    p.add_argument("--gen-max-new", type=int, default=256)
    p.add_argument("--train-steps", type=int, default=20)
    p.add_argument("--train-layers", type=int, default=12)
    p.add_argument("--train-hidden", type=int, default=1024)
    p.add_argument("--train-max-batch", type=int, default=16)
    p.add_argument("--train-max-seq", type=int, default=2046)
    p.add_argument("--no-probe", action="store_true", help="skip the largest-tensor probe")
    p.add_argument("--replay-traces", default=DEFAULT_REPLAY,
                   help="comma-separated stitch text traces (.gz allowed) for the replay workload: "
                        "each event becomes torch.empty / del on the current stream")
    p.add_argument("--replay-rounds", type=int, default=3,
                   help="replays of each trace per process (the median time is reported)")
    p.add_argument("--repeat", type=int, default=1,
                   help="run every (allocator, workload) this many times, interleaved, to see "
                        "the run-to-run spread of throughput (vs dflt uses default's median)")
    p.add_argument("--record", default=None, metavar="DIR",
                   help="for PyTorch's own allocators, record the allocation history "
                        "(torch.cuda.memory._record_memory_history) and write "
                        "DIR/<workload>-<config>.pickle.gz, a trace `stitch replay` reads")
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    p.add_argument("--dry-run", action="store_true", help="print the plan; run nothing")
    p.add_argument("--commit", default=None, help="commit to record (default: git rev-parse HEAD)")
    # Internal: one child run.
    p.add_argument("--child", choices=sorted(CONFIGS), help=argparse.SUPPRESS)
    p.add_argument("--workload", choices=WORKLOADS, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.config_list = [c.strip() for c in a.configs.split(",") if c.strip()]
    a.workload_list = [w.strip() for w in a.workloads.split(",") if w.strip()]
    for c in a.config_list:
        if c not in CONFIGS:
            p.error(f"unknown config {c!r}; choose from {', '.join(CONFIGS)}")
    for w in a.workload_list:
        if w not in WORKLOADS:
            p.error(f"unknown workload {w!r}; choose from {', '.join(WORKLOADS)}")
    if a.quick:
        a.gen_batches = min(a.gen_batches, 4)
        a.gen_layers = min(a.gen_layers, 2)
        a.gen_max_batch = min(a.gen_max_batch, 8)
        a.gen_max_prompt = min(a.gen_max_prompt, 256)
        a.gen_max_new = min(a.gen_max_new, 32)
        a.train_steps = min(a.train_steps, 4)
        a.train_layers = min(a.train_layers, 2)
        a.train_max_batch = min(a.train_max_batch, 4)
        a.train_max_seq = min(a.train_max_seq, 512)
        a.timeout = min(a.timeout, 300.0)
    for name in ("repeat", "gen_batches", "gen_layers", "gen_hidden", "gen_max_batch", "train_steps",
                 "train_layers", "train_hidden", "train_max_batch"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if a.gen_max_prompt < 16 or a.gen_max_new < 16 or a.train_max_seq < 88:
        p.error("--gen-max-prompt and --gen-max-new must be >= 16, --train-max-seq >= 88")
    return a


def gen_plan(a):
    """The (batch, prompt_len, new_tokens) of every generate batch: the same in every run."""
    rng = random.Random(a.seed)
    sizes = [b for b in (1, 2, 4, 8, 16, 32) if b <= a.gen_max_batch] or [1]
    return [
        (rng.choice(sizes), rng.randint(16, a.gen_max_prompt), rng.randint(16, a.gen_max_new))
        for _ in range(a.gen_batches)
    ]


def train_plan(a):
    """The (batch, seq_len) of every training step (the first is a warm-up, not timed)."""
    rng = random.Random(a.seed + 1)
    return [
        (rng.randint(1, a.train_max_batch), rng.randint(88, a.train_max_seq))
        for _ in range(a.train_steps + 1)
    ]


def child_args(a, config, workload, result):
    keep = [
        "--seed", str(a.seed),
        "--stitch-conf", a.stitch_conf,
        "--gen-batches", str(a.gen_batches),
        "--gen-layers", str(a.gen_layers),
        "--gen-hidden", str(a.gen_hidden),
        "--gen-max-batch", str(a.gen_max_batch),
        "--gen-max-prompt", str(a.gen_max_prompt),
        "--gen-max-new", str(a.gen_max_new),
        "--train-steps", str(a.train_steps),
        "--train-layers", str(a.train_layers),
        "--train-hidden", str(a.train_hidden),
        "--train-max-batch", str(a.train_max_batch),
        "--train-max-seq", str(a.train_max_seq),
        "--replay-traces", a.replay_traces,
        "--replay-rounds", str(a.replay_rounds),
    ]
    if a.lib:
        keep += ["--lib", a.lib]
    if a.no_probe:
        keep.append("--no-probe")
    if a.record:
        keep += ["--record", a.record]
    return [os.path.abspath(__file__), "--child", config, "--workload", workload,
            "--result", result] + keep


def child_env(a, config):
    env = dict(os.environ)
    for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "STITCH_ALLOC_CONF"):
        env.pop(k, None)
    c = CONFIGS[config]
    if c["alloc_conf"]:
        # torch 2.11 reads PYTORCH_ALLOC_CONF and still honours the older name.
        env["PYTORCH_ALLOC_CONF"] = c["alloc_conf"]
        env["PYTORCH_CUDA_ALLOC_CONF"] = c["alloc_conf"]
    if c["stitch"]:
        env["STITCH_ALLOC_CONF"] = a.stitch_conf
    env["PYTHONPATH"] = PYDIR + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    return env


# Throughput of each workload: (result key, unit).
TPUT = {"generate": ("tokens_per_s", "tok/s"), "train": ("steps_per_s", "steps/s"),
        "replay": ("events_per_s", "ev/s")}

# ---------------------------------------------------------------------------------------
# The child: one allocator, one workload.


def build_llama(torch, layers, hidden, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = max(1, hidden // 128)
    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=int(hidden * 2.75) // 256 * 256,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=None,  # random weights: generation never stops early
        pad_token_id=0,
    )
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    return model


def run_generate(torch, a):
    plan = gen_plan(a)
    model = build_llama(torch, a.gen_layers, a.gen_hidden, torch.bfloat16).eval()
    gen_cfg = model.generation_config
    gen_cfg.eos_token_id = None  # every batch runs its full length
    gen_cfg.pad_token_id = 0
    gen_cfg.do_sample = False
    vocab = model.config.vocab_size
    g = torch.Generator(device="cuda").manual_seed(a.seed)

    def one(batch, prompt, new):
        ids = torch.randint(3, vocab, (batch, prompt), device="cuda", generator=g)
        mask = torch.ones_like(ids)
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new,
            do_sample=False,
            use_cache=True,
        )
        n = (out.shape[1] - prompt) * batch
        del out, ids, mask
        return n

    with torch.inference_mode():
        one(1, 16, 4)  # warm-up: kernels, cuBLAS handles
        torch.cuda.synchronize()
        tokens = 0
        t0 = time.perf_counter()
        per_batch = []
        for batch, prompt, new in plan:
            b0 = time.perf_counter()
            n = one(batch, prompt, new)
            torch.cuda.synchronize()
            per_batch.append(round(time.perf_counter() - b0, 4))
            tokens += n
        secs = time.perf_counter() - t0
    expected = sum(b * n for b, _, n in plan)
    return {
        "model": {"layers": a.gen_layers, "hidden": a.gen_hidden, "dtype": "bfloat16",
                  "params": sum(p.numel() for p in model.parameters())},
        "plan": plan,
        "tokens": tokens,
        "tokens_expected": expected,
        "seconds": secs,
        "tokens_per_s": tokens / secs if secs > 0 else 0.0,
        "batch_seconds": per_batch,
        "_keep": model,
    }


def run_train(torch, a):
    plan = train_plan(a)
    model = build_llama(torch, a.train_layers, a.train_hidden, torch.float32).train()
    model.config.use_cache = False
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    vocab = model.config.vocab_size
    g = torch.Generator(device="cuda").manual_seed(a.seed)
    losses, step_secs, tokens = [], [], 0
    for i, (batch, seq) in enumerate(plan):
        s0 = time.perf_counter()
        ids = torch.randint(3, vocab, (batch, seq), device="cuda", generator=g)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = out.loss.detach().float().item()  # synchronises
        del out, ids
        if i == 0:
            continue  # warm-up step, not timed
        step_secs.append(time.perf_counter() - s0)
        losses.append(round(loss, 4))
        tokens += batch * seq
    secs = sum(step_secs)
    return {
        "model": {"layers": a.train_layers, "hidden": a.train_hidden, "dtype": "fp32+bf16 autocast",
                  "params": sum(p.numel() for p in model.parameters())},
        "plan": plan,
        "steps": len(step_secs),
        "seconds": secs,
        "steps_per_s": len(step_secs) / secs if secs > 0 else 0.0,
        "tokens_per_s": tokens / secs if secs > 0 else 0.0,
        "losses": losses,
        "_keep": (model, opt),
    }


def read_text_trace(path):
    """(op, id, bytes) tuples of a stitch text trace; streams are ignored (torch replays on
    its current stream)."""
    import gzip

    opener = gzip.open if path.endswith(".gz") else open
    ops = []
    with opener(path, "rt") as f:
        for line in f:
            parts = line.split()
            if not parts or parts[0].startswith("#"):
                continue
            if parts[0] == "a":
                ops.append((True, int(parts[1]), int(parts[2])))
            elif parts[0] == "f":
                ops.append((False, int(parts[1]), 0))
            else:
                raise ValueError(f"{path}: unknown action {parts[0]!r}")
    return ops


def run_replay(torch, a):
    """Every trace event as torch.empty(bytes, uint8) / del, timed (median of rounds)."""
    traces = []
    total_events, total_secs = 0, 0.0
    for path in [t for t in a.replay_traces.split(",") if t]:
        full = path if os.path.isabs(path) else os.path.join(REPO, path)
        ops = read_text_trace(full)
        times, failed = [], 0
        for _ in range(max(1, a.replay_rounds)):
            live = {}
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for is_alloc, i, n in ops:
                if is_alloc:
                    try:
                        live[i] = torch.empty(n, dtype=torch.uint8, device="cuda")
                    except (torch.cuda.OutOfMemoryError, RuntimeError):
                        failed += 1
                else:
                    live.pop(i, None)
            live.clear()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        secs = median(times)
        traces.append({"trace": path, "events": len(ops), "seconds": secs, "rounds": times,
                       "events_per_s": len(ops) / secs if secs > 0 else 0.0,
                       "failed_allocs": failed})
        total_events += len(ops)
        total_secs += secs
    return {
        "traces": traces,
        "events": total_events,
        "seconds": total_secs,
        "events_per_s": total_events / total_secs if total_secs > 0 else 0.0,
        "_keep": None,
    }


def memory_figures(torch, stitch):
    """Peaks over the whole process, and the current state."""
    if stitch:
        import stitch_alloc

        m = stitch_alloc.memory_stats(0)
    else:
        m = torch.cuda.memory_stats(0)
    keys = (
        "allocated_bytes.all.peak",
        "allocated_bytes.all.current",
        "reserved_bytes.all.peak",
        "reserved_bytes.all.current",
        "requested_bytes.all.peak",
        "num_alloc_retries",
        "num_ooms",
        "num_device_alloc",
        "num_device_free",
    )
    out = {k: int(m.get(k, 0)) for k in keys}
    if stitch:
        for k in ("stitches", "stitched_handles", "extensions", "stranded_bytes", "driver_calls",
                  "vmm_calls", "capacity", "slow_allocs", "fast_allocs", "event_waits",
                  "driver_time_us"):
            out[k] = int(m.get(k, 0))
    pa, pr, pq = (out["allocated_bytes.all.peak"], out["reserved_bytes.all.peak"],
                  out["requested_bytes.all.peak"])
    out["reserved_over_allocated"] = pr / pa if pa else None
    out["reserved_over_requested"] = pr / pq if pq else None
    return out


def probe_largest(torch, stitch):
    """The largest torch.empty(n, uint8) that succeeds now (1 MiB resolution)."""
    gc.collect()
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info(0)
    if stitch:
        import stitch_alloc

        m = stitch_alloc.memory_stats(0)
    else:
        m = torch.cuda.memory_stats(0)
    reserved = int(m.get("reserved_bytes.all.current", 0))
    allocated = int(m.get("allocated_bytes.all.current", 0))
    available = free + max(0, reserved - allocated)

    fails = 0

    def fits(n):
        nonlocal fails
        try:
            t = torch.empty(n, dtype=torch.uint8, device="cuda")
        except (torch.cuda.OutOfMemoryError, RuntimeError, MemoryError):
            fails += 1
            return False
        try:
            ok = t.data_ptr() != 0  # stitch-alloc under torch 2.11: raises when NULL
        except RuntimeError:
            ok = False
        del t
        if not ok:
            fails += 1
        return ok

    t0 = time.perf_counter()
    lo, hi = 0, total // MIB + 1  # in MiB: lo fits (trivially), hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid * MIB):
            lo = mid
        else:
            hi = mid
    return {
        "largest_bytes": lo * MIB,
        "available_bytes": available,
        "largest_over_available": (lo * MIB) / available if available else None,
        "driver_free_before": free,
        "device_total": total,
        "allocated_before": allocated,
        "reserved_before": reserved,
        "failed_attempts": fails,
        "probe_seconds": time.perf_counter() - t0,
    }


def child(a):
    c = CONFIGS[a.child]
    res = {"config": a.child, "label": c["label"], "workload": a.workload, "ok": False}
    if c["stitch"]:
        sys.path.insert(0, PYDIR)
        import stitch_alloc

        stitch_alloc.enable(path=a.lib, conf=a.stitch_conf)
        res["stitch_conf"] = a.stitch_conf
        res["stitch_version"] = stitch_alloc.version()
    import torch

    recording = bool(a.record) and not c["stitch"]
    if recording:
        # Trace events only (no stack capture: context=None keeps the file small and the
        # run's speed close to an unrecorded one's).
        torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python",
                                                 max_entries=50_000_000)
    torch.manual_seed(a.seed)
    res["torch"] = torch.__version__
    try:
        import transformers

        res["transformers"] = transformers.__version__
    except ImportError:
        pass
    res["gpu"] = torch.cuda.get_device_name(0)
    res["allocator_backend"] = torch.cuda.get_allocator_backend()
    res["alloc_conf_env"] = os.environ.get("PYTORCH_ALLOC_CONF")
    t0 = time.perf_counter()
    run = {"generate": run_generate, "train": run_train, "replay": run_replay}[a.workload]
    r = run(torch, a)
    keep = r.pop("_keep")  # the model (and optimizer) stay alive through the probe
    torch.cuda.synchronize()
    res.update(r)
    res["memory"] = memory_figures(torch, c["stitch"])
    if not a.no_probe:
        res["probe"] = probe_largest(torch, c["stitch"])
    if c["stitch"]:
        import stitch_alloc

        res["stitch_summary"] = stitch_alloc.memory_summary(0)
    res["wall_seconds"] = time.perf_counter() - t0
    if recording:
        import gzip
        import pickle

        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        os.makedirs(a.record, exist_ok=True)
        path = os.path.join(a.record, f"{a.workload}-{a.child}.pickle.gz")
        with gzip.open(path, "wb") as f:
            pickle.dump(snap, f)
        res["recorded"] = {"path": path, "events": sum(len(t) for t in snap["device_traces"])}
    res["ok"] = True
    del keep
    with open(a.result, "w") as f:
        json.dump(res, f, indent=1)
    return 0


# ---------------------------------------------------------------------------------------
# The parent: every (allocator, workload) in a fresh process, then the table.


def git_commit():
    try:
        return subprocess.run(
            ["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def find_lib(a):
    sys.path.insert(0, PYDIR)
    try:
        import stitch_alloc

        return stitch_alloc.find_library(a.lib)
    except (ImportError, FileNotFoundError) as e:
        return f"NOT FOUND ({e})"


def run_one(a, config, workload):
    fd, result = tempfile.mkstemp(prefix=f"tv-{config}-{workload}-", suffix=".json")
    os.close(fd)
    os.unlink(result)
    cmd = [sys.executable] + child_args(a, config, workload, result)
    t0 = time.time()
    rec = {"config": config, "label": CONFIGS[config]["label"], "workload": workload, "ok": False}
    try:
        p = subprocess.run(cmd, env=child_env(a, config), capture_output=True, text=True,
                           timeout=a.timeout)
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        rc = "timeout"
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
    if rc == 0 and os.path.exists(result):
        with open(result) as f:
            rec = json.load(f)
        os.unlink(result)
    else:
        rec["error"] = f"exit {rc}"
        rec["stdout_tail"] = out[-3000:]
        rec["stderr_tail"] = err[-6000:]
    rec["elapsed"] = time.time() - t0
    return rec


def gib(x):
    return "-" if x is None else f"{x / GIB:.2f}"


def ratio(x, nd=3):
    return "-" if x is None else f"{x:.{nd}f}"


def table(results):
    head = (f"{'workload':<9} {'allocator':<20} {'peak res':>9} {'peak alloc':>10} "
            f"{'res/alloc':>9} {'res/req':>8} {'throughput':>16} {'vs dflt':>8} "
            f"{'largest':>8} {'/avail':>7}  status")
    lines = [head, "-" * len(head)]
    def tput(r):
        return r[TPUT[r["workload"]][0]]

    runs = {}  # (workload, config) -> throughputs
    for r in results:
        if r.get("ok"):
            runs.setdefault((r["workload"], r["config"]), []).append(tput(r))
    base = {w: median(v) for (w, c), v in runs.items() if c == "default"}
    for r in results:
        if not r.get("ok"):
            lines.append(f"{r['workload']:<9} {r['label']:<20} {'':>9} {'':>10} {'':>9} {'':>8} "
                         f"{'':>16} {'':>8} {'':>8} {'':>7}  FAILED ({r.get('error')})")
            continue
        m, pr = r["memory"], r.get("probe", {})
        note = ""
        if r["workload"] == "generate" and r.get("tokens") != r.get("tokens_expected"):
            note = f" (generated {r.get('tokens')} of {r.get('tokens_expected')} tokens)"
        key, unit = TPUT[r["workload"]]
        tp = r[key]
        b = base.get(r["workload"])
        vs = f"{tp / b:.3f}" if b else "-"
        lines.append(
            f"{r['workload']:<9} {r['label']:<20} {gib(m['reserved_bytes.all.peak']):>9} "
            f"{gib(m['allocated_bytes.all.peak']):>10} {ratio(m['reserved_over_allocated']):>9} "
            f"{ratio(m['reserved_over_requested']):>8} {tp:>10.2f} {unit:<5} {vs:>8} "
            f"{gib(pr.get('largest_bytes')):>8} {ratio(pr.get('largest_over_available')):>7}  ok{note}"
        )
    if any(len(v) > 1 for v in runs.values()):
        lines.append("")
        lines.append("throughput over repeated runs (median, min-max, median over default's median):")
        for (w, c), v in runs.items():
            b = base.get(w)
            rel = f"{median(v) / b:.3f}" if b else "-"
            lines.append(f"  {w:<9} {CONFIGS[c]['label']:<20} n={len(v)} median {median(v):.2f} "
                         f"[{min(v):.2f}-{max(v):.2f}] vs dflt {rel}")
    lines.append("")
    lines.append("peak res / peak alloc: GiB over the whole process (weights included); res/req: "
                 "peak reserved over peak requested bytes; vs dflt: throughput over PyTorch "
                 "default's; largest: biggest torch.empty that succeeded at the end (GiB), /avail: "
                 "over driver-free + reserved-unallocated memory.")
    return "\n".join(lines)


def main(argv=None):
    a = parse_args(argv)
    if a.child:
        if not a.workload or not a.result:
            print("--child needs --workload and --result", file=sys.stderr)
            return 2
        return child(a)
    plan = [(c, w) for w in a.workload_list for _ in range(a.repeat) for c in a.config_list]
    if a.dry_run:
        print(f"library: {find_lib(a)}")
        print(f"generate plan ({len(gen_plan(a))} batches, (batch, prompt, new)): {gen_plan(a)}")
        print(f"train plan ({a.train_steps} timed steps + 1 warm-up, (batch, seq)): {train_plan(a)}")
        for c, w in plan:
            env = child_env(a, c)
            shown = {k: env[k] for k in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF",
                                         "STITCH_ALLOC_CONF") if k in env}
            print(f"would run: {c}/{w}: env {shown}: {' '.join(child_args(a, c, w, '<tmp>.json'))}")
        return 0
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": a.commit or git_commit(),
        "host": platform.node(),
        "python": platform.python_version(),
        "library": find_lib(a) if "stitch" in a.config_list else None,
        "args": {k: v for k, v in vars(a).items() if k not in ("child", "workload", "result")},
    }
    results = []
    for c, w in plan:
        print(f"== {c} / {w} ...", flush=True)
        r = run_one(a, c, w)
        results.append(r)
        if r.get("ok"):
            m = r["memory"]
            print(f"   ok in {r['elapsed']:.0f}s: peak reserved {gib(m['reserved_bytes.all.peak'])} "
                  f"GiB, peak allocated {gib(m['allocated_bytes.all.peak'])} GiB", flush=True)
        else:
            print(f"   FAILED ({r.get('error')}):\n{r.get('stderr_tail', '')[-2000:]}", flush=True)
    text = table(results)
    print()
    print(f"{meta['date']}  commit {meta['commit']}  {results[0].get('gpu', '') if results else ''}")
    print(text)
    with open(a.out, "w") as f:
        json.dump({"meta": meta, "results": results, "table": text}, f, indent=1)
    print(f"\nwrote {a.out}")
    return 0 if all(r.get("ok") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
