#!/usr/bin/env python3
"""Real clients, unchanged, under torch's default allocator and under stitch-alloc (issue #12
item 8).

Each case is an ordinary program of a library people use (timm, Lightning, transformers,
peft, torch.compile), with models built from configs (random weights, no network), run in a
FRESH Python process per allocator (the allocator is chosen before the process's first CUDA
allocation): once or twice under the default, once under stitch-alloc
(``stitch_alloc.enable(path=...)``: the C++ extension where it builds, else the
CUDAPluggableAllocator fallback; the mode is printed and reported).

Two kinds of check:

* ``exact`` (fp32, fixed seeds, ``torch.use_deterministic_algorithms(True, warn_only=True)``
  except where noted, TF32 off, ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` in every child's
  environment): the results (losses as Python floats, greedy tokens, a SHA-256 digest of
  the trained parameters or of the generation scores) must be IDENTICAL under both
  allocators. When they differ, the default is run a second time, to tell "the allocator
  changes the result" from "the default does not reproduce itself either".
  Operations torch flags as nondeterministic during the run are reported.
* ``spread`` (AMP / bf16, ``cudnn.benchmark=True``: kernel choices and near-ties may vary
  between runs whatever the allocator): the default runs ``--default-runs`` times (4; at
  least 2), before and after stitch-alloc's run; the spread is the largest distance between
  two of its runs (max |loss difference|, or the number of differing tokens), and
  stitch-alloc passes when its distance to the nearest default run is within that spread.
  (With two default runs the estimate was too narrow: run 76-77 of design/gpu-results.md
  saw the default's own distance on fp16 ResNet-50 range 1.2e-4 to 3.7e-4 between pairs,
  so one pair failed a run that a second pair passed.)

Per case and allocator: the result, peak reserved / peak requested bytes (from
``torch.cuda.memory_stats()`` under the default and the extension; from
``stitch_alloc.memory_stats()`` under the fallback, which has no torch statistics), the
case's own time and the process's wall time, and the mode. One case failing, crashing or
timing out does not stop the others. Run on the GPU machine from the repository root::

    bash scripts/gpu-session.sh clients                 # finds .gpu/libstitch_alloc.so
    python3 scripts/torch-clients.py --lib target/release/libstitch_alloc.so --out c.json
    python3 scripts/torch-clients.py --cases hf_generate,lora   # a subset
    python3 scripts/torch-clients.py --list                      # the cases; needs no torch

The whole run takes about 8-10 minutes on the H200 (the two torch.compile runs compile cold:
each child gets its own empty inductor and Triton cache, so the two allocators' wall
times compare).
"""
import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torchcases import bundle_commit, mode_of, prebuild_extension  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
PYDIR = os.path.join(REPO, "python")

