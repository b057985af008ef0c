#!/usr/bin/env python3
"""CUDA IPC through torch.multiprocessing (issue #12 item 6), under torch's default allocator
or stitch-alloc: a parent shares two CUDA tensors (a base and a view with a storage offset)
with a spawned child through a queue; the child checks their values, writes into the base
and answers; the parent then sees the child's writes. Prints one line ``RESULT {json}``.

    python3 scripts/torch-ipc.py                       # torch's default allocator
    STITCH_IPC_LIB=.gpu/libstitch_alloc.so python3 scripts/torch-ipc.py   # stitch-alloc

With ``STITCH_IPC_LIB`` set, both processes run stitch-alloc (the spawned child imports
this file again, which enables it at import); ``STITCH_IPC_ROLES=child`` (or ``parent``)
runs it in that process only, the other under torch's own allocator. Used by
scripts/torch-dropin.py (case ``ipc_share``) and python/tests/test_torch_gpu.py.
"""
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# A spawned child imports this file as its main module under this name.
IS_CHILD = __name__ == "__mp_main__"
ROLES = os.environ.get("STITCH_IPC_ROLES", "both")
LIB = os.environ.get("STITCH_IPC_LIB")
if LIB and ROLES != "both" and ROLES != ("child" if IS_CHILD else "parent"):
    LIB = None
if LIB:
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))
    import stitch_alloc  # noqa: E402

    stitch_alloc.enable(path=LIB)

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def mode():
    return stitch_alloc.mode() if LIB else "default"


def child(q_in, q_out):
    try:
        x, view = q_in.get(timeout=120)
        got = {"sum": float(x.sum().item()), "view0": float(view[0].item()),
               "same_storage": x.untyped_storage().data_ptr() == view.untyped_storage().data_ptr(),
               "mode": mode()}
        x[:10] = -1.0
        torch.cuda.synchronize()
        del x, view
        q_out.put(got)
    except Exception as e:  # noqa: BLE001
        q_out.put({"error": f"{type(e).__name__}: {e}", "mode": mode()})
    q_in.get(timeout=120)  # the parent is done


def main():
    t0 = time.time()
    n = (8 << 20) + 12345  # 32 MiB and a bit: more than one handle
    x = torch.arange(n, device="cuda", dtype=torch.float32)
    view = x[1000:]
    want = float(x.sum().item())
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=child, args=(q_in, q_out))
    p.start()
    res = {"mode": mode(), "roles": ROLES if os.environ.get("STITCH_IPC_LIB") else "none"}
    try:
        q_in.put((x, view))
        got = q_out.get(timeout=180)
        torch.cuda.synchronize()
        res["child"] = got
        res["child_writes_seen"] = bool(x[:10].eq(-1.0).all().item()) and float(x[10].item()) == 10.0
        res["ok"] = ("error" not in got and got["sum"] == want and got["view0"] == 1000.0
                     and got["same_storage"] and res["child_writes_seen"])
    except Exception as e:  # noqa: BLE001
        res["ok"] = False
        res["error"] = f"{type(e).__name__}: {e}"
    q_in.put(None)
    p.join(60)
    res["child_exit"] = p.exitcode
    res["ok"] = bool(res.get("ok")) and p.exitcode == 0
    # The parent goes on allocating after the share.
    y = torch.ones(1 << 20, device="cuda")
    res["after"] = float(y.sum().item())
    res["seconds"] = round(time.time() - t0, 2)
    print("RESULT " + json.dumps(res), flush=True)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
