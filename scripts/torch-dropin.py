#!/usr/bin/env python3
"""Is stitch-alloc a drop-in for torch's allocator? (issue #12)

Each case runs in a FRESH Python process (the allocator is chosen before the process's
first CUDA allocation), once under torch's default allocator and once under stitch-alloc
(``stitch_alloc.enable()``: the C++ extension where it builds, else the
CUDAPluggableAllocator fallback, whose use is printed). One line per case:

    case | default result | stitch result | PASS/FAIL

PASS: the case's check holds under stitch-alloc (and, for reference, the default's own
result is shown; a case that fails under the default too is marked so). One case failing,
crashing or timing out does not stop the others. Run on the GPU machine from the
repository root::

    bash scripts/gpu-session.sh dropin            # finds .gpu/libstitch_alloc.so
    python3 scripts/torch-dropin.py --lib target/release/libstitch_alloc.so --out r.json
    python3 scripts/torch-dropin.py --list        # the cases; needs no torch
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torchcases import mode_of, prebuild_extension  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
PYDIR = os.path.join(REPO, "python")

# Each case: a body run after the preamble, with `STITCH` (bool), `torch`, `json` and
# `result(ok, detail, **extra)` defined; it must call result() once.
CASES = {
    "memory_stats": """
        MIB = 1 << 20
        x = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")
        a = torch.cuda.memory_allocated()
        m = torch.cuda.max_memory_allocated()
        r = torch.cuda.memory_reserved()
        mr = torch.cuda.max_memory_reserved()
        del x
        torch.cuda.reset_peak_memory_stats()
        p = torch.cuda.max_memory_allocated()
        st = torch.cuda.memory_stats()
        s = torch.cuda.memory_summary()
        keys = ["allocated_bytes.all.current", "reserved_bytes.all.peak", "active_bytes.all.current",
                "requested_bytes.all.current", "allocation.all.allocated", "num_ooms",
                "num_alloc_retries", "inactive_split_bytes.all.current", "segment.all.current"]
        missing = [k for k in keys if k not in st]
        ok = (a >= 64 * MIB and m >= a and r >= a and mr >= r and p < 64 * MIB
              and not missing and len(s) > 200)
        result(ok, f"allocated {a >> 20} MiB, peak after reset {p >> 20} MiB, reserved {r >> 20} MiB"
               + (f", missing {missing}" if missing else ""))
    """,
    "oom_then_continue": """
        total = torch.cuda.get_device_properties(0).total_memory
        seen = []
        torch._C._cuda_attach_out_of_memory_observer(lambda *a: seen.append(a))
        msg = None
        try:
            t = torch.empty(2 * total, dtype=torch.uint8, device="cuda")
            msg = "no error; data_ptr %d" % t.data_ptr()
            raised = False
        except torch.cuda.OutOfMemoryError as e:
            raised, msg = True, str(e)
        except Exception as e:  # noqa: BLE001
            raised, msg = False, f"{type(e).__name__}: {e}"
        y = (torch.ones(1 << 20, device="cuda") * 2).sum().item()
        ok = raised and y == float(2 << 20)
        result(ok, f"OutOfMemoryError={raised}, observers called {len(seen)}, kernel after: {y == float(2 << 20)}; "
               + msg.replace(chr(10), " ")[:160])
    """,
    "cudnn_benchmark_conv": """
        torch.backends.cudnn.benchmark = True
        conv = torch.nn.Conv2d(3, 64, 7, stride=2, padding=3).cuda()
        x = torch.randn(16, 3, 224, 224, device="cuda", requires_grad=True)
        for _ in range(3):
            y = conv(x)
            y.float().sum().backward()
        torch.cuda.synchronize()
        ok = bool(torch.isfinite(y).all().item()) and x.grad is not None
        result(ok, f"output {tuple(y.shape)}")
    """,
    "compile_reduce_overhead": """
        def f(x, w):
            return torch.nn.functional.gelu(x @ w).sin() * 2 + 1
        g = torch.compile(f, mode="reduce-overhead")
        x = torch.randn(256, 512, device="cuda")
        w = torch.randn(512, 512, device="cuda")
        outs = [g(x, w).clone() for _ in range(6)]
        torch.cuda.synchronize()
        ref = f(x, w)
        ok = all(torch.allclose(o, ref, atol=1e-3, rtol=1e-3) for o in outs)
        result(ok, f"6 calls, match eager: {ok}")
    """,
    "memory_history": """
        torch.cuda.memory._record_memory_history(max_entries=10000)
        xs = [torch.empty(n << 20, dtype=torch.uint8, device="cuda") for n in (1, 4, 16)]
        del xs[1]
        snap = torch.cuda.memory._snapshot()
        path = os.path.join(tempfile.mkdtemp(), "snap.pickle")
        torch.cuda.memory._dump_snapshot(path)
        torch.cuda.memory._record_memory_history(enabled=None)
        traces = snap.get("device_traces", [[]])
        actions = sorted({e["action"] for t in traces for e in t})
        frames = any(e.get("frames") for t in traces for e in t)
        ok = (len(snap["segments"]) > 0 and "alloc" in actions and "free_requested" in actions
              and os.path.getsize(path) > 0)
        result(ok, f"segments {len(snap['segments'])}, actions {actions}, stacks {frames}, "
               f"dump {os.path.getsize(path)} B")
    """,
    "ipc_share": """
        # Two processes (scripts/torch-ipc.py: a spawned child under the same allocator).
        import subprocess
        env = dict(os.environ)
        env.pop("STITCH_IPC_LIB", None)
        if STITCH:
            env["STITCH_IPC_LIB"] = stitch_alloc.find_library({lib!r})
        r = subprocess.run([sys.executable, os.path.join({here!r}, "torch-ipc.py")],
                           capture_output=True, text=True, timeout=300, env=env)
        res = next((json.loads(l[7:]) for l in r.stdout.splitlines() if l.startswith("RESULT ")),
                   None)
        if res is None:
            result(False, "exit %d: %s" % (r.returncode, (r.stderr or r.stdout)[-300:]))
        else:
            c = res.get("child", {{}})
            result(res["ok"], f"child [{{c.get('mode')}}] read the sum and view: "
                   f"{{'error' not in c}}, parent saw the child's writes: "
                   f"{{res.get('child_writes_seen')}}" + (f"; {{res.get('error') or c.get('error')}}"
                   if not res["ok"] else ""))
    """,
    "graph_pool_no_corruption": """
        x = torch.randn(1 << 20, device="cuda")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            t = x * 2
            y = t.sin()
            del t
        with torch.cuda.stream(s):
            outs = [torch.zeros_like(x) for _ in range(8)]
            g.replay()
        torch.cuda.synchronize()
        dirty = sum(int(o.abs().sum().item() != 0) for o in outs)
        right = bool(torch.allclose(y, (x * 2).sin()))
        del g, y
        torch.cuda.empty_cache()
        z = torch.ones(1 << 20, device="cuda").sum().item()
        ok = dirty == 0 and right and z == float(1 << 20)
        result(ok, f"{dirty} of 8 changed by the replay, graph output right: {right}")
    """,
    "empty_cache": """
        x = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        del x
        r1 = torch.cuda.memory_reserved()
        dev = torch.cuda.current_device()
        torch.cuda.empty_cache()
        r2 = torch.cuda.memory_reserved()
        ok = r2 < r1 and torch.cuda.current_device() == dev
        result(ok, f"reserved {r1 >> 20} -> {r2 >> 20} MiB")
    """,
    "fraction_after_first_alloc": """
        x = torch.ones(1 << 20, device="cuda")
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(0.1)
        try:
            y = torch.empty(int(total * 0.2), dtype=torch.uint8, device="cuda")
            raised = False
        except torch.cuda.OutOfMemoryError:
            raised = True
        z = torch.empty(int(total * 0.05), dtype=torch.uint8, device="cuda")
        ok = raised and x.sum().item() == float(1 << 20)
        result(ok, f"0.2 of the device refused with OutOfMemoryError: {raised}; 0.05 allocated")
    """,
}

PREAMBLE = """
import json, os, sys, tempfile, time
STITCH = {stitch}
_t0 = time.time()
def result(ok, detail, **extra):
    print("RESULT " + json.dumps(dict(ok=bool(ok), detail=str(detail), seconds=time.time() - _t0, **extra)), flush=True)