# The child's preamble. Before it: STITCH, DETERMINISTIC, PYDIR, LIB (assignments written by
# run_case). It defines `torch`, `mode`, `result(ok, detail, **extra)` (prints one RESULT
# line with the memory figures; a case calls it once), `digest(tensors)`, `llama(...)` and
# `seed_all()`. A case that raises prints no RESULT: the parent reports its exit and stderr.
PREAMBLE = r'''
import hashlib, json, os, random, shutil, sys, tempfile, time, warnings
_t_start = time.time()
NONDET = set()
_showwarning = warnings.showwarning
def _record_warning(message, category, filename, lineno, file=None, line=None):
    if "deterministic" in str(message):
        NONDET.add(str(message).splitlines()[0][:200])
    _showwarning(message, category, filename, lineno, file, line)
warnings.showwarning = _record_warning
warnings.filterwarnings("always", message=".*deterministic.*")

mode = "default"
if STITCH:
    sys.path.insert(0, PYDIR)
    import stitch_alloc
    stitch_alloc.enable(path=LIB)
    mode = stitch_alloc.mode()
import torch
print("MODE " + str(mode), flush=True)
if DETERMINISTIC:
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = False

def seed_all(seed=0):
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy
        numpy.random.seed(seed)
    except ImportError:
        pass
seed_all()

def memory_figures():
    torch.cuda.synchronize()
    if mode in ("default", "extension"):
        m, source = torch.cuda.memory_stats(0), "torch.cuda.memory_stats"
    else:  # the fallback: torch's statistics raise under CUDAPluggableAllocator
        m, source = stitch_alloc.memory_stats(0), "stitch_alloc.memory_stats"
    pr = int(m.get("reserved_bytes.all.peak", 0))
    pq = int(m.get("requested_bytes.all.peak", 0))
    out = {"source": source, "peak_reserved": pr, "peak_requested": pq,
           "peak_allocated": int(m.get("allocated_bytes.all.peak", 0)),
           "reserved_over_requested": pr / pq if pq else None,
           "num_ooms": int(m.get("num_ooms", 0)),
           "num_alloc_retries": int(m.get("num_alloc_retries", 0))}
    if STITCH:
        s = stitch_alloc.memory_stats(0)
        for k in ("stitches", "driver_calls", "slow_allocs", "mapped_bytes.peak"):
            out[k] = int(s.get(k, 0))
    return out

def result(ok, detail, **extra):
    try:
        mem = memory_figures()
    except Exception as e:  # noqa: BLE001 (the case's result still counts)
        mem = {"error": f"{type(e).__name__}: {e}"[:300]}
    rec = dict(ok=bool(ok), detail=str(detail), mode=mode, seconds=time.time() - _t_body,
               process_seconds=time.time() - _t_start, memory=mem,
               nondeterministic=sorted(NONDET), **extra)
    print("RESULT " + json.dumps(rec), flush=True)

def digest(tensors):
    """SHA-256 (16 hex digits) of the tensors' values, as fp32 bytes, in order."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]

def llama(layers=2, hidden=256, vocab=4096, dtype=torch.float32, attn="eager"):
    """A small Llama from a LlamaConfig, random weights (seeded), on the GPU. Eager attention
    where bit-equality is checked (SDPA's memory-efficient backward is nondeterministic)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                      num_hidden_layers=layers, num_attention_heads=hidden // 64,
                      num_key_value_heads=hidden // 64, max_position_embeddings=1024,
                      bos_token_id=1, eos_token_id=None, pad_token_id=0,
                      attn_implementation=attn)
    seed_all()
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    model = model.to(dtype)
    model.generation_config.eos_token_id = None  # every generation runs to max_new_tokens
    model.generation_config.pad_token_id = 0
    return model

def cuda_batches(n, shape, high, seed):
    """n batches of token ids (or, with high=None, images), the same in every run."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    for _ in range(n):
        if high is None:
            yield torch.randn(shape, device="cuda", generator=g)
        else:
            yield torch.randint(3, high, shape, device="cuda", generator=g)

_t_body = time.time()
'''

# A timm training loop with AMP and cudnn.benchmark (shared by the ResNet and ViT cases).
_TIMM = """
    import timm
    torch.backends.cudnn.benchmark = True
    model = timm.create_model({name!r}, pretrained=False, num_classes=100).cuda().train()
    opt = {opt}
    scaler = torch.amp.GradScaler("cuda", enabled={dtype} == torch.float16)
    g = torch.Generator(device="cuda").manual_seed(1)
    losses = []
    for step in range({steps}):
        x = torch.randn({batch}, 3, 224, 224, device="cuda", generator=g)
        y = torch.randint(0, 100, ({batch},), device="cuda", generator=g)
        with torch.autocast("cuda", dtype={dtype}):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    result(True, f"{steps} steps, batch {batch}, {dtype}, last loss {{losses[-1]:.4f}}",
           losses=losses)
"""

