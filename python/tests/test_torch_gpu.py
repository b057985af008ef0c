"""stitch-alloc as PyTorch's CUDA allocator (needs torch and a CUDA device; skips otherwise).

Each test runs its torch code in a fresh Python process: the allocator must be installed
before the process's first CUDA allocation, and STITCH_ALLOC_CONF is read once.
"""
import json
import subprocess
import sys
import textwrap

import pytest

from conftest import subprocess_env

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

MIB = 1 << 20


def run_torch(libpath, body, conf="backend:cuda,log:warn", timeout=300, ext=None):
    """Run `body` after stitch_alloc.enable() in a child; return the dict it printed as
    `RESULT {...}`. `ext`: None (the extension where it builds), True (the C++ extension,
    required), False (the CUDAPluggableAllocator fallback)."""
    code = "import json, torch, stitch_alloc\nstitch_alloc.enable()\n" + textwrap.dedent(body)
    env = subprocess_env(libpath, conf)
    if ext is not None:
        env["STITCH_ALLOC_TORCH_EXT"] = "1" if ext else "0"
    r = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    print(r.stdout)
    print(r.stderr, file=sys.stderr)
    assert r.returncode == 0, f"child failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    lines = [l for l in r.stdout.splitlines() if l.startswith("RESULT ")]
    assert lines, r.stdout
    return json.loads(lines[-1][len("RESULT ") :])


def test_matmul_and_memory_stats(libpath):
    res = run_torch(
        libpath,
        """
        torch.manual_seed(0)
        a = torch.randn(2048, 2048, device="cuda")
        b = torch.randn(2048, 2048, device="cuda")
        c = a @ b
        ref = a.cpu().double() @ b.cpu().double()
        err = ((c.cpu().double() - ref).abs().max() / ref.abs().max()).item()
        h = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        h2 = (h @ h).float().sum().item()
        m = stitch_alloc.memory_stats(0)
        print(stitch_alloc.memory_summary(0))
        print("RESULT", json.dumps({"err": err, "bf16_finite": h2 == h2, "stats": m,
              "enabled": stitch_alloc.is_enabled(),
              "backend": torch.cuda.get_allocator_backend()}))
        """,
    )
    assert res["enabled"]
    assert res["err"] < 1e-2, res["err"]
    assert res["bf16_finite"]
    m = res["stats"]
    assert m["allocated_bytes.all.current"] >= 3 * 2048 * 2048 * 4
    assert m["reserved_bytes.all.current"] >= m["allocated_bytes.all.current"]
    assert m["allocated_bytes.all.peak"] >= m["allocated_bytes.all.current"]
    assert m["num_ooms"] == 0
    assert m["driver_calls"] > 0


def test_many_allocations_free_and_empty_cache(libpath):
    res = run_torch(
        libpath,
        """
        ts = [torch.empty(int(s), dtype=torch.uint8, device="cuda")
              for s in [512, 4096, 1 << 20, 3 << 20, 100 << 20, 7, 50 << 20] * 20]
        for t in ts:
            t.fill_(1)
        torch.cuda.synchronize()
        peak_live = stitch_alloc.memory_stats(0)["allocated_bytes.all.current"]
        del ts[::2]
        big = torch.ones(1 << 30, dtype=torch.uint8, device="cuda")
        ok = big.sum().item() == (1 << 30)
        del big, ts
        torch.cuda.synchronize()
        before = stitch_alloc.memory_stats(0)
        torch.cuda.empty_cache()            # the reset hook
        after = stitch_alloc.memory_stats(0)
        print("RESULT", json.dumps({"ok": ok, "peak_live": peak_live,
              "before": before, "after": after}))
        """,
    )
    assert res["ok"]
    # Everything the test made is freed (torch itself may hold a little).
    assert res["after"]["allocated_bytes.all.current"] < 64 * MIB
    assert res["after"]["allocated_bytes.all.current"] == res["before"]["allocated_bytes.all.current"]
    assert res["before"]["reserved_bytes.all.current"] > 0
    assert res["after"]["reserved_bytes.all.current"] < res["before"]["reserved_bytes.all.current"]
    assert res["after"]["num_ooms"] == 0


