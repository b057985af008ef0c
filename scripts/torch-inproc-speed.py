#!/usr/bin/env python3
"""Step times of real workloads under PyTorch's own caching allocator and under
stitch-alloc, alternating in **one process** (issue #11 item 4). Fresh-process comparisons
cannot resolve 1% on the GPU machine: whole processes run at one of two CPU speeds, 20-130%
apart under either allocator (design/gpu-results.md runs 52-60). Here the process, its
model and its CUDA context are shared; only the allocator serving each step changes.

How: ``stitch_alloc.enable`` installs the extension, which keeps torch's own allocator;
the extension's diagnostic ``_set_delegate(True)`` makes new allocations come from torch's
own allocator (their frees go back to it), ``False`` from stitch-alloc. Each round runs
both sides in turn (the order alternates between rounds), each side 2 untimed steps (so
that its cache holds the step's sizes) and then ``--steps`` timed ones, every step ended
by a device synchronisation. Per round the speed of stitch-alloc against the default is
the default's median step time over stitch-alloc's; the result is the median of the rounds
and a 95% bootstrap interval over them.

    python3 scripts/torch-inproc-speed.py --lib .gpu/libstitch_alloc.so --rounds 10

Workloads (fixed shapes, models from configs with random weights): ``llm-train-s`` (the
zoo's Llama 8x768, AdamW, bf16 autocast; batch 8 x 512; ``llm-train-s-b2`` and ``-b32`` at
batch 2 and 32, on request), ``bert-encode`` (BERT-base fp16
inference; batch 32 x 256), ``resnet50-amp`` and ``vit-amp`` (timm training with AMP, SGD;
batch 64 and 32 of 224^2 images); on request ``lora`` (peft LoRA on a Llama 8x1024, batch
4 x 512), ``moe`` (the zoo's mixture of experts, expert batches changing every step in a
sequence both sides repeat) and ``hf-generate`` (``generate``, batch 8, 128 + 32 tokens).
The model and the optimizer state are allocated once, by stitch-alloc, before the first
round. Prints one ``RESULT {json}`` line and a table.
"""
import argparse
import json
import os
import random
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from torchcases import zoo_module  # noqa: E402


def llm_train(batch):
    def build(torch, zoo):
        model, opt = zoo.llm_model(torch, 8, 768)
        ids = torch.randint(3, 32000, (batch, 512), device="cuda")

        def step():
            zoo.llm_step(torch, model, opt, ids)  # its output is dropped, as `del out` did

        return step

    return build


def bert_encode(torch, zoo):
    model, cfg = zoo.bert_model(torch, 12)
    ids = torch.randint(100, cfg.vocab_size, (32, 256), device="cuda")
    mask = torch.ones_like(ids)

    def step():
        with torch.inference_mode():
            out = model(input_ids=ids, attention_mask=mask)
            emb = out.last_hidden_state.mean(dim=1)
            del out, emb

    return step


def timm_amp(name, batch):
    def build(torch, zoo):
        model, opt, scaler = zoo.timm_model(torch, name)
        x = torch.randn(batch, 3, 224, 224, device="cuda")
        y = torch.randint(0, 1000, (batch,), device="cuda")

        def step():
            zoo.timm_step(torch, model, opt, scaler, x, y)

        return step

    return build


def lora(torch, zoo):
    from peft import LoraConfig, get_peft_model

    base = zoo._llama(torch, 8, 1024, torch.bfloat16)
    model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05,
                                            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(3, 32000, (4, 512), device="cuda")

    def step():
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del out

    return step


class Varying:
    """A step whose inputs change from step to step in a sequence that starts again at
    `reset()` (called before each side's steps), so both allocators see the same sizes in
    the same order."""

    def __init__(self, torch, body, seed=0):
        self.torch, self.body, self.seed = torch, body, seed
        self.reset()

    def reset(self):
        self.gen = self.torch.Generator(device="cuda")
        self.gen.manual_seed(self.seed)
        self.i = 0

    def __call__(self):
        self.body(self.gen, self.i)
        self.i += 1


def moe(torch, zoo):
    """The zoo's mixture-of-experts layers (8 experts, top 2, 4 layers, d 1024, bf16 autocast)
    on 8,192 tokens a step whose mean drifts, so the experts' batch sizes change every step
    (the same sequence on both sides)."""
    model, opt, d = zoo.moe_model(torch, 4)

    def body(gen, i):
        x = torch.randn(8192, d, device="cuda", generator=gen) + ((i * 0.37) % 2.0 - 1.0)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del x, loss

    return Varying(torch, body)