# Each case: kind ("exact" or "spread"), deterministic (torch.use_deterministic_algorithms
# in the child), what is compared (the result keys; a spread case's first key is its
# metric), a timeout, and the body run after the preamble.
CASES = {
    "resnet50_amp": dict(
        kind="spread", deterministic=False, compare=["losses"], timeout=180,
        what="timm ResNet-50 training, AMP fp16 + GradScaler, cudnn.benchmark, SGD",
        body=_TIMM.format(name="resnet50", steps=10, batch=32, dtype="torch.float16",
                          opt="torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)")),
    "vit_amp": dict(
        kind="spread", deterministic=False, compare=["losses"], timeout=180,
        what="timm ViT-S/16 training, bf16 autocast, cudnn.benchmark, AdamW",
        body=_TIMM.format(name="vit_small_patch16_224", steps=10, batch=32,
                          dtype="torch.bfloat16",
                          opt="torch.optim.AdamW(model.parameters(), lr=1e-4)")),
    "lightning_fit": dict(
        kind="exact", deterministic=True, compare=["losses", "digest"], timeout=180,
        what="Lightning Trainer.fit, tiny MLP language model, fp32, 12 steps, no logger",
        body="""
    try:
        import lightning as L
    except ImportError:
        import pytorch_lightning as L

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(1024, 128)
            self.mlp = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.GELU(),
                                           torch.nn.Linear(512, 128), torch.nn.LayerNorm(128))
            self.head = torch.nn.Linear(128, 1024)
            self.losses = []

        def training_step(self, batch, _):
            (ids,) = batch
            logits = self.head(self.mlp(self.emb(ids[:, :-1])))
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
            self.losses.append(loss.detach())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    seed_all()
    module = Tiny()
    ids = torch.randint(0, 1024, (192, 64), generator=torch.Generator().manual_seed(2))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=16,
                                         shuffle=False, num_workers=0)
    root = tempfile.mkdtemp(prefix="clients-lightning-")
    trainer = L.Trainer(accelerator="gpu", devices=1, max_steps=12, precision="32-true",
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0,
                        default_root_dir=root)
    trainer.fit(module, loader)
    shutil.rmtree(root, ignore_errors=True)
    losses = [x.item() for x in module.losses]
    result(len(losses) == 12, f"{len(losses)} steps, last loss {losses[-1]:.6f}", losses=losses,
           digest=digest(module.parameters()))
""",
    ),
    "hf_generate": dict(
        kind="exact", deterministic=True, compare=["tokens", "digest"], timeout=150,
        what="transformers generate, Llama 4x256 fp32 (LlamaConfig), greedy, dynamic cache, "
             "3 batch shapes; digest of the scores",
        body="""
    model = llama(layers=4, hidden=256).eval()
    tokens, scores = [], []
    for i, (b, p, n) in enumerate(((4, 32, 48), (1, 100, 64), (8, 16, 32))):
        (ids,) = cuda_batches(1, (b, p), 4096, seed=10 + i)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             do_sample=False, use_cache=True, return_dict_in_generate=True,
                             output_scores=True)
        tokens.append(out.sequences[:, p:].tolist())
        scores.extend(s.clone() for s in out.scores)
    n = sum(len(r) for t in tokens for r in t)
    result(True, f"{n} tokens in 3 calls", tokens=tokens, digest=digest(scores))
""",
    ),
    "hf_generate_bf16": dict(
        kind="spread", deterministic=False, compare=["tokens"], timeout=150,
        what="transformers generate, Llama 4x512 bf16, SDPA, greedy, 3 batch shapes "
             "(near-ties may flip tokens: compared against default's own spread)",
        body="""
    model = llama(layers=4, hidden=512, dtype=torch.bfloat16, attn="sdpa").eval()
    tokens = []
    for i, (b, p, n) in enumerate(((4, 32, 48), (1, 100, 64), (8, 16, 32))):
        (ids,) = cuda_batches(1, (b, p), 4096, seed=10 + i)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             do_sample=False, use_cache=True)
        tokens.append(out[:, p:].tolist())
    n = sum(len(r) for t in tokens for r in t)
    result(True, f"{n} tokens in 3 calls", tokens=tokens)
""",
    ),
    "hf_trainer": dict(
        kind="exact", deterministic=True, compare=["losses", "digest"], timeout=180,
        what="transformers Trainer, Llama 2x256 fp32, 8 steps, tmp output dir, report_to=[]",
        body="""
    from transformers import Trainer, TrainingArguments

    class Tokens(torch.utils.data.Dataset):
        def __init__(self):
            self.ids = torch.randint(3, 4096, (64, 128), generator=torch.Generator().manual_seed(3))

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            x = self.ids[i]
            return {"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x.clone()}

    model = llama(layers=2, hidden=256)
    out_dir = tempfile.mkdtemp(prefix="clients-trainer-")
    args = TrainingArguments(output_dir=out_dir, max_steps=8, per_device_train_batch_size=8,
                             learning_rate=1e-3, logging_steps=1, report_to=[],
                             save_strategy="no", disable_tqdm=True, seed=0,
                             dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens())
    res = trainer.train()
    shutil.rmtree(out_dir, ignore_errors=True)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    result(len(losses) == 8, f"{len(losses)} logged losses, training_loss {res.training_loss:.6f}",
           losses=losses + [res.training_loss], digest=digest(model.parameters()))
""",
    ),
    "peft_lora": dict(
        kind="exact", deterministic=True, compare=["losses", "digest"], timeout=150,
        what="peft LoRA (r=8, q/v, dropout 0.05) fine-tune of a Llama 2x256 fp32, AdamW, 10 steps",
        body="""
    from peft import LoraConfig, get_peft_model

    base = llama(layers=2, hidden=256)
    seed_all(1)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05,
                                            target_modules=["q_proj", "v_proj"],
                                            task_type="CAUSAL_LM"))
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-3)
    losses = []
    for ids in cuda_batches(10, (8, 128), 4096, seed=4):
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.loss.item())
    result(True, f"{len(trainable)} trainable tensors, last loss {losses[-1]:.6f}",
           losses=losses, digest=digest(trainable))
""",
    ),
    # torch.use_deterministic_algorithms stays OFF here: under it inductor skips CUDA graphs
    # for graphs with index_put/scatter (the static cache's update), which would defeat the
    # point. fp32, seeds and CUBLAS_WORKSPACE_CONFIG as for the other exact cases; the
    # inductor counters say whether CUDA graphs ran (cudagraph_skips must stay 0).
    "compile_decode": dict(
        kind="exact", deterministic=False, compare=["tokens"], timeout=300,
        what="torch.compile(mode='reduce-overhead') decode steps of a Llama 2x256 fp32: "
             "transformers generate with the static cache (CUDA graphs), 3 calls",
        body="""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = llama(layers=2, hidden=256).eval()
    try:
        from transformers import CompileConfig  # generate compiles the decode step itself
        model.generation_config.compile_config = CompileConfig(mode="reduce-overhead")
        how = "generate's own compile (CompileConfig(mode='reduce-overhead'))"
    except ImportError:
        model.forward = torch.compile(model.forward, mode="reduce-overhead")
        how = "model.forward = torch.compile(..., mode='reduce-overhead')"
    model.generation_config.cache_implementation = "static"
    tokens = []
    for i in range(3):
        (ids,) = cuda_batches(1, (2, 16), 4096, seed=20 + i)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=24, do_sample=False)
        tokens.append(out[:, 16:].tolist())
    from torch._dynamo.utils import counters
    cg = {k: sum(v.values()) if hasattr(v, "values") else v
          for k, v in counters["inductor"].items() if "cudagraph" in k}
    graphs = counters["stats"].get("unique_graphs", 0)
    tree = None
    try:
        from torch._inductor import cudagraph_trees
        # A tree manager exists on this thread once cudagraph trees have recorded a graph.
        tree = cudagraph_trees.get_container(0).tree_manager is not None
    except Exception:  # noqa: BLE001 (torch moved it: the counters still say)
        pass
    ok = graphs > 0 and not cg.get("cudagraph_skips") and tree is not False
    result(ok, f"{how}; {graphs} graphs compiled, cudagraph tree manager {tree}, "
               f"cudagraph counters {cg}", tokens=tokens, compiled_graphs=graphs,
           cudagraph_counters=cg, cudagraph_tree=tree)
""",
    ),
}