def test_streams_and_record_stream(libpath):
    res = run_torch(
        libpath,
        """
        s = torch.cuda.Stream()
        x = torch.randn(8 << 20, device="cuda")
        with torch.cuda.stream(s):
            y = x * 2
            z = torch.empty_like(y)
            z.copy_(y)
        x.record_stream(s)
        del x
        s.synchronize()
        total = z.sum().item()
        w = torch.randn(1 << 20, device="cuda")
        del y, z, w
        torch.cuda.synchronize()
        print("RESULT", json.dumps({"finite": total == total,
              "stats": stitch_alloc.memory_stats(0),
              "last_error": stitch_alloc.last_error()}))
        """,
    )
    assert res["finite"]
    assert res["stats"]["allocated_bytes.all.current"] < 64 * MIB
    assert res["last_error"] == "", res["last_error"]


def test_memory_fraction_hook(libpath):
    res = run_torch(
        libpath,
        """
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(0.25, 0)
        x = torch.ones(1 << 20, device="cuda")
        print("RESULT", json.dumps({"total": total,
              "capacity": stitch_alloc.memory_stats(0)["capacity"]}))
        """,
    )
    assert res["capacity"] <= res["total"] * 0.25 + (2 << 20)
    assert res["capacity"] >= res["total"] * 0.25 - (4 << 20)


def test_out_of_memory_behaviour(libpath):
    """Records what torch does with a NULL from the allocator. 2.11's
    CUDAPluggableAllocator::allocate does not check it: torch.empty should succeed and the
    first use (data_ptr()) raise RuntimeError "... data is not allocated yet". An
    OutOfMemoryError at torch.empty is accepted too (a later torch may check); the outcome
    is printed for the record."""
    res = run_torch(
        libpath,
        """
        total = torch.cuda.get_device_properties(0).total_memory
        outcome = None
        try:
            t = torch.empty(2 * total, dtype=torch.uint8, device="cuda")
            outcome = "empty() succeeded; "
            try:
                outcome += "data_ptr() = %d" % t.data_ptr()
            except Exception as e:  # noqa: BLE001
                outcome += "data_ptr() raised " + type(e).__name__ + ": " + str(e)[:120]
            del t
        except Exception as e:  # noqa: BLE001
            outcome = "empty() raised " + type(e).__name__ + ": " + str(e)[:200]
        err = stitch_alloc.last_error()
        x = torch.ones(1 << 20, device="cuda")   # the allocator still works
        print("RESULT", json.dumps({"outcome": outcome, "last_error": err,
              "after": x.sum().item(), "stats": stitch_alloc.memory_stats(0)}))
        """,
        ext=False,
    )
    print("torch with a NULL from the allocator:", res["outcome"])
    assert "raised" in res["outcome"] or res["outcome"].endswith("data_ptr() = 0")
    assert "too large" in res["last_error"] or "out of memory" in res["last_error"]
    assert res["after"] == float(1 << 20)


