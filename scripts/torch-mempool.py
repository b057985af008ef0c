#!/usr/bin/env python3
"""torch.cuda.MemPool under stitch-alloc (issues #12 and #14): each case in a fresh process,
under torch's default allocator and under stitch-alloc (the C++ extension). One line per
case and allocator, and ``RESULT {json}`` lines.

* ``lifecycle``: a user MemPool, a tensor allocated in it (``use_mem_pool``), the pool
  deleted, memory allocated after: the process must live on (torch's MemPool destructor
  calls ``setUseOnOOM(..., False)``, which must not throw).
* ``one_handle_nccl``: ``stitch_alloc.one_handle_pool()`` (under the default: a MemPool of
  torch's own), a 300 MiB tensor in it (above ``max_handle``, so the ordinary path would
  use several handles), ``cuMemGetAddressRange`` of it recorded, then ``torch.distributed``
  with NCCL on one rank: ``register_mem_pool`` of the pool, an ``all_reduce`` of the
  tensor, ``deregister_mem_pool``.

    python3 scripts/torch-mempool.py --lib .gpu/libstitch_alloc.so
"""
import argparse
import ctypes
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def child(case, lib):
    if lib:
        # STITCH_PYDIR: another copy of the package (to run an older extension source).
        sys.path.insert(0, os.environ.get("STITCH_PYDIR") or os.path.join(os.path.dirname(HERE), "python"))
        import stitch_alloc

        stitch_alloc.enable(path=lib, extension=True)
    import torch

    res = {"case": case, "mode": "extension" if lib else "default"}
    if case == "lifecycle":
        pool = torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(pool):
            x = torch.ones(1 << 20, device="cuda")
        res["sum"] = float(x.sum().item())
        del x
        del pool
        import gc

        gc.collect()
        torch.cuda.empty_cache()
        y = torch.ones(1 << 20, device="cuda") * 3
        res["after"] = float(y.sum().item())
        res["ok"] = res["sum"] == float(1 << 20) and res["after"] == float(3 << 20)
    elif case == "one_handle_nccl":
        import torch.distributed as dist

        n = 300 << 20
        # The communicator first (NCCL registers a pool only on an initialised one).
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{29400 + (7 if lib else 3)}",
                                rank=0, world_size=1, device_id=torch.device("cuda", 0))
        pool = stitch_alloc.one_handle_pool() if lib else torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(pool):
            t = torch.ones(n // 4, device="cuda")
        cuda = ctypes.CDLL("libcuda.so.1")
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        rc = cuda.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size),
                                          ctypes.c_uint64(t.data_ptr()))
        res["address_range"] = {"rc": rc, "base_is_ptr": base.value == t.data_ptr(),
                                "size": size.value}
        res["pool_segments"] = len(pool.snapshot())
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cuda"))
        backend.register_mem_pool(pool)
        dist.all_reduce(t)
        torch.cuda.synchronize()
        res["all_reduce_sum"] = float(t.sum().item())
        backend.deregister_mem_pool(pool)
        dist.destroy_process_group()
        del t
        del pool
        res["ok"] = res["all_reduce_sum"] == float(n // 4)
    print("RESULT " + json.dumps(res), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lib", default=None)
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-lib", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.case:
        child(a.case, a.child_lib)
        return 0
    bad = 0
    for case in ("lifecycle", "one_handle_nccl"):
        for lib in (None, a.lib):
            cmd = [sys.executable, os.path.abspath(__file__), "--case", case]
            if lib:
                cmd += ["--child-lib", lib]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            line = next((l for l in r.stdout.splitlines() if l.startswith("RESULT ")), None)
            if line is None:
                res = {"case": case, "mode": "extension" if lib else "default", "ok": False,
                       "exit": r.returncode, "stderr": r.stderr[-600:]}
                print("RESULT " + json.dumps(res), flush=True)
            else:
                res = json.loads(line[7:])
                res["exit"] = r.returncode
                print(line, flush=True)
            ok = res.get("ok") and r.returncode == 0
            bad += not ok
            print(f"{case:16} {res['mode']:9} {'PASS' if ok else 'FAIL'} (exit {r.returncode})",
                  flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