def child_env(tmp):
    env = dict(os.environ)
    for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        env.pop(k, None)
    env.update({
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",  # deterministic cuBLAS, the same for both
        "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
        "WANDB_DISABLED": "true",
        # Each child compiles cold: the two allocators' wall times compare.
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(tmp, "inductor"),
        "TRITON_CACHE_DIR": os.path.join(tmp, "triton"),
    })
    return env


def run_case(name, stitch, lib, timeout):
    case = CASES[name]
    head = (f"STITCH = {bool(stitch)!r}\nDETERMINISTIC = {bool(case['deterministic'])!r}\n"
            f"PYDIR = {PYDIR!r}\nLIB = {lib!r}\n")
    tmp = tempfile.mkdtemp(prefix=f"clients-{name}-")
    script = os.path.join(tmp, f"{name}.py")
    with open(script, "w") as f:
        f.write(head + PREAMBLE + textwrap.dedent(case["body"]))
    t0 = time.time()
    try:
        r = subprocess.run([sys.executable, script], capture_output=True, text=True,
                           timeout=timeout, env=child_env(tmp), cwd=tmp)
        out, err, rc = r.stdout, r.stderr, r.returncode
    except subprocess.TimeoutExpired as e:
        def text(x):
            return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
        out, err, rc = text(e.stdout), text(e.stderr), "timeout"
    wall = time.time() - t0
    shutil.rmtree(tmp, ignore_errors=True)
    res = None
    for line in out.splitlines():
        if line.startswith("RESULT "):
            res = json.loads(line[len("RESULT "):])
    if res is None:
        tail = (err or out).strip().splitlines()[-4:]
        what = f"timed out after {timeout} s" if rc == "timeout" else f"exit {rc}"
        res = {"ok": False, "detail": f"{what}: " + " | ".join(tail)[:400]}
    res.setdefault("mode", mode_of(out))
    res["exit"] = rc
    res["wall"] = round(wall, 1)
    if not res["ok"]:
        res["stderr_tail"] = err[-3000:]
    return res


