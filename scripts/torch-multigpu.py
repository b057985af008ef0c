#!/usr/bin/env python3
"""The 2-GPU run of issue #14 (needs a host with at least 2 GPUs; NOT yet run: the device
tool's 2-GPU kind has not been lent).

    python3 scripts/torch-multigpu.py            # all parts, prints JSON lines, exit 0 on PASS
    compute-sanitizer --tool memcheck python3 scripts/torch-multigpu.py --part copies

Parts, each in fresh processes:
  ddp     DDP training of a small Llama (transformers, from a config, random weights) on 2
          ranks (NCCL), under PyTorch default, expandable segments and stitch-alloc in turn:
          loss curve per allocator (must match default's within tolerance), peak reserved /
          peak requested per rank, steps/s.
  copies  cross-device copies (contiguous and not, dtype changes) and a kernel on GPU 1
          reading a tensor of GPU 0 (peer access through stitch-alloc's mappings): bytes
          compared with the CPU.
  empty   torch.cuda.empty_cache() while the other device is current: the current device is
          unchanged and both devices keep working (PyTorch issue #196258).
"""
import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PYDIR = os.path.join(HERE, "..", "python")


def child_env(alloc):
    env = dict(os.environ)
    env["PYTHONPATH"] = PYDIR + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if alloc == "expandable":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    env["SOAK_ALLOC"] = alloc
    return env


def setup(alloc):
    if alloc == "stitch":
        import stitch_alloc

        stitch_alloc.enable()
    import torch

    return torch


def ddp_rank(rank, world, alloc, steps, q):
    torch = setup(alloc)
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    # A port per allocator: the three runs follow each other closely.
    os.environ.setdefault("MASTER_PORT", str(29533 + ["default", "expandable", "stitch"].index(alloc)))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=512, intermediate_size=1408, num_hidden_layers=6,
                      num_attention_heads=8, num_key_value_heads=8, vocab_size=8192)
    model = LlamaForCausalLM(cfg).cuda()
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank])
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    g = torch.Generator(device="cpu").manual_seed(1 + rank)
    losses, requested_peak = [], 0
    torch.cuda.synchronize()
    import time

    t0 = time.time()
    for step in range(steps):
        bs, seq = [(4, 256), (2, 512), (8, 128)][step % 3]
        ids = torch.randint(0, cfg.vocab_size, (bs, seq), generator=g).cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = ddp(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # the sum over ranks
        losses.append(float(mean) / world)
    torch.cuda.synchronize()
    el = time.time() - t0
    st = torch.cuda.memory_stats(rank)
    q.put(dict(rank=rank, alloc=alloc, losses=losses, steps_per_s=steps / el,
               peak_reserved=st.get("reserved_bytes.all.peak"),
               peak_requested=st.get("requested_bytes.all.peak")))
    dist.destroy_process_group()


def part_ddp(alloc, steps):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=ddp_rank, args=(r, 2, alloc, steps, q)) for r in range(2)]
    for p in ps:
        p.start()
    out = [q.get(timeout=600) for _ in ps]
    for p in ps:
        p.join()
    return sorted(out, key=lambda r: r["rank"])


def part_copies(alloc):
    torch = setup(alloc)
    ok = True
    for n in [1 << 10, 3 << 20, 37 << 20]:
        a = torch.arange(n, dtype=torch.float32, device="cuda:0")
        b = a.to("cuda:1")
        ok &= bool(torch.equal(b.cpu(), a.cpu()))
        nc = a.view(-1, 4)[:, 1:3].to("cuda:1")  # non-contiguous
        ok &= bool(torch.equal(nc.cpu(), a.cpu().view(-1, 4)[:, 1:3]))
        h = a.to("cuda:1", dtype=torch.float16)
        ok &= bool(torch.equal(h.cpu(), a.cpu().to(torch.float16)))
        with torch.cuda.device(1):
            c = torch.empty(n, device="cuda:1")
            c.copy_(a, non_blocking=True)  # GPU 1 reads GPU 0's memory (peer)
            torch.cuda.synchronize(1)
        ok &= bool(torch.equal(c.cpu(), a.cpu()))
    return dict(part="copies", alloc=alloc, ok=ok)


def part_empty(alloc):
    torch = setup(alloc)
    x0 = torch.ones(1 << 20, device="cuda:0")
    x1 = torch.ones(1 << 20, device="cuda:1")
    torch.cuda.set_device(1)
    del x0
    torch.cuda.empty_cache()
    same = torch.cuda.current_device() == 1
    y = torch.ones(1 << 20, device="cuda:0") + 1
    z = x1 * 2
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    ok = same and float(y.sum()) == 2 * (1 << 20) and float(z.sum()) == 2 * (1 << 20)
    return dict(part="empty", alloc=alloc, current_device_kept=same, ok=ok)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", choices=["ddp", "copies", "empty", "all"], default="all")
    ap.add_argument("--alloc", default=None, help="run one part in this process (internal)")
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    if args.alloc:
        fn = {"ddp": lambda: part_ddp(args.alloc, args.steps),
              "copies": lambda: part_copies(args.alloc),
              "empty": lambda: part_empty(args.alloc)}[args.part]
        print("RESULT " + json.dumps(fn()))
        return
    parts = ["copies", "empty", "ddp"] if args.part == "all" else [args.part]
    allocs = ["default", "expandable", "stitch"]
    ok = True
    results = {}
    for part in parts:
        for alloc in allocs:
            p = subprocess.run([sys.executable, __file__, "--part", part, "--alloc", alloc,
                                "--steps", str(args.steps)], env=child_env(alloc),
                               capture_output=True, text=True, timeout=900)
            line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            r = json.loads(line[-1][7:]) if line else dict(error=p.stderr[-2000:])
            results[(part, alloc)] = r
            print(json.dumps(dict(part=part, alloc=alloc, rc=p.returncode, result=r)))
            if part != "ddp":
                ok &= p.returncode == 0 and bool(r.get("ok"))
    if "ddp" in parts:
        base = results.get(("ddp", "default"))
        for alloc in allocs[1:]:
            r = results.get(("ddp", alloc))
            if not isinstance(base, list) or not isinstance(r, list):
                ok = False
                continue
            diff = max(abs(a - b) for a, b in zip(base[0]["losses"], r[0]["losses"]))
            print(json.dumps(dict(part="ddp", alloc=alloc, max_loss_diff_vs_default=diff,
                                  ratio_rank0=r[0]["peak_reserved"] / r[0]["peak_requested"])))
            ok &= diff < 0.05
    print("RESULT", "PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