def hf_generate(torch, zoo):
    """`generate` on the zoo's bf16 Llama of 4 x 2048: batch 8, a 128-token prompt, 32 new
    tokens (no early stop), as one step."""
    model = zoo._llama(torch, 4, 2048, torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    ids = torch.randint(3, 32000, (8, 128), device="cuda")

    def step():
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=32, do_sample=False, use_cache=True)
            del out

    return step


WORKLOADS = {"llm-train-s": llm_train(8), "bert-encode": bert_encode,
             "resnet50-amp": timm_amp("resnet50", 64), "vit-amp": timm_amp("vit_base_patch16_224", 32)}
# The same model at a quarter and four times the batch (not in the default list): about the
# same allocations per step for a quarter and four times the GPU work, so a cost per
# allocation on the CPU weighs four times more, or a quarter as much, than at batch 8.
VARIANTS = {"llm-train-s-b2": llm_train(2), "llm-train-s-b32": llm_train(32),
            # More of the zoo's kinds (thirty-first session): a LoRA fine-tune (peft, fixed
            # batch 4 x 512), the mixture of experts with expert batches changing every step,
            # and HF generate with a KV cache.
            "lora": lora, "moe": moe, "hf-generate": hf_generate}


def counters(stitch_alloc):
    """stitch-alloc's own counters on device 0: driver time and malloc + free time (us),
    event waits, slow-path allocations and stitches repeating an earlier one's state,
    cumulative."""
    doc = stitch_alloc.stats(0)
    st = doc.get("stats", {})
    return {"driver_us": float(doc.get("driver_time_us", 0)),
            "api_us": float(doc.get("malloc_free_time_us", 0)),
            "event_waits": float(st.get("event_waits", 0)),
            "slow_allocs": float(st.get("slow_allocs", 0)),
            "repeated_stitches": float(st.get("repeated_stitches", 0))}


def record(a):
    """`--record`: each workload's allocations under PyTorch's default allocator, as the
    rounds replay them, for the simulator."""
    import torch

    zoo = zoo_module()
    os.makedirs(a.record, exist_ok=True)
    for name in a.workloads.split(","):
        torch.manual_seed(0)
        torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python",
                                                max_entries=2_000_000)
        step = {**WORKLOADS, **VARIANTS}[name](torch, zoo)
        for _ in range(2):
            step()
        for _ in range(a.rounds):
            restart(step)
            for _ in range(2 + a.steps):
                step()
            torch.cuda.synchronize()
        path = os.path.join(a.record, name + ".pickle")
        torch.cuda.memory._dump_snapshot(path)
        torch.cuda.memory._record_memory_history(enabled=None)
        print(f"{name}: {path}, reserved peak {torch.cuda.max_memory_reserved() / 2**30:.3f} GiB, "
              f"allocated peak {torch.cuda.max_memory_allocated() / 2**30:.3f} GiB", flush=True)
        del step
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def warm_sides(torch, ext, step):
    """Each side twice, alternating (default first, then stitch-alloc first), each after its
    input sequence restarted and two untimed steps: yields the side, delegation set."""
    for order in (("default", "stitch"), ("stitch", "default")):
        for side in order:
            ext._set_delegate(side == "default")
            restart(step)
            for _ in range(2):
                step()
            torch.cuda.synchronize()
            yield side


def restart(step):
    """Start a varying step's input sequence again (see `Varying`); nothing for the others."""
    getattr(step, "reset", lambda: None)()


def profile_sides(torch, ext, step, n):
    """`n` steps per side under torch.profiler (sides alternating twice, default first, then
    stitch-alloc first): per side the GPU kernels' summed time and count per step, and per
    kernel name its time per step. The profiler slows the CPU's side, not the kernels."""
    from torch.profiler import ProfilerActivity, profile

    per = {"default": {}, "stitch": {}}
    total = {"default": [], "stitch": []}
    count = {"default": [], "stitch": []}
    for side in warm_sides(torch, ext, step):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                step()
            torch.cuda.synchronize()
        kern = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        total[side].append(sum(e.time_range.elapsed_us() for e in kern) / n)
        count[side].append(len(kern) / n)
        for e in kern:
            per[side][e.name] = per[side].get(e.name, 0.0) + e.time_range.elapsed_us() / (2 * n)
    ext._set_delegate(False)
    names = set(per["default"]) | set(per["stitch"])
    diff = sorted(names, key=lambda k: -abs(per["stitch"].get(k, 0) - per["default"].get(k, 0)))
    return {"kernel_us_per_step": total, "kernels_per_step": count,
            "largest_differences_us": [[k[:90], per["default"].get(k, 0), per["stitch"].get(k, 0)]
                                       for k in diff[:8]]}