def _flat(x):
    if isinstance(x, list):
        for y in x:
            yield from _flat(y)
    else:
        yield x


def distance(a, b):
    """Between two runs' values of one key: 0 when identical; for token lists the number of
    differing tokens, for losses the largest absolute difference; inf when the shapes
    differ or a value is missing."""
    if a is None or b is None:
        return math.inf
    if isinstance(a, str) or isinstance(b, str):
        return 0 if a == b else math.inf
    fa, fb = list(_flat(a)), list(_flat(b))
    if len(fa) != len(fb):
        return math.inf
    if all(isinstance(v, int) for v in fa + fb):
        return sum(x != y for x, y in zip(fa, fb))
    return max((abs(x - y) for x, y in zip(fa, fb)), default=0.0)


def same(a, b, keys):
    return all(k in a and k in b and a[k] == b[k] for k in keys)


def judge(name, runs, lib, timeout):
    """The verdict of one case from its runs: {"default": [...], "stitch": {...}}."""
    case = CASES[name]
    keys = case["compare"]
    ds, s = runs["default"], runs["stitch"]
    d = ds[0]
    if not s["ok"]:
        v = "FAIL (stitch-alloc run failed)"
        if not any(x["ok"] for x in ds):
            v += " (default fails too)"
        return v, "stitch: " + s["detail"]
    if not d["ok"]:
        return "FAIL (default run failed)", "default: " + d["detail"]
    if case["kind"] == "exact":
        if same(s, d, keys):
            return "PASS (identical)", f"{'+'.join(keys)} identical"
        diff = {k: distance(s.get(k), d.get(k)) for k in keys}
        if len(ds) < 2:  # is the default itself reproducible? one more run says
            ds.append(run_case(name, False, lib, timeout))
        d2 = ds[1]
        self_same = d2["ok"] and same(d2, d, keys)
        return ("FAIL (differs; default reproduces itself)" if self_same
                else "FAIL (differs; default differs from itself too)"), f"distance {diff}"
    # spread: the largest distance between two default runs, against stitch-alloc's distance
    # to the nearest one
    k = keys[0]
    bad = [i + 1 for i, x in enumerate(ds) if not x["ok"]]
    if len(ds) < 2 or bad:
        return "FAIL (a default run failed)", f"default runs {bad or 'missing'} failed"
    spread = max(distance(x[k], y[k]) for i, x in enumerate(ds) for y in ds[i + 1:])
    dev = min(distance(s[k], x[k]) for x in ds)
    verdict = "PASS (within default's spread)" if dev <= spread else "FAIL (outside default's spread)"
    return verdict, (f"{k}: stitch vs nearest of {len(ds)} default runs {dev:.6g}, "
                     f"largest default vs default {spread:.6g}")