def test_bad_configuration_raises_in_enable(libpath):
    code = (
        "import stitch_alloc\n"
        "try:\n    stitch_alloc.enable(conf='backend:cuda,bogus:1')\n"
        "except ValueError as e:\n    print('VALUE-ERROR', e)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        env=subprocess_env(libpath, None),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "VALUE-ERROR" in r.stdout and "bogus" in r.stdout, r.stdout + r.stderr


def test_tiny_llama_generate_and_train(libpath):
    """A small Llama from a config (random init): greedy generate with a KV cache, then two
    AdamW steps under bf16 autocast, with stitch-alloc as torch's allocator."""
    pytest.importorskip("transformers")
    res = run_torch(
        libpath,
        """
        from transformers import LlamaConfig, LlamaForCausalLM
        cfg = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                          max_position_embeddings=512, pad_token_id=0, eos_token_id=None)
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = LlamaForCausalLM(cfg)
        model.generation_config.eos_token_id = None
        model = model.to(torch.bfloat16).eval()
        ids = torch.randint(3, 1000, (4, 37), device="cuda")
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=20, do_sample=False)
        model = model.float().train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for seq in (64, 200):
            x = torch.randint(3, 1000, (3, seq), device="cuda")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=x, labels=x).loss
            loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        m = stitch_alloc.memory_stats(0)
        print("RESULT", json.dumps({"shape": list(out.shape), "losses": losses, "stats": m}))
        """,
    )
    assert res["shape"] == [4, 57]
    assert all(l == l and l > 0 for l in res["losses"]), res["losses"]
    assert res["stats"]["num_ooms"] == 0
    assert res["stats"]["allocation.all.allocated"] > 100


def test_graph_capture_fails_loudly_and_corrupts_nothing(libpath):
    """Issue #12: without private graph pools, a temporary freed during capture went back to
    the general pool and a replay wrote into tensors allocated after the capture (1 of 8
    under stitch-alloc, 0 of 8 under torch's default). Capture must now fail at its start,
    leave the current stream alone, and the allocator must keep working."""
    res = run_torch(
        libpath,
        """
        x = torch.randn(1 << 20, device="cuda")
        s = torch.cuda.Stream()
        before = torch.cuda.current_stream()
        errs = []
        try:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=s):
                t = x * 2
                y = t.sin()
                del t
        except stitch_alloc.GraphCaptureUnsupported as e:
            errs.append(str(e))
        try:
            torch.cuda.CUDAGraph().capture_begin()
        except RuntimeError as e:
            errs.append(str(e))
        same_stream = torch.cuda.current_stream() == before
        with torch.cuda.stream(s):
            outs = [torch.zeros_like(x) for _ in range(8)]
        torch.cuda.synchronize()
        dirty = sum(int(o.abs().sum().item() != 0) for o in outs)
        ok = bool(torch.equal((x * 3).cpu(), x.cpu() * 3))
        print("RESULT", json.dumps({"errs": errs, "same_stream": same_stream,
              "dirty": dirty, "ok": ok}))
        """,
        ext=False,
    )
    assert len(res["errs"]) == 2, res
    assert all("CUDA graph capture is not supported" in e for e in res["errs"]), res
    assert res["same_stream"]
    assert res["dirty"] == 0
    assert res["ok"]


def test_capture_on_raw_stream_refused_by_library(libpath):
    """A capture started below torch's Python API (the base class's capture_begin, as C++
    code or another library would) is caught by the library: no memory is handed out on a
    capturing stream (torch 2.11 does not check the NULL, so the op itself may not raise; the
    graph is never replayed here), the reason names graph capture, and the allocator works
    afterwards."""
    res = run_torch(
        libpath,
        """
        x = torch.randn(1 << 20, device="cuda")
        s = torch.cuda.Stream()
        g = torch.cuda.CUDAGraph()
        raised = None
        with torch.cuda.stream(s):
            torch._C._CUDAGraph.capture_begin(g, None, "global")
            n0 = stitch_alloc.memory_stats(0)["requested_bytes.all.current"]
            try:
                t = x * 2
            except RuntimeError as e:
                raised = str(e)
            err = stitch_alloc.last_error()
            n1 = stitch_alloc.memory_stats(0)["requested_bytes.all.current"]
            try:
                torch._C._CUDAGraph.capture_end(g)
            except RuntimeError:
                pass
        torch.cuda.synchronize()
        z = torch.ones(1 << 20, device="cuda").sum().item()
        print("RESULT", json.dumps({"raised": raised, "err": err, "z": z, "n0": n0, "n1": n1}))
        """,
        ext=False,
    )
    # The 4 MiB result of `x * 2` got no memory while the stream was capturing.
    assert res["n1"] == res["n0"], res
    assert "graph" in res["err"].lower(), res
    assert res["z"] == float(1 << 20)

def test_empty_cache_keeps_the_current_device(libpath):
    """Issue #13, item 1: the reset hook walks every device; it used to leave the thread on
    the last device's context, so ``current_device()`` changed under the caller."""
    res = run_torch(
        libpath,
        """
        n = torch.cuda.device_count()
        xs = [torch.ones(1 << 20, device=f"cuda:{d}") for d in range(n)]
        seen = []
        for d in range(n):
            torch.cuda.set_device(d)
            y = torch.ones(1 << 20, device="cuda")
            del y
            torch.cuda.empty_cache()
            seen.append(torch.cuda.current_device())
        torch.cuda.set_device(0)
        torch.cuda.empty_cache()
        seen.append(torch.cuda.current_device())
        print("RESULT", json.dumps({"n": n, "seen": seen}))
        """,
    )
    assert res["seen"] == list(range(res["n"])) + [0], res


def test_enable_does_not_initialise_cuda_before_fork(libpath):
    """Issue #13, item 5: enable() used to run cuInit (configuration read), so a child forked
    afterwards had a broken CUDA without torch's bad-fork message. Now a child can
    initialise CUDA exactly as without enable()."""
    body = """
        import os
        pid = os.fork()
        if pid == 0:
            try:
                torch.cuda.init()
                ok = torch.cuda.get_device_name(0) != ""
                os._exit(0 if ok else 3)
            except BaseException:
                os._exit(4)
        _, status = os.waitpid(pid, 0)
        print("RESULT", json.dumps({"status": status}))
        """
    res = run_torch(libpath, body)
    assert res["status"] == 0, res


def test_library_fails_cleanly_in_a_forked_child(libpath):
    """Issue #13, item 6: after the parent allocated, every library call in a forked child
    fails at once with an error naming the fork (no hang on a lock, no use of the
    parent's CUDA memory)."""
    res = run_torch(
        libpath,
        """
        import os, signal
        x = torch.ones(1 << 20, device="cuda")
        lib = stitch_alloc.load_library()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            signal.alarm(20)
            p = lib.stitch_malloc(1 << 20, 0, None)
            e1 = stitch_alloc.last_error()
            s = lib.stitch_stats_json(0)
            e2 = stitch_alloc.last_error()
            os.write(w, json.dumps({"p": p, "e1": e1, "s": s is None, "e2": e2}).encode())
            os._exit(0)
        os.close(w)
        _, status = os.waitpid(pid, 0)
        child = json.loads(os.read(r, 65536).decode() or "{}")
        print("RESULT", json.dumps({"status": status, "child": child,
              "parent_ok": float(x.sum().item())}))
        """,
    )
    assert res["status"] == 0, res
    c = res["child"]
    assert c["p"] is None and c["s"], res
    assert "forked child" in c["e1"] and "forked child" in c["e2"], res
    assert res["parent_ok"] == float(1 << 20)


@pytest.mark.parametrize("ext", [False, True])
def test_late_memory_fraction_takes_effect(libpath, ext):
    """Issue #12: a memory fraction set after the device's first allocation changes its
    capacity at once (it used to be refused); live tensors are untouched and an allocation
    beyond the new limit fails."""
    res = run_torch(
        libpath,
        """
        x = torch.ones(1 << 20, device="cuda")
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(0.1, 0)
        cap = stitch_alloc.memory_stats(0)["capacity"]
        failed = False
        try:
            y = torch.empty(int(total * 0.2), dtype=torch.uint8, device="cuda")
            failed = y.data_ptr() == 0
        except Exception:  # noqa: BLE001 (OutOfMemoryError, or RuntimeError on the fallback)
            failed = True
        print("RESULT", json.dumps({"cap": cap, "total": total, "failed": failed,
              "x": x.sum().item()}))
        """,
        ext=ext,
    )
    assert res["cap"] <= res["total"] * 0.1 + (2 << 20), res
    assert res["failed"], res
    assert res["x"] == float(1 << 20)


def test_extension_torch_memory_api_and_oom(libpath):
    """Issue #12, items 1-2: torch's own statistics work and OOM raises OutOfMemoryError with
    the allocator's diagnosis; observers are called; the process carries on."""
    res = run_torch(
        libpath,
        """
        assert stitch_alloc.mode() == "extension", stitch_alloc.mode()
        x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        a0 = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        del x
        summary = torch.cuda.memory_summary()
        seen = []
        torch._C._cuda_attach_out_of_memory_observer(lambda *a: seen.append(a))
        total = torch.cuda.get_device_properties(0).total_memory
        msg = None
        try:
            torch.empty(2 * total, dtype=torch.uint8, device="cuda")
        except torch.cuda.OutOfMemoryError as e:
            msg = str(e)
        y = (torch.ones(1 << 20, device="cuda") * 2).sum().item()
        print("RESULT", json.dumps({"a0": a0, "after": torch.cuda.memory_allocated(),
              "peak": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.memory_reserved(),
              "peak_reserved": torch.cuda.max_memory_reserved(),
              "summary": len(summary), "msg": msg, "seen": len(seen), "y": y}))
        """,
        ext=True,
    )
    assert res["a0"] >= 64 << 20 and res["after"] < 64 << 20, res
    # Reserved memory may shrink after the free: a small request can take the place of a
    # free large-pool handle (release and re-create, fewer bytes held), so the peak is what
    # must show the 64 MiB, and the current figure must cover what is allocated.
    assert res["peak"] >= 64 << 20 and res["peak_reserved"] >= 64 << 20, res
    assert res["reserved"] >= res["after"], res
    assert res["summary"] > 100
    assert res["msg"] and "stitch-alloc" in res["msg"], res
    assert res["seen"] >= 1 and res["y"] == float(2 << 20)


def test_extension_graph_pool_keeps_replays_from_corrupting(libpath):
    """Issue #12, item 4: a temporary freed during capture stays in the graph's private pool,
    so tensors allocated after capture never share its memory and replays leave them
    intact (this corrupted 1 of 8 tensors without pools)."""
    res = run_torch(
        libpath,
        """
        x = torch.randn(1 << 20, device="cuda")
        s = torch.cuda.Stream()
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
        ok = bool(torch.allclose(y, (x * 2).sin()))
        del g, y
        torch.cuda.empty_cache()
        print("RESULT", json.dumps({"dirty": dirty, "ok": ok}))
        """,
        ext=True,
    )
    assert res["dirty"] == 0, res
    assert res["ok"], res


def test_default_capacity_is_the_free_memory(libpath):
    """Issue #13, item 11: the default capacity counts only memory free at the first
    allocation (torch's context and other processes hold the rest)."""
    res = run_torch(
        libpath,
        """
        free, total = torch.cuda.mem_get_info(0)
        x = torch.ones(1 << 20, device="cuda")
        print("RESULT", json.dumps({"free": free, "total": total,
              "capacity": stitch_alloc.memory_stats(0)["capacity"]}))
        """,
    )
    assert res["capacity"] <= res["free"], res
    assert res["capacity"] < res["total"], res


def test_extension_shares_cuda_tensors_with_a_spawned_process(libpath):
    """Issue #12, item 6: torch.multiprocessing shares a CUDA tensor and a view of it with
    a spawned child running stitch-alloc too; the child reads the parent's values and the
    parent sees the child's writes (scripts/torch-ipc.py; the handles travel as POSIX file
    descriptors fetched with pidfd_getfd)."""
    import os

    script = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "torch-ipc.py")
    env = subprocess_env(libpath, "backend:cuda,log:warn")
    env["STITCH_IPC_LIB"] = libpath
    env["STITCH_ALLOC_TORCH_EXT"] = "1"
    r = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True,
                       timeout=400)
    print(r.stdout)
    print(r.stderr, file=sys.stderr)
    lines = [l for l in r.stdout.splitlines() if l.startswith("RESULT ")]
    assert lines, f"exit {r.returncode}:\n{r.stdout}\n{r.stderr}"
    res = json.loads(lines[-1][len("RESULT ") :])
    assert res["mode"] == "extension" and res["child"].get("mode") == "extension", res
    assert res["ok"], res
    assert res["after"] == float(1 << 20), res