def clock_sides(torch, ext, stitch_alloc, step, n):
    """`n` steps per side (sides alternating twice) with the extension's diagnostic clock on:
    per side and step, the microseconds inside allocate and inside the frees (the
    extension's layer included), the calls, and on stitch-alloc's side the C ABI's own
    malloc + free time (its sampled clock) for the same steps."""
    out = {"default": [], "stitch": []}
    for side in warm_sides(torch, ext, step):
        c0, k0 = ext._alloc_clock(), counters(stitch_alloc)
        ext._set_alloc_clock(True)
        for _ in range(n):
            step()
        ext._set_alloc_clock(False)
        torch.cuda.synchronize()
        c1, k1 = ext._alloc_clock(), counters(stitch_alloc)
        pre = "stitch" if side == "stitch" else "native"
        d = {f: [(c1[f"{pre}_{f}"][i] - c0[f"{pre}_{f}"][i]) / n for i in (0, 1)]
             for f in ("alloc", "free")}
        out[side].append({"alloc_calls": d["alloc"][0], "alloc_us": d["alloc"][1] / 1e3,
                          "free_calls": d["free"][0], "free_us": d["free"][1] / 1e3,
                          "c_abi_us": (k1["api_us"] - k0["api_us"]) / n})
    ext._set_delegate(False)
    return out