mode = "default"
if STITCH:
    sys.path.insert(0, {pydir!r})
    import stitch_alloc
    stitch_alloc.enable(path={lib!r})
    mode = stitch_alloc.mode()
import torch
print("MODE " + str(mode), flush=True)
"""


def run_case(name, stitch, lib, timeout):
    body = textwrap.dedent(CASES[name])
    if name == "ipc_share":
        body = body.format(lib=lib, here=HERE)
    code = PREAMBLE.format(stitch=stitch, pydir=PYDIR, lib=lib) + body
    env = dict(os.environ)
    t0 = time.time()
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return {"ok": False, "detail": f"timed out after {timeout} s", "mode": mode_of(out),
                "seconds": time.time() - t0}
    res = None
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            res = json.loads(line[len("RESULT "):])
    if res is None:
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        res = {"ok": False, "detail": f"exit {r.returncode}: " + " | ".join(tail)[:300]}
    res["mode"] = mode_of(r.stdout)
    res["exit"] = r.returncode
    res["stderr_tail"] = r.stderr[-2000:]
    return res


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lib", default=None, help="libstitch_alloc.so (default: stitch_alloc.find_library)")
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated cases")
    p.add_argument("--timeout", type=int, default=240, help="seconds per case and allocator")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--stitch-only", action="store_true", help="skip the default allocator's runs")
    p.add_argument("--list", action="store_true", help="print the cases and exit")
    a = p.parse_args()
    if a.list:
        print("\n".join(CASES))
        return 0
    sys.path.insert(0, PYDIR)
    import stitch_alloc  # noqa: PLC0415

    lib = stitch_alloc.find_library(a.lib)
    # Build the extension once first, so that no case's timeout includes the build.
    built, build_log = prebuild_extension(PYDIR, max(a.timeout, 420))
    rows = []
    cases = [c for c in a.cases.split(",") if c]
    w = max(len(c) for c in cases)
    print(f"{'case':<{w}} | {'default':<40} | {'stitch-alloc':<60} | verdict", flush=True)
    for name in cases:
        if name not in CASES:
            print(f"{name:<{w}} | unknown case", flush=True)
            continue
        d = None if a.stitch_only else run_case(name, False, lib, a.timeout)
        s = run_case(name, True, lib, a.timeout)
        verdict = "PASS" if s["ok"] else "FAIL"
        if d is not None and not d["ok"]:
            verdict += " (default fails too)"
        ds = "-" if d is None else ("ok" if d["ok"] else "NOT OK") + ": " + d["detail"]
        ss = ("ok" if s["ok"] else "NOT OK") + f" [{s.get('mode')}]: " + s["detail"]
        print(f"{name:<{w}} | {ds[:40]:<40} | {ss[:160]:<60} | {verdict}", flush=True)
        rows.append({"case": name, "default": d, "stitch": s, "verdict": verdict})
    passed = sum(r["verdict"].startswith("PASS") for r in rows)
    print(f"{passed} of {len(rows)} cases pass under stitch-alloc", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"lib": lib, "extension_built": built, "build_log": build_log,
                       "rows": rows}, f, indent=1)
    return 0 if passed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