def test_extension_user_mempool_can_be_deleted(libpath):
    """A torch.cuda.MemPool used and deleted under the extension: torch's MemPool destructor
    calls setUseOnOOM(device, id, False), which raised, so the process terminated
    (std::terminate from a destructor)."""
    res = run_torch(
        libpath,
        """
        import gc
        pool = torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(pool):
            x = torch.ones(1 << 20, device="cuda")
        s = float(x.sum().item())
        del x, pool
        gc.collect()
        torch.cuda.empty_cache()
        y = float((torch.ones(1 << 20, device="cuda") * 3).sum().item())
        print("RESULT", json.dumps({"sum": s, "after": y}))
        """,
        ext=True,
    )
    assert res == {"sum": float(1 << 20), "after": float(3 << 20)}, res


def test_extension_history_completes_a_free_through_a_pools_own_allocator(libpath):
    """A block of a pool with its own allocator (stitch_alloc.one_handle_pool()) that is
    freed after its pool was deleted goes back through that allocator; the memory history
    must show its free completed, as for every other free (it had only free_requested)."""
    res = run_torch(
        libpath,
        """
        import gc
        torch.cuda.memory._record_memory_history(max_entries=10000)
        pool = stitch_alloc.one_handle_pool()
        with torch.cuda.use_mem_pool(pool):
            x = torch.ones(3 << 20, dtype=torch.uint8, device="cuda")
        addr = x.data_ptr()
        del pool
        gc.collect()
        del x
        gc.collect()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        acts = [e["action"] for t in snap["device_traces"] for e in t if e["addr"] == addr]
        print("RESULT", json.dumps({"acts": acts}))
        """,
        ext=True,
    )
    acts = res["acts"]
    assert "alloc" in acts and "free_requested" in acts, acts
    assert "free_completed" in acts, acts
    assert acts.index("free_completed") > acts.index("free_requested"), acts