def interval(ratios, resamples=4000, seed=0):
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    return meds[int(0.025 * resamples)], meds[int(0.975 * resamples) - 1]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lib", required=True, help="libstitch_alloc.so")
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help=f"comma-separated; also {', '.join(VARIANTS)}")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=8, help="timed steps per side and round")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after the rounds, N steps per side under torch.profiler: the summed "
                        "time of the GPU kernels per step, and the kernels whose time differs "
                        "most between the two sides (is a gap in the GPU's work or the CPU's?)")
    p.add_argument("--alloc-clock", type=int, default=0, metavar="N",
                   help="after the rounds, N steps per side (twice, alternating) with the "
                        "extension's diagnostic clock on: the time spent inside each "
                        "allocator's allocate and free per step, inside the real step")
    p.add_argument("--record", default=None, metavar="DIR",
                   help="instead: PyTorch's default allocator alone, with its memory history "
                        "on, `--rounds` x (2 + `--steps`) steps of each workload (a varying "
                        "step's sequence started again each round, as each side's is), each "
                        "dumped to DIR/<workload>.pickle for `stitch replay`")
    p.add_argument("--conf", default=None,
                   help="stitch-alloc's configuration (STITCH_ALLOC_CONF syntax), e.g. "
                        "prealloc:2400MiB")
    a = p.parse_args()
    if a.record:
        return record(a)
    os.environ.setdefault("STITCH_ALLOC_CONF", "backend:cuda,log:error")
    sys.path.insert(0, os.path.join(HERE, "..", "python"))
    import stitch_alloc

    ext = stitch_alloc.enable(path=os.path.abspath(a.lib), conf=a.conf, extension=True)
    import torch

    zoo = zoo_module()
    torch.manual_seed(0)
    results = {}
    for name in a.workloads.split(","):
        step = {**WORKLOADS, **VARIANTS}[name](torch, zoo)
        for _ in range(2):  # the model's first steps (lazy state, cuBLAS handles) on stitch-alloc
            step()
        torch.cuda.synchronize()
        rounds = []
        for r in range(a.rounds):
            got = {}
            for side in (("default", "stitch") if r % 2 == 0 else ("stitch", "default")):
                ext._set_delegate(side == "default")
                restart(step)
                times, gpu, submit = [], [], []
                for i in range(2 + a.steps):
                    if i == 2:
                        before = counters(stitch_alloc)
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    t0 = time.perf_counter()
                    e0.record()
                    step()
                    t1 = time.perf_counter()
                    e1.record()
                    torch.cuda.synchronize()
                    if i >= 2:
                        times.append(time.perf_counter() - t0)
                        gpu.append(e0.elapsed_time(e1) / 1e3)
                        submit.append(t1 - t0)
                after = counters(stitch_alloc)
                got[side] = statistics.median(times)
                got[side + "_gpu"] = statistics.median(gpu)
                got[side + "_submit"] = statistics.median(submit)
                got[side + "_stats"] = {k: (after[k] - before[k]) / a.steps for k in after}
            ext._set_delegate(False)
            rounds.append(got)
            print(f"{name} round {r + 1}: default {got['default'] * 1e3:.2f} ms, "
                  f"stitch-alloc {got['stitch'] * 1e3:.2f} ms per step", flush=True)
        speed = [x["default"] / x["stitch"] for x in rounds]
        lo, hi = interval(speed)
        results[name] = {"rounds": rounds, "speed_median": statistics.median(speed),
                         "speed_interval_95": [lo, hi],
                         "default_median_ms": 1e3 * statistics.median(x["default"] for x in rounds),
                         "stitch_median_ms": 1e3 * statistics.median(x["stitch"] for x in rounds),
                         "gpu_median_ms": {k: 1e3 * statistics.median(x[k + "_gpu"] for x in rounds)
                                           for k in ("default", "stitch")},
                         "submit_median_ms": {k: 1e3 * statistics.median(x[k + "_submit"] for x in rounds)
                                              for k in ("default", "stitch")},
                         "submit_ratio_median": statistics.median(
                             x["default_submit"] / x["stitch_submit"] for x in rounds),
                         "stitch_side_per_step": {
                             k: statistics.median(x["stitch_stats"][k] for x in rounds)
                             for k in rounds[0]["stitch_stats"]},
                         "default_side_per_step": {
                             k: statistics.median(x["default_stats"][k] for x in rounds)
                             for k in rounds[0]["default_stats"]}}
        if a.profile:
            results[name]["profile"] = profile_sides(torch, ext, step, a.profile)
        if a.alloc_clock:
            results[name]["alloc_clock"] = clock_sides(torch, ext, stitch_alloc, step, a.alloc_clock)
        del step
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    meta = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "rounds": a.rounds, "steps": a.steps, "conf": a.conf}
    print("RESULT " + json.dumps({"meta": meta, "workloads": results}))
    print("\n| workload | default, median step | stitch-alloc, median step | speed vs default, "
          "median of rounds | 95% interval |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        lo, hi = r["speed_interval_95"]
        print(f"| {name} | {r['default_median_ms']:.2f} ms | {r['stitch_median_ms']:.2f} ms | "
              f"{r['speed_median']:.4f} | {lo:.4f}-{hi:.4f} |")
    print("\n| workload | GPU time per step (CUDA events), default / stitch-alloc | stitch-alloc's "
          "counters per step on its side (driver us, malloc+free us, event waits, slow allocs, "
          "repeated stitches) "
          "| the same on the default's side |")
    print("|---|---|---|---|")
    for name, r in results.items():
        g, st, df = r["gpu_median_ms"], r["stitch_side_per_step"], r["default_side_per_step"]
        cells = lambda c: ", ".join(f"{c[k]:.1f}" for k in ("driver_us", "api_us", "event_waits",
                                                             "slow_allocs", "repeated_stitches"))
        print(f"| {name} | {g['default']:.2f} / {g['stitch']:.2f} ms | {cells(st)} | {cells(df)} |")
    print("\n| workload | CPU time to submit a step (until it returns, before the "
          "synchronisation), default / stitch-alloc | default / stitch-alloc, median of rounds |")
    print("|---|---|---|")
    for name, r in results.items():
        sm = r["submit_median_ms"]
        print(f"| {name} | {sm['default']:.2f} / {sm['stitch']:.2f} ms | {r['submit_ratio_median']:.4f} |")
    if any("alloc_clock" in r for r in results.values()):
        print("\n| workload | side | allocations per step | us in allocate per step | frees per "
              "step | us in free per step | allocate + free, us per pair | C ABI's own malloc + "
              "free us per step |")
        print("|---|---|---|---|---|---|---|---|")
        for name, r in results.items():
            for side, runs in r.get("alloc_clock", {}).items():
                for x in runs:
                    pair = (x["alloc_us"] + x["free_us"]) / max(x["alloc_calls"], 1)
                    print(f"| {name} | {side} | {x['alloc_calls']:.0f} | {x['alloc_us']:.1f} | "
                          f"{x['free_calls']:.0f} | {x['free_us']:.1f} | {pair * 1e3:.0f} ns | "
                          f"{x['c_abi_us']:.1f} |")
    for name, r in results.items():
        if "profile" in r:
            pr = r["profile"]
            print(f"\n{name} under the profiler: GPU kernels per step, summed time (us) default "
                  f"{pr['kernel_us_per_step']['default']} stitch-alloc "
                  f"{pr['kernel_us_per_step']['stitch']}; kernels per step default "
                  f"{pr['kernels_per_step']['default']} stitch-alloc "
                  f"{pr['kernels_per_step']['stitch']}")
            for k, d, s_ in pr["largest_differences_us"]:
                print(f"    {d:10.1f} {s_:10.1f} us  {k}")


if __name__ == "__main__":
    main()