def _mem(r):
    m = (r or {}).get("memory") or {}
    pr, pq = m.get("peak_reserved"), m.get("peak_requested")
    if not pr or not pq:
        return "-"
    return f"{pr / 2**20:.0f}/{pq / 2**20:.0f} MiB {pr / pq:.3f}"


def save(path, meta, rows):
    if path:
        with open(path, "w") as f:
            json.dump({**meta, "rows": rows}, f, indent=1)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lib", default=None, help="libstitch_alloc.so (default: stitch_alloc.find_library)")
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated cases")
    p.add_argument("--timeout", type=int, default=None,
                   help="seconds per case and allocator (default: each case's own)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--list", action="store_true", help="print the cases and exit")
    p.add_argument("--default-runs", type=int, default=4,
                   help="default runs of a spread case (at least 2): their largest distance "
                        "is the spread stitch-alloc must stay within")
    a = p.parse_args()
    if a.default_runs < 2:
        p.error("--default-runs must be at least 2")
    if a.list:
        for n, c in CASES.items():
            print(f"{n:17} {c['kind']:6} {c['what']}")
        return 0
    cases = [c for c in a.cases.split(",") if c]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        p.error(f"unknown cases {unknown}; --list prints them")
    sys.path.insert(0, PYDIR)
    import stitch_alloc  # noqa: PLC0415

    lib = stitch_alloc.find_library(a.lib)
    # Build the extension once first (cached by torch), so that no case's timeout includes it.
    built, build_log = prebuild_extension(PYDIR, 420, "stitch runs use the fallback")
    meta = {"lib": lib, "extension_built": built, "build_log": build_log}
    try:
        import torch  # noqa: PLC0415

        meta["torch"] = torch.__version__  # no CUDA in the parent: the children have the GPU
        meta["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                     capture_output=True, text=True).stdout.strip()
    except Exception:  # noqa: BLE001 (the results are still useful without it)
        pass
    meta["commit"] = bundle_commit(REPO)
    rows = []
    t_all = time.time()
    for name in cases:
        case = CASES[name]
        timeout = a.timeout or case["timeout"]
        # Interleaved: default, stitch-alloc, then the spread cases' other default runs.
        runs = {"default": [run_case(name, False, lib, timeout)]}
        runs["stitch"] = run_case(name, True, lib, timeout)
        if case["kind"] == "spread":
            for _ in range(a.default_runs - 1):
                runs["default"].append(run_case(name, False, lib, timeout))
        verdict, why = judge(name, runs, lib, timeout)
        d, s = runs["default"][0], runs["stitch"]
        nondet = sorted(set(d.get("nondeterministic", []) + s.get("nondeterministic", [])))
        row = {"case": name, "kind": case["kind"], "what": case["what"], "verdict": verdict,
               "why": why, "nondeterministic_ops": nondet, "runs": runs}
        rows.append(row)
        print(f"== {name} [{case['kind']}] {verdict}: {why}", flush=True)
        for label, r in [("default", x) for x in runs["default"]] + [("stitch", s)]:
            print(f"   {label:8} [{r.get('mode')}] ok={r['ok']} wall {r['wall']} s, case "
                  f"{r.get('seconds', 0):.1f} s, peak reserved/requested {_mem(r)}: "
                  f"{r['detail'][:200]}", flush=True)
        if nondet:
            print(f"   nondeterministic ops flagged by torch: {nondet}", flush=True)
        save(a.out, meta, rows)  # after every case: a run cut short keeps what it has
    w = max(len(r["case"]) for r in rows)
    print(f"\n{'case':<{w}} | kind   | {'verdict':<52} | {'default peak res/req':<24} | "
          f"{'stitch peak res/req':<24} | wall d/s | mode")
    for r in rows:
        d, s = r["runs"]["default"][0], r["runs"]["stitch"]
        print(f"{r['case']:<{w}} | {r['kind']:<6} | {r['verdict']:<52} | {_mem(d):<24} | "
              f"{_mem(s):<24} | {d['wall']:.0f}/{s['wall']:.0f} s | {s.get('mode')}")
    passed = sum(r["verdict"].startswith("PASS") for r in rows)
    print(f"{passed} of {len(rows)} clients give the default's results under stitch-alloc "
          f"({time.time() - t_all:.0f} s)", flush=True)
    save(a.out, meta, rows)
    return 0 if passed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