def test_extension_alloc_clock_counts_each_allocators_calls_only_while_on(libpath):
    """The extension's diagnostic clock (scripts/torch-inproc-speed.py --alloc-clock): off, it
    counts nothing; on, each allocate and free of stitch-alloc's blocks and of torch's own
    (handed out while delegating) is counted on its own side, with a positive time; a
    delegated block behind the timed deleter holds its data, and its free is counted once
    the clock is off too (it goes to torch's allocator through the timed deleter)."""
    res = run_torch(
        libpath,
        """
        ext = stitch_alloc.enable()
        def clock():
            return {k: list(v) for k, v in ext._alloc_clock().items()}
        c0 = clock()
        x = torch.ones(1 << 20, device="cuda"); del x
        c1 = clock()
        ext._set_alloc_clock(True)
        xs = [torch.ones(1 << 18, device="cuda") for _ in range(3)]; del xs
        ext._set_delegate(True)
        ys = [torch.ones(1 << 18, device="cuda") for _ in range(2)]; del ys
        ext._set_delegate(False)
        ext._set_alloc_clock(False)
        c2 = clock()
        z = torch.ones(1 << 18, device="cuda"); del z
        c3 = clock()
        # A delegated block behind the timed deleter holds its data and goes back to torch.
        ext._set_delegate(True)
        ext._set_alloc_clock(True)
        w = torch.full((1 << 18,), 2.0, device="cuda")
        ext._set_alloc_clock(False)
        total = float(w.sum().item())
        del w
        ext._set_delegate(False)
        d = {k: [c2[k][0] - c1[k][0], c2[k][1] > c1[k][1]] for k in c2}
        print("RESULT", json.dumps({"off": c1 == c0 and c3 == c2, "on": d, "total": total,
                                    "native_free_after": clock()["native_free"][0] - c3["native_free"][0]}))
        """,
        ext=True,
    )
    assert res == {"off": True, "total": float(2 << 18), "native_free_after": 1,
                   "on": {"stitch_alloc": [3, True], "stitch_free": [3, True],
                          "native_alloc": [2, True], "native_free": [2, True]}}, res


