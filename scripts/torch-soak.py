#!/usr/bin/env python3
"""Concurrency soak of stitch-alloc under PyTorch (issue #13, "Also"): THREADS threads, each
with torch streams and raw CUDA streams of its own (created, used, retired with
stitch_alloc.retire_stream, destroyed), checked arithmetic on every step, deliberate
out-of-memory requests, CUDA graph capture (replayed and checked where stitch-alloc supports
it; refused loudly where it does not), and torch.cuda.empty_cache() from another thread, for
--seconds. At the end every tensor is dropped and the cache emptied: the allocator must
hold no live allocation, no physical memory and no CUDA event, with its driver counters
balanced.

    python3 scripts/torch-soak.py --seconds 180            # the soak
    compute-sanitizer --tool memcheck python3 scripts/torch-soak.py --seconds 10 --threads 4

Prints one JSON line per thread and a final JSON summary; exit status 0 only if no thread hit
an unexpected error, every check passed and nothing leaked.
"""
import argparse
import ctypes
import faulthandler
import gc
import json
import os
import random
import sys
import threading
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=180)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()

    # A crash in native code prints every thread's Python stack (where it happened).
    faulthandler.enable(all_threads=True)
    import stitch_alloc
    import torch

    stitch_alloc.enable()
    dev = torch.device("cuda", 0)
    torch.cuda.init()
    cuda = ctypes.CDLL("libcuda.so.1")
    total = torch.cuda.get_device_properties(0).total_memory
    stop = threading.Event()
    results = [None] * args.threads
    # torch's CUDAGraph methods and torch.cuda.synchronize() synchronise the whole device,
    # which invalidates a capture running on another thread (whatever the allocator: run
    # 22's memcheck log shows c10::cuda::device_synchronize inside CUDAGraph calls). Graph
    # work and device-wide synchronisations therefore take this lock; everything else runs
    # concurrently.
    device_sync = threading.Lock()

    def worker(i):
        rng = random.Random(args.seed * 1000 + i)
        r = dict(thread=i, steps=0, checks=0, bad=0, ooms=0, graphs=0, graph_refusals=0,
                 raw_streams=0, errors=[])
        keep = []
        own = [torch.cuda.Stream(device=dev) for _ in range(2)]
        # torch.cuda.Stream() hands out streams from a small per-device pool, so two threads'
        # "own" streams may be one CUDA stream; a capture must have a stream no other thread
        # queues work on (run 26: another thread's kernel on the capturing stream invalidated
        # the capture). Each thread captures on a raw stream of its own.
        # A new thread has no current CUDA context until the runtime makes the primary one
        # current (its first CUDA call); the driver API needs one.
        torch.zeros(1, device=dev).sum().item()
        cap_h = ctypes.c_void_p()
        rc = cuda.cuStreamCreate(ctypes.byref(cap_h), 1)
        if rc != 0:
            raise RuntimeError(f"cuStreamCreate failed ({rc})")
        cap = torch.cuda.ExternalStream(cap_h.value, device=dev)
        try:
            while not stop.is_set():
                op = rng.random()
                r["steps"] += 1
                if op < 0.55:  # checked arithmetic on one of the thread's streams
                    s = rng.choice(own)
                    n = rng.choice([1 << 10, 1 << 16, 1 << 20, 3 << 20, 9 << 20])
                    with torch.cuda.stream(s):
                        x = torch.full((n,), float(i + 1), device=dev)
                        y = x * 2 + 1
                        want = (2 * (i + 1) + 1) * n
                        got = float(y.sum().item())
                    r["checks"] += 1
                    if got != want:
                        r["bad"] += 1
                    if rng.random() < 0.3:
                        keep.append(y)
                    if len(keep) > 16 or rng.random() < 0.2:
                        keep.pop(rng.randrange(len(keep))) if keep else None
                elif op < 0.70:  # a raw stream of our own: used, retired, destroyed
                    h = ctypes.c_void_p()
                    rc = cuda.cuStreamCreate(ctypes.byref(h), 1)
                    if rc != 0:
                        r["errors"].append(f"cuStreamCreate {rc}")
                        continue
                    es = torch.cuda.ExternalStream(h.value, device=dev)
                    with torch.cuda.stream(es):
                        a = torch.ones(rng.choice([1 << 18, 5 << 20]), device=dev)
                        b = (a * 3).sum()
                    es.synchronize()
                    r["checks"] += 1
                    if float(b.item()) != 3 * a.numel():
                        r["bad"] += 1
                    del a, b
                    stitch_alloc.retire_stream(h.value, device=0)
                    cuda.cuStreamDestroy_v2(h)
                    r["raw_streams"] += 1
                elif op < 0.78:  # a deliberate out-of-memory request
                    try:
                        z = torch.empty(int(total * 1.5) // 4, dtype=torch.float32, device=dev)
                        z.fill_(0)  # the fallback hands out an unallocated storage
                        r["errors"].append("an impossible allocation succeeded")
                    except (torch.cuda.OutOfMemoryError, RuntimeError):
                        r["ooms"] += 1
                elif op < 0.86:  # a CUDA graph (one thread at a time, see device_sync)
                    s = cap
                    x = torch.full((1 << 16,), 2.0, device=dev)
                    with torch.cuda.stream(s):
                        torch.cuda.current_stream().wait_stream(torch.cuda.default_stream())
                        device_sync.acquire()
                        try:
                            g = torch.cuda.CUDAGraph()
                            # thread_local: the other threads' synchronising calls must
                            # not invalidate this capture (the default, global, mode forbids
                            # them process-wide while any capture runs).
                            with torch.cuda.graph(g, stream=s, capture_error_mode="thread_local"):
                                t = x * 3
                                out = t + 1
                                del t
                            g.replay()
                            s.synchronize()
                            r["graphs"] += 1
                            r["checks"] += 1
                            if float(out.sum().item()) != 7.0 * x.numel():
                                r["bad"] += 1
                            del g, out
                        except Exception as e:  # noqa: BLE001
                            if "not supported" in str(e) or type(e).__name__ == "GraphCaptureUnsupported":
                                r["graph_refusals"] += 1
                            else:
                                raise
                        finally:
                            device_sync.release()
                else:  # a new torch stream now and then (torch pools them)
                    own[rng.randrange(2)] = torch.cuda.Stream(device=dev)
        except Exception:  # noqa: BLE001
            r["errors"].append(traceback.format_exc(limit=3))
        keep.clear()
        # A graph left by an error still holds its pool, whose blocks are freed on the
        # capture stream: drop it before that stream is destroyed.
        g = out = t = x = None  # noqa: F841
        with device_sync:
            torch.cuda.synchronize()
        stitch_alloc.retire_stream(cap_h.value, device=0)
        cuda.cuStreamDestroy_v2(cap_h)
        results[i] = r

    def emptier():
        n = 0
        while not stop.wait(0.25):
            torch.cuda.empty_cache()
            n += 1
        return n

    t0 = time.time()
    ts = [threading.Thread(target=worker, args=(i,)) for i in range(args.threads)]
    te = threading.Thread(target=emptier)
    for t in ts + [te]:
        t.start()
    time.sleep(args.seconds)
    stop.set()
    for t in ts + [te]:
        t.join(timeout=120)
    hung = [i for i, t in enumerate(ts) if t.is_alive()]
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    doc = stitch_alloc.stats(0)
    st = doc.get("stats", {})
    calls = st.get("calls", {})
    for r in results:
        if r:
            print(json.dumps({k: (v[:3] if k == "errors" else v) for k, v in r.items()}))
    live = doc["torch"]["allocated_bytes.all.current"]
    reserved = doc["torch"]["reserved_bytes.all.current"]
    summary = dict(
        seconds=round(time.time() - t0, 1),
        threads=args.threads,
        hung_threads=hung,
        steps=sum(r["steps"] for r in results if r),
        checks=sum(r["checks"] for r in results if r),
        bad=sum(r["bad"] for r in results if r),
        ooms=sum(r["ooms"] for r in results if r),
        graphs=sum(r["graphs"] for r in results if r),
        graph_refusals=sum(r["graph_refusals"] for r in results if r),
        raw_streams=sum(r["raw_streams"] for r in results if r),
        errors=sum(len(r["errors"]) for r in results if r),
        live_bytes_at_end=live,
        reserved_bytes_at_end=reserved,
        events_held_at_end=st.get("events_held"),
        calls={k: v for k, v in calls.items() if v} if isinstance(calls, dict) else calls,
        allocator=stitch_alloc.integration() if hasattr(stitch_alloc, "integration") else None,
    )
    if live or reserved:
        # What is still held, as torch's snapshot sees it (one segment per allocation or
        # cached graph-pool block under the extension).
        try:
            segs = torch.cuda.memory_snapshot()
            summary["held_segments"] = len(segs)
            summary["held"] = [
                dict(size=g.get("total_size"), stream=g.get("stream"),
                     pool=list(g.get("segment_pool_id", ())),
                     states=sorted({b.get("state") for b in g.get("blocks", [])}))
                for g in segs[:12]
            ]
        except Exception as e:  # noqa: BLE001
            summary["held"] = repr(e)
    ok = (not hung and summary["bad"] == 0 and summary["errors"] == 0 and live == 0
          and reserved == 0 and summary["ooms"] > 0)
    # An idle allocator after empty_cache holds no CUDA event (Stats::events_held; a library
    # older than the field reports none, and is not judged on it).
    if summary["events_held_at_end"] is not None:
        ok = ok and summary["events_held_at_end"] == 0
    if isinstance(calls, dict) and calls:
        balanced = calls.get("create", 0) == calls.get("release", 0) and \
            calls.get("map", 0) == calls.get("unmap", 0)
        summary["driver_counters_balanced"] = balanced
        ok = ok and balanced
    summary["result"] = "PASS" if ok else "FAIL"
    print(json.dumps(summary))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
