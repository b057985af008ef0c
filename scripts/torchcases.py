"""What the torch scripts share: building the C++ extension once, in a child process,
before their cases run (so that no case's timeout includes the build and the parent never
initialises CUDA), reading the mode a child reported, the commit the results belong to, and
scripts/torch-zoo.py's model and step helpers as a module."""
import importlib.util
import os
import subprocess
import sys
import time


def prebuild_extension(pydir, timeout, fallback_note=""):
    """Build (or load from torch's cache) stitch_alloc's extension in a child Python.
    Prints one line saying how it went; returns (built, build_log)."""
    t0 = time.time()
    try:
        build = subprocess.run(
            [sys.executable, "-c",
             f"import sys; sys.path.insert(0, {pydir!r}); import torch, stitch_alloc; "
             "stitch_alloc.build_extension(verbose=True); print('BUILT')"],
            capture_output=True, text=True, timeout=timeout)
        out, err = build.stdout, build.stderr
    except subprocess.TimeoutExpired:
        out, err = "", f"the build took more than {timeout} s"
    built = "BUILT" in out
    state = "ok" if built else "FAILED" + (f" ({fallback_note})" if fallback_note else "")
    print(f"extension build: {state} in {time.time() - t0:.0f} s"
          + ("" if built else "\n" + (err or out)[-3000:]), flush=True)
    return built, err[-4000:]


def mode_of(out):
    """The integration mode a child printed as its ``MODE <mode>`` line, or ``"?"``."""
    for line in out.splitlines():
        if line.startswith("MODE "):
            return line[5:]
    return "?"


def bundle_commit(repo):
    """The commit the GPU bundle was built from (`.gpu/COMMIT`: the GPU machine's copy of the
    tree has no git history), else the checkout's HEAD, else None."""
    bundle = os.path.join(repo, ".gpu", "COMMIT")
    if os.path.isfile(bundle):
        with open(bundle) as f:
            return f.read().strip()
    try:
        head = subprocess.run(["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True,
                              text=True).stdout.strip()
    except OSError:
        return None
    return head or None


def zoo_module():
    """scripts/torch-zoo.py as a module (its file name is not an importable name): the zoo's
    model and step helpers (`llm_model`, `llm_step`, `bert_model`, `timm_model`, ...)."""
    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location("torch_zoo", os.path.join(here, "torch-zoo.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