def test_extension_delegation_hands_out_torchs_own_memory_and_takes_it_back(libpath):
    """The extension's diagnostic delegation (scripts/torch-inproc-speed.py): while on, new
    tensors and raw allocations come from torch's own caching allocator (stitch-alloc's
    counts do not move) and go back to it when freed, with record_stream and empty_cache
    forwarded; once off, allocations are stitch-alloc's again. No warning of a free of an
    unknown pointer."""
    res = run_torch(
        libpath,
        """
        import warnings
        ext = stitch_alloc.enable()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            a0 = torch.cuda.memory_allocated()
            ext._set_delegate(True)
            x = torch.ones(1 << 20, device="cuda")
            x.record_stream(torch.cuda.Stream())
            r = torch.cuda.caching_allocator_alloc(1 << 20)
            torch.cuda.caching_allocator_delete(r)
            a1 = torch.cuda.memory_allocated()
            ext._set_delegate(False)
            z = torch.ones(1 << 20, device="cuda") * 2
            a2 = torch.cuda.memory_allocated()
            sums = [float(x.sum().item()), float(z.sum().item())]
            del x
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            after = float((torch.ones(1 << 20, device="cuda") * 3).sum().item())
        print("RESULT", json.dumps({"moved_while_delegating": a1 - a0,
                                    "stitch_after": a2 - a0 >= 4 * 1048576,
                                    "sums": sums, "after": after,
                                    "warnings": [str(m.message) for m in w]}))
        """,
        ext=True,
    )
    assert res == {"moved_while_delegating": 0, "stitch_after": True,
                   "sums": [float(1 << 20), float(2 << 20)], "after": float(3 << 20),
                   "warnings": []}, res
