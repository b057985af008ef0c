"""stitch-alloc for PyTorch.

stitch-alloc is a GPU memory allocator on CUDA virtual memory management that has no
external fragmentation: free physical handles are remapped into contiguous spans. This
package loads its C library (``libstitch_alloc.so``) into PyTorch::

    import stitch_alloc
    stitch_alloc.enable()            # before the first CUDA allocation
    ...
    stitch_alloc.memory_stats(0)     # PyTorch's key names, plus the allocator's own
    print(stitch_alloc.memory_summary(0))

Two ways of serving torch, chosen by :func:`enable`:

* **The C++ extension** (default; ``csrc/stitch_torch.cpp``, built at the first
  ``enable()`` with ``torch.utils.cpp_extension.load`` and cached by torch): implements
  torch's whole allocator interface (``c10::cuda::CUDACachingAllocator::CUDAAllocator``)
  over the library. ``torch.cuda.memory_allocated()``, ``memory_stats()``,
  ``memory_summary()``, ``reset_peak_memory_stats()`` and the rest work; running out of
  memory raises ``torch.cuda.OutOfMemoryError`` with the allocator's diagnosis (OOM
  observers are called) and the process carries on; ``cudnn.benchmark`` works
  (``cacheInfo``); CUDA graphs get private memory pools (``torch.cuda.graph``,
  ``graph_pool_handle``, ``torch.compile(mode="reduce-overhead")``'s cudagraph trees with
  checkpointed pool state); ``torch.cuda.memory._record_memory_history`` / ``_snapshot``
  record alloc / free_requested / free_completed / oom entries (each allocation is one
  segment of the snapshot); ``set_per_process_memory_fraction`` works at any time.
  Sharing CUDA tensors between processes (``torch.multiprocessing``) raises a clear error.
* **The fallback**, ``torch.cuda.memory.CUDAPluggableAllocator`` with the init, reset,
  memory-fraction and record-stream hooks, when the extension cannot be built (no compiler
  or ninja) or ``extension=False``. It lacks what :data:`FALLBACK_LACKS` lists (the warning
  says so): ``torch.cuda.memory_stats()`` and friends raise (use this package's
  :func:`memory_stats`, :func:`memory_summary`, :func:`empty_cache`); out of memory is not
  ``OutOfMemoryError`` (torch 2.11's ``CUDAPluggableAllocator::allocate`` does not check the
  pointer, so ``torch.empty`` succeeds with an unallocated storage and its first use raises
  ``RuntimeError: ... data is not allocated yet``; the diagnosis is in :func:`last_error`);
  CUDA graph capture fails loudly instead of corrupting memory (``capture_begin`` raises
  :class:`GraphCaptureUnsupported`, and the library refuses an allocation on a capturing
  stream and keeps a block freed during a capture out of reuse, ``graph_held_bytes``).

Configuration: the ``conf`` argument of :func:`enable` or the ``STITCH_ALLOC_CONF``
environment variable, e.g. ``"backend:cuda,capacity_fraction:0.9,log:warn"`` (see
``include/stitch_alloc.h`` for every key). It is read once per process, at the library's
first call.

Memory fraction: ``torch.cuda.set_per_process_memory_fraction`` works at any time (both
paths): after the device's first allocation it changes the capacity at once; nothing live
is touched, later allocations beyond the limit fail as out of memory. The default capacity
is the device memory free at that first allocation (memory other processes hold is not
counted).

Fork: the library touches the CUDA driver only at the first allocation, so :func:`enable`
alone does not initialise CUDA (``CUDA_VISIBLE_DEVICES`` may still be set, and a forked
child can use CUDA as it could without stitch-alloc). Once the library has been used, every
call in a forked child fails with an error naming the fork (the parent's CUDA memory is not
usable there); torch's allocator in such a child is this library, so allocate in the parent
or start workers with ``spawn``.

The statistics functions need only ctypes, not torch.
"""

import ctypes
import json
import os
import threading
import warnings

__all__ = [
    "CONF_ENV",
    "LIB_ENV",
    "LIB_NAME",
    "enable",
    "is_enabled",
    "find_library",
    "library_candidates",
    "load_library",
    "stats",
    "memory_stats",
    "memory_summary",
    "empty_cache",
    "last_error",
    "version",
    "GraphCaptureUnsupported",
    "build_extension",
    "mode",
    "one_handle_pool",
    "EXT_ENV",
    "FALLBACK_LACKS",
]

__version__ = "0.1.0"

#: The environment variable the library reads its configuration from.
CONF_ENV = "STITCH_ALLOC_CONF"
#: The environment variable naming the library file.
LIB_ENV = "STITCH_ALLOC_LIB"
#: The library's file name.
LIB_NAME = "libstitch_alloc.so"

# (setter on torch's _CUDAPluggableAllocator, exported symbol). The setter names were read
# in torch's torch/csrc/cuda/Module.cpp (registerCudaPluggableAllocator), which binds
# CUDAPluggableAllocator::set_init_fn & co. under these names, each taking a function
# pointer as an integer.
_HOOKS = (
    ("set_init_fn", "stitch_init"),
    ("set_reset_fn", "stitch_reset"),
    ("set_memory_fraction_fn", "stitch_memory_fraction"),
    ("set_record_stream_fn", "stitch_record_stream"),
)

class GraphCaptureUnsupported(RuntimeError):
    """A CUDA graph capture was started while stitch-alloc is torch's allocator.

    Capture needs private memory pools (memory used by a graph is never reused while the
    graph lives), which this integration does not have yet; capturing without them would
    let a later tensor share memory with the graph's temporaries."""


_CAPTURE_MESSAGE = (
    "stitch_alloc: CUDA graph capture is not supported yet under stitch-alloc (no private "
    "graph memory pools: memory a graph uses could be handed to other tensors and be "
    "overwritten on replay). Run graph capture under torch's default allocator, or without "
    "torch.cuda.graph / make_graphed_callables / torch.compile(mode='reduce-overhead')."
)

_lock = threading.RLock()
_lib = None
_lib_path = None
_torch_allocator = None


def library_candidates(path=None):
    """The paths :func:`find_library` tries, in order."""
    here = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.dirname(os.path.dirname(here))  # python/stitch_alloc -> repository root
    out = []
    if path:
        out.append(os.fspath(path))
    if os.environ.get(LIB_ENV):
        out.append(os.environ[LIB_ENV])
    out.append(os.path.join(here, LIB_NAME))
    out.append(os.path.join(repo, "target", "release", LIB_NAME))
    if os.environ.get("CARGO_TARGET_DIR"):
        out.append(os.path.join(os.environ["CARGO_TARGET_DIR"], "release", LIB_NAME))
    out.append(os.path.join(os.getcwd(), "target", "release", LIB_NAME))
    return out


def find_library(path=None):
    """The path of ``libstitch_alloc.so``.

    Tries ``path``, then ``$STITCH_ALLOC_LIB``, the package's folder, ``target/release`` of
    the repository holding this package, ``$CARGO_TARGET_DIR/release`` and
    ``./target/release``. An explicit ``path`` or ``$STITCH_ALLOC_LIB`` that does not exist
    is an error (no silent fall-back to another build).
    """
    explicit = path or os.environ.get(LIB_ENV)
    if explicit:
        explicit = os.path.abspath(os.fspath(explicit))
        if not os.path.isfile(explicit):
            src = "path" if path else "$" + LIB_ENV
            raise FileNotFoundError(f"stitch_alloc: {src} names {explicit}, which does not exist")
        return explicit
    tried = library_candidates()
    for p in tried:
        if os.path.isfile(p):
            return os.path.abspath(p)
    raise FileNotFoundError(
        "stitch_alloc: libstitch_alloc.so not found; build it with `cargo build --release --features capi` "
        f"or set {LIB_ENV}. Tried: " + ", ".join(tried)
    )


def _declare(lib):
    c = ctypes
    sigs = {
        "stitch_malloc": (c.c_void_p, [c.c_size_t, c.c_int, c.c_void_p]),
        "stitch_free": (None, [c.c_void_p, c.c_size_t, c.c_int, c.c_void_p]),
        "stitch_init": (None, [c.c_int]),
        "stitch_reset": (None, []),
        "stitch_memory_fraction": (None, [c.c_double, c.c_int]),
        "stitch_record_stream": (None, [c.c_void_p, c.c_void_p]),
        "stitch_empty_cache": (c.c_int, [c.c_int]),
        "stitch_retire_stream": (c.c_int, [c.c_int, c.c_void_p]),
        "stitch_stats_json": (c.c_char_p, [c.c_int]),
        "stitch_last_error": (c.c_char_p, []),
        "stitch_clear_error": (None, []),
        "stitch_version": (c.c_char_p, []),
        "stitch_device_stats": (c.c_ssize_t, [c.c_int, c.c_void_p, c.c_size_t]),
        "stitch_reset_peak_stats": (c.c_int, [c.c_int]),
        "stitch_reset_accumulated_stats": (c.c_int, [c.c_int]),
        "stitch_set_memory_fraction": (c.c_int, [c.c_int, c.c_double]),
        "stitch_get_memory_fraction": (c.c_double, [c.c_int]),
        "stitch_malloc_graph": (c.c_void_p, [c.c_size_t, c.c_int, c.c_void_p]),
        "stitch_malloc_one_handle": (c.c_void_p, [c.c_size_t, c.c_int, c.c_void_p]),
        "stitch_segment_log": (c.c_int, [c.c_int, c.c_int]),
        "stitch_free_graph": (c.c_int, [c.c_void_p, c.c_int]),
        "stitch_share": (c.c_ssize_t, [c.c_void_p, c.c_void_p, c.c_size_t,
                                       c.POINTER(c.c_uint64)]),
        "stitch_ipc_open": (c.c_int, [c.c_int, c.c_char_p, c.c_size_t,
                                      c.POINTER(c.c_void_p)]),
        "stitch_ipc_close": (c.c_int, [c.c_void_p]),
    }
    for name, (res, args) in sigs.items():
        f = getattr(lib, name)
        f.restype = res
        f.argtypes = args


def load_library(path=None):
    """Load the library with ctypes (once per process) and return the ``ctypes.CDLL``.

    Every function of ``include/stitch_alloc.h`` is declared on it. Loading the same file
    as torch does gives the same allocator state (the dynamic loader opens a file once).
    """
    global _lib, _lib_path
    with _lock:
        p = find_library(path) if (path or _lib is None) else _lib_path
        if _lib is not None:
            if os.path.realpath(p) != os.path.realpath(_lib_path):
                warnings.warn(
                    f"stitch_alloc: already loaded from {_lib_path}; ignoring {p}", stacklevel=2
                )
            return _lib
        lib = ctypes.CDLL(p)
        _declare(lib)
        _lib, _lib_path = lib, p
        return lib


def _err(lib):
    e = lib.stitch_last_error()
    return e.decode("utf-8", "replace") if e else ""


def last_error():
    """The calling thread's last error message from the library ('' if none)."""
    return _err(load_library())


def version():
    """The library's version string."""
    return load_library().stitch_version().decode()


def is_enabled():
    """Whether :func:`enable` installed stitch-alloc as torch's CUDA allocator."""
    return _torch_allocator is not None


#: Set to ``0`` to skip the C++ extension and use the ``CUDAPluggableAllocator`` fallback;
#: ``1`` to require it (``enable()`` raises if it cannot be built).
EXT_ENV = "STITCH_ALLOC_TORCH_EXT"

#: What the ``CUDAPluggableAllocator`` fallback lacks (said in the warning when it is used).
FALLBACK_LACKS = (
    "torch.cuda.memory_allocated/memory_stats/memory_summary and the other torch.cuda.memory_* "
    "statistics (they raise; use stitch_alloc.memory_stats), torch.cuda.OutOfMemoryError on "
    "out of memory (torch.empty succeeds with an unallocated storage), cudnn.benchmark "
    "(cacheInfo), CUDA graphs and torch.compile(mode='reduce-overhead') (no private graph "
    "pools: captures are refused), _record_memory_history/_snapshot, OOM observers, and "
    "sharing CUDA tensors between processes (torch.multiprocessing)"
)

_ext = None
_ext_error = None


def _extension_sources():
    """The extension's source and the folders holding ``stitch_alloc.h``."""
    here = os.path.dirname(os.path.abspath(__file__))
    src = os.path.join(here, "csrc", "stitch_torch.cpp")
    incs = []
    for d in (os.path.join(here, "include"), os.path.join(here, "..", "..", "include")):
        if os.path.isfile(os.path.join(d, "stitch_alloc.h")):
            incs.append(os.path.realpath(d))
            break
    return src, incs


def _cuda_runtime_from_wheels():
    """(include dir, lib dir, library file name) of the CUDA runtime that torch's pip wheels
    ship (``nvidia/cu13`` or ``nvidia/cuda_runtime``), or None."""
    try:
        import nvidia  # noqa: PLC0415 (namespace package of the CUDA wheels)
    except ImportError:
        return None
    for base in list(getattr(nvidia, "__path__", [])):
        for sub in ("cu13", "cuda_runtime", "cu12"):
            inc, lib = os.path.join(base, sub, "include"), os.path.join(base, sub, "lib")
            if not os.path.isfile(os.path.join(inc, "cuda_runtime_api.h")):
                continue
            names = sorted(n for n in os.listdir(lib) if n.startswith("libcudart.so")) if os.path.isdir(lib) else []
            if names:
                return inc, lib, names[0]
    return None


EXT_DIR_ENV = "STITCH_ALLOC_EXT_DIR"
"""Environment variable: the folder under which the C++ extension is built and cached
(default: ``$XDG_CACHE_HOME/stitch_alloc/torch_ext`` or ``~/.cache/stitch_alloc/torch_ext``)."""

_EXT_NAME = "stitch_alloc_torch"


def _extension_build_dir():
    """The extension's build folder: one per (source, header, torch, CUDA, Python) so a
    change of any of them builds anew and concurrent processes of different versions never
    share one. Computed without touching CUDA."""
    import hashlib  # noqa: PLC0415
    import sys  # noqa: PLC0415

    import torch  # noqa: PLC0415

    src, incs = _extension_sources()
    if not os.path.isfile(src) or not incs:
        raise FileNotFoundError(f"the extension's source or stitch_alloc.h is missing ({src})")
    h = hashlib.sha256()
    for f in (src, os.path.join(incs[0], "stitch_alloc.h")):
        with open(f, "rb") as fh:
            h.update(fh.read())
    h.update(f"{torch.__version__}|{torch.version.cuda}|{sys.version}|{sys.executable}".encode())
    root = os.environ.get(EXT_DIR_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "stitch_alloc",
        "torch_ext",
    )
    return os.path.join(root, h.hexdigest()[:16])


def cuda_build_flags():
    """(extra include dirs, extra linker flags, ``with_cuda``) for a
    ``torch.utils.cpp_extension.load`` of C++ code that includes torch's CUDA headers: from
    ``CUDA_HOME`` when torch finds a CUDA installation, else from torch's CUDA runtime wheels
    (``nvidia/cu13``), linking the runtime and torch's CUDA libraries by hand. Used by the
    extension's build and by ``scripts/torch-alloc-pair.py``. Importing
    ``torch.utils.cpp_extension`` initialises CUDA: call it where that is allowed."""
    from torch.utils import cpp_extension  # noqa: PLC0415

    if cpp_extension.CUDA_HOME is not None:
        return [], [], True
    rt = _cuda_runtime_from_wheels()
    if rt is None:
        raise RuntimeError("no CUDA installation (CUDA_HOME) and no CUDA runtime wheel found")
    inc, lib, name = rt
    torch_lib = os.path.join(os.path.dirname(cpp_extension.__file__), "..", "lib")
    ldflags = [f"-L{lib}", f"-l:{name}", f"-Wl,-rpath,{lib}",
               f"-L{os.path.realpath(torch_lib)}", "-lc10_cuda", "-ltorch_cuda"]
    return [inc], ldflags, False


def _build_here(build_dir, verbose=False):
    """Compile the extension into ``build_dir`` with ``torch.utils.cpp_extension.load``
    and write the ``built`` stamp. Runs in a child process (:func:`build_extension`):
    importing ``torch.utils.cpp_extension`` calls ``torch.cuda.is_available()`` and the
    build asks torch for the devices' compute capabilities, both of which initialise CUDA,
    and a process that has initialised CUDA cannot hand a usable CUDA to a forked child."""
    from torch.utils import cpp_extension  # noqa: PLC0415

    src, incs = _extension_sources()
    cuda_incs, ldflags, with_cuda = cuda_build_flags()
    incs += cuda_incs
    os.makedirs(build_dir, exist_ok=True)
    cpp_extension.load(
        name=_EXT_NAME,
        sources=[src],
        extra_include_paths=incs,
        extra_cflags=["-O2", "-std=c++17"],
        extra_ldflags=ldflags,
        with_cuda=with_cuda,
        build_directory=build_dir,
        verbose=verbose,
    )
    with open(os.path.join(build_dir, "built"), "w") as f:
        f.write("ok\n")


def build_extension(verbose=False):
    """Build (or load from the cache) the C++ extension that implements torch's whole CUDA
    allocator interface over the library, and return its module.

    The build runs in a child Python (``torch.utils.cpp_extension.load``; needs a C++
    compiler and ninja; about 15 s to a minute the first time), so this process never
    initialises CUDA: ``enable()`` followed by ``os.fork()`` leaves the child a usable CUDA,
    as without stitch-alloc. The result is cached under :data:`EXT_DIR_ENV`, keyed by the
    source, ``stitch_alloc.h``, torch's and Python's versions; later calls import it
    directly. The CUDA headers come from ``CUDA_HOME`` or, when torch finds no CUDA
    installation, from torch's CUDA wheels (``nvidia/cu13``)."""
    global _ext
    if _ext is not None:
        return _ext
    import importlib.util  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    build_dir = _extension_build_dir()
    so = os.path.join(build_dir, _EXT_NAME + ".so")
    if not (os.path.isfile(os.path.join(build_dir, "built")) and os.path.isfile(so)):
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        code = (
            f"import sys; sys.path.insert(0, {here!r}); import torch, stitch_alloc; "
            f"stitch_alloc._build_here({build_dir!r}, verbose={bool(verbose)!r})"
        )
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        if verbose:
            sys.stderr.write(r.stdout + r.stderr)
        if r.returncode != 0:
            raise RuntimeError(
                f"building the extension in {build_dir} failed (exit {r.returncode}):\n"
                + (r.stderr or r.stdout)[-4000:]
            )
    spec = importlib.util.spec_from_file_location(_EXT_NAME, so)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    _ext = mod
    return _ext


def mode():
    """How stitch-alloc serves torch: ``"extension"`` (the C++ extension: torch's whole
    allocator interface), ``"pluggable"`` (the ``CUDAPluggableAllocator`` fallback), or
    None (not enabled)."""
    if _torch_allocator is None:
        return None
    return "pluggable" if _ext is None or _torch_allocator is not _ext else "extension"


def enable(path=None, conf=None, prealloc=None, extension=None):
    """Make stitch-alloc PyTorch's CUDA allocator. Call it before the first CUDA allocation.

    ``prealloc``: bytes (an int or a size such as ``"20GiB"``) created and mapped at the
    device's first allocation as one free pool (``prealloc:`` in the configuration): a loop
    whose peak fits in it makes no driver call after warm-up.

    ``path``: the library (default: :func:`find_library`). ``conf``: a configuration string
    (default: ``$STITCH_ALLOC_CONF``; it is written there, so it must come before the
    library's first call in this process). An invalid configuration raises ``ValueError``
    here rather than failing every allocation later.

    ``extension``: None (default; ``$STITCH_ALLOC_TORCH_EXT`` when set): build and install
    the C++ extension (:func:`build_extension`), which implements torch's whole allocator
    interface (``torch.cuda.memory_*`` statistics, ``OutOfMemoryError``, ``cacheInfo``,
    CUDA graph private pools, memory history, memory fraction at any time, ...); if it
    cannot be built or loaded, warn and fall back to
    ``torch.cuda.memory.CUDAPluggableAllocator`` with the init, reset, memory-fraction and
    record-stream hooks (the warning lists what the fallback lacks, :data:`FALLBACK_LACKS`).
    True: the extension or an error. False: the fallback, without a warning.

    Returns the extension module or the ``CUDAPluggableAllocator`` (:func:`mode` says
    which). Calling it again returns the same one.
    """
    global _torch_allocator, _ext_error
    with _lock:
        if _torch_allocator is not None:
            if conf is not None and os.environ.get(CONF_ENV) != conf:
                warnings.warn(
                    "stitch_alloc.enable: already enabled with "
                    f"{CONF_ENV}={os.environ.get(CONF_ENV)!r}; ignoring conf={conf!r}",
                    stacklevel=2,
                )
            return _torch_allocator
        if extension is None and os.environ.get(EXT_ENV, "") in ("0", "1"):
            extension = os.environ[EXT_ENV] == "1"
        if prealloc is not None:
            base = conf if conf is not None else os.environ.get(CONF_ENV, "")
            conf = ",".join(x for x in (base, f"prealloc:{prealloc}") if x)
        if conf is not None:
            os.environ[CONF_ENV] = conf
        lib_path = find_library(path)
        lib = load_library(lib_path)
        # Reads the configuration now (no driver is touched before the first allocation): a
        # bad one is an error here, not a NULL per tensor.
        lib.stitch_clear_error()
        if lib.stitch_stats_json(0) is None:
            raise ValueError(f"stitch_alloc.enable: {_err(lib)}")
        doc = json.loads(lib.stitch_stats_json(0))
        if conf is not None and doc["conf"] != conf:
            warnings.warn(
                f"stitch_alloc.enable: the library was configured earlier in this process "
                f"with {doc['conf']!r}; conf={conf!r} has no effect",
                stacklevel=2,
            )
        # torch takes every pointer as device memory: host memory or the simulator's fake
        # addresses would crash its first kernel. Refuse them before torch is even imported.
        if doc["backend"] not in ("cuda", "auto"):
            raise ValueError(
                f"stitch_alloc.enable: backend {doc['backend']!r} hands out host or simulated "
                "memory, which torch would use as device memory; under torch use backend:cuda "
                "(or auto, which is CUDA or an error). The host and sim backends are for the "
                "library's own tests and the stitch command."
            )
        # No torch.cuda call here: asking torch for devices initialises CUDA, and a process
        # forked after enable() could not use CUDA any more. Without a usable GPU the first
        # allocation fails with the reason (backend auto and cuda are CUDA or an error).
        import torch  # noqa: PLC0415 (only enable() needs torch)

        if extension is not False:
            try:
                ext = build_extension()
            except Exception as e:  # noqa: BLE001 (any build failure means the fallback)
                _ext_error = f"{type(e).__name__}: {e}"
                if extension:
                    raise RuntimeError(
                        f"stitch_alloc.enable: the C++ extension could not be built: {_ext_error}"
                    ) from e
                warnings.warn(
                    "stitch_alloc.enable: the C++ torch extension could not be built or "
                    f"loaded ({_ext_error.splitlines()[0][:300]}); falling back to "
                    "torch.cuda.memory.CUDAPluggableAllocator, which lacks: " + FALLBACK_LACKS,
                    stacklevel=2,
                )
            else:
                try:
                    ext.install(lib_path)
                except RuntimeError as e:
                    raise RuntimeError(
                        "stitch_alloc.enable() must run before the first CUDA allocation of "
                        f"the process (torch: {e})"
                    ) from e
                _torch_allocator = ext
                _enabled_path[0] = lib_path
                return ext
        _enabled_path[0] = lib_path
        alloc = _enable_pluggable(torch, lib, lib_path)
        _torch_allocator = alloc
        return alloc


_enabled_path = [None]


def one_handle_pool():
    """A ``torch.cuda.MemPool`` whose every block is **one** physical handle created for it
    (``stitch_malloc_one_handle``): for buffers that NCCL user-buffer registration
    (``ProcessGroupNCCL.register_mem_pool``, ``ncclCommRegister``) or RDMA pinning will see,
    which refuse a range of several physical allocations. Needs :func:`enable` with the C++
    extension (the fallback cannot host a pool of another allocator). Use it as torch's own::

        pool = stitch_alloc.one_handle_pool()
        with torch.cuda.use_mem_pool(pool):
            buf = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        backend.register_mem_pool(pool)   # a ProcessGroupNCCL backend

    Freed blocks stay cached in the pool while it lives (as torch's pools do) and go back
    to the library when the pool is deleted.
    """
    if mode() != "extension":
        raise RuntimeError(
            "stitch_alloc.one_handle_pool() needs stitch_alloc.enable() with the C++ "
            f"extension (mode: {mode()!r})"
        )
    import torch  # noqa: PLC0415

    alloc = torch.cuda.memory.CUDAPluggableAllocator(
        _enabled_path[0], "stitch_malloc_one_handle", "stitch_free"
    )
    return torch.cuda.MemPool(alloc.allocator())


def _enable_pluggable(torch, lib, lib_path):
    """The fallback: ``CUDAPluggableAllocator`` with the init, reset, memory-fraction and
    record-stream hooks, and the graph-capture guard."""
    alloc = torch.cuda.memory.CUDAPluggableAllocator(lib_path, "stitch_malloc", "stitch_free")
    native = alloc.allocator()
    missing = []
    for setter, symbol in _HOOKS:
        fn = getattr(native, setter, None)
        if fn is None:
            missing.append(setter)
            continue
        fn(ctypes.cast(getattr(lib, symbol), ctypes.c_void_p).value)
    if missing:
        warnings.warn(
            "stitch_alloc.enable: this torch has no " + ", ".join(missing)
            + "; those hooks are not installed",
            stacklevel=3,
        )
    try:
        torch.cuda.memory.change_current_allocator(alloc)
    except RuntimeError as e:
        raise RuntimeError(
            "stitch_alloc.enable() must run before the first CUDA allocation of the "
            f"process (torch: {e})"
        ) from e
    _guard_graph_capture(torch)
    _guard_memory_fraction(torch, lib)
    return alloc


def _guard_memory_fraction(torch, lib):
    """Make ``torch.cuda.set_per_process_memory_fraction`` raise when the library refuses the
    fraction (out of (0, 1], a bad device), instead of returning as if it had taken effect
    (the pluggable allocator's hook returns nothing)."""
    mem = torch.cuda.memory
    orig = getattr(mem, "set_per_process_memory_fraction", None)
    if orig is None or getattr(orig, "_stitch_alloc_guarded", False):
        return

    def set_per_process_memory_fraction(fraction, device=None):
        lib.stitch_clear_error()
        orig(fraction, device)
        err = _err(lib)
        if err.startswith("stitch_memory_fraction"):
            raise RuntimeError(f"stitch_alloc: {err}")

    set_per_process_memory_fraction.__doc__ = orig.__doc__
    set_per_process_memory_fraction._stitch_alloc_guarded = True
    mem.set_per_process_memory_fraction = set_per_process_memory_fraction
    if getattr(torch.cuda, "set_per_process_memory_fraction", None) is orig:
        torch.cuda.set_per_process_memory_fraction = set_per_process_memory_fraction


def _guard_graph_capture(torch):
    """Make every capture through torch's Python API fail at its start, before any kernel or
    allocation is recorded (the library also refuses allocations on a capturing stream,
    for captures started elsewhere)."""
    graph_cls = getattr(torch.cuda, "CUDAGraph", None)
    if graph_cls is None or getattr(graph_cls, "_stitch_alloc_guarded", False):
        return

    def capture_begin(self, *args, **kwargs):
        raise GraphCaptureUnsupported(_CAPTURE_MESSAGE)

    capture_begin.__doc__ = GraphCaptureUnsupported.__doc__
    graph_cls.capture_begin = capture_begin
    graph_cls._stitch_alloc_guarded = True
    # torch.cuda.graph enters its side stream before capture_begin; refusing in __enter__
    # first leaves the caller's current stream as it was.
    ctx_cls = getattr(torch.cuda, "graph", None)
    if isinstance(ctx_cls, type):

        def enter(self):
            raise GraphCaptureUnsupported(_CAPTURE_MESSAGE)

        ctx_cls.__enter__ = enter


def _device_index(device):
    """An int from an int, a ``torch.device``, ``"cuda:N"`` or None (torch's current device
    when stitch-alloc is torch's allocator, else 0)."""
    if device is None:
        if _torch_allocator is not None:
            import torch  # noqa: PLC0415

            return torch.cuda.current_device()
        return 0
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        return int(device.rsplit(":", 1)[1]) if ":" in device else _device_index(None)
    if getattr(device, "type", None) is not None:  # torch.device
        index = getattr(device, "index", None)
        return _device_index(None) if index is None else int(index)
    return int(device)


def stats(device=None):
    """The library's whole statistics document of ``device`` (``stitch_stats_json``) as a
    dict: ``torch`` (PyTorch's names), ``stats`` (the allocator's counters),
    ``fragmentation``, ``capacity``, ``backend``, ``initialized``, ...

    ``device``: an int, a ``torch.device``, ``"cuda:N"``, or None for the current device."""
    lib = load_library()
    s = lib.stitch_stats_json(_device_index(device))
    if s is None:
        raise RuntimeError(f"stitch_alloc: {_err(lib)}")
    return json.loads(s)


def memory_stats(device=None):
    """Statistics of ``device`` under PyTorch's ``torch.cuda.memory_stats()`` key names
    (``allocated_bytes.all.current``, ``allocated_bytes.all.peak``,
    ``reserved_bytes.all.current``, ``reserved_bytes.all.peak``,
    ``requested_bytes.all.*``, ``active_bytes.all.current``, ``allocation.all.*``,
    ``segment.all.*`` (physical handles), ``inactive_split_bytes.all.current``, ``num_ooms``,
    ``num_alloc_retries``, ``num_device_alloc``, ``num_device_free``), plus the allocator's
    own: ``stitches``, ``stitched_handles``, ``recreated_handles``, ``repeated_stitches``
    (stitches made in the state of an earlier one: a loop stitching at the same point of each
    step), ``loop_region_entries`` / ``loop_region_exits`` (the loop region's turns: such a
    loop's large requests placed in one run that only grows), ``chain_fits`` (large requests
    placed by next fit as a growing chain's next copy, a KV cache grown by concatenation),
    ``extensions``, ``stranded_bytes``,
    ``driver_calls``, ``vmm_calls``, ``driver_time_us`` (wall time inside the driver),
    ``malloc_free_calls`` and ``malloc_free_time_us`` (the process's ``stitch_malloc`` /
    ``stitch_free`` calls and their time from entry to return: driver calls measured in
    each, the rest from one call in 64), ``capacity``, ``largest_free_span``, ``free_bytes``,
    ``free_handle_bytes``, ``handles``, ``fast_allocs``, ``slow_allocs``, ``event_waits``,
    ``events_held`` (CUDA events held now; 0 once idle after ``empty_cache``),
    ``pending_free_bytes``, ``mapped_bytes.current`` / ``.peak``.

    Every value is an int; the dict is sorted by key, as torch's is. Counters are 0 until
    the device's first allocation.
    """
    doc = stats(device)
    s, f = doc["stats"], doc["fragmentation"]
    out = dict(doc["torch"])
    out.update(
        {
            "stitches": s["stitches"],
            "stitched_handles": s["stitched_handles"],
            "recreated_handles": s.get("recreated_handles", 0),
            "repeated_stitches": s.get("repeated_stitches", 0),
            "loop_region_entries": s.get("loop_region_entries", 0),
            "loop_region_exits": s.get("loop_region_exits", 0),
            "chain_fits": s.get("chain_fits", 0),
            "preallocated_bytes": s.get("preallocated", 0),
            "extensions": s["extensions"],
            "stranded_bytes": f["stranded_bytes"],
            "driver_calls": doc["driver_calls"],
            "vmm_calls": doc["vmm_calls"],
            "driver_time_us": int(doc.get("driver_time_us", 0)),
            "malloc_free_calls": doc.get("malloc_free_calls", 0),
            "malloc_free_time_us": int(doc.get("malloc_free_time_us", 0)),
            "capacity": doc["capacity"],
            "largest_free_span": f["largest_free_span"],
            "free_bytes": f["free_bytes"],
            "free_handle_bytes": f["free_handle_bytes"],
            "handles": s["handles"],
            "fast_allocs": s["fast_allocs"],
            "slow_allocs": s["slow_allocs"],
            "event_waits": s["event_waits"],
            "events_held": s.get("events_held", 0),
            "pending_free_bytes": s["pending_free"],
            "mapped_bytes.current": s["mapped"]["current"],
            "mapped_bytes.peak": s["mapped"]["peak"],
        }
    )
    return dict(sorted(out.items()))


def _fmt(n):
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"  # not reached


def memory_summary(device=None):
    """A readable multi-line report of ``device``'s memory, in the spirit of
    ``torch.cuda.memory_summary()``."""
    doc = stats(device)
    s, f = doc["stats"], doc["fragmentation"]
    calls = s["calls"]
    w = 76
    lines = [
        "=" * w,
        f" stitch-alloc {doc['version']} memory summary, device {doc['device']} "
        f"({doc['backend']} backend)",
        f" conf: {doc['conf'] or '(defaults)'}",
    ]
    if not doc["initialized"]:
        lines += [" no allocation on this device yet", "=" * w]
        return "\n".join(lines)
    lines += [
        f" capacity {_fmt(doc['capacity'])}, granularity {_fmt(doc['granularity'])}",
        "-" * w,
        f" {'':<24}{'current':>16}{'peak':>16}",
    ]
    for label, key in (
        ("requested bytes", "requested"),
        ("allocated bytes", "allocated"),
        ("reserved bytes", "reserved"),
        ("mapped bytes", "mapped"),
    ):
        lines.append(f" {label:<24}{_fmt(s[key]['current']):>16}{_fmt(s[key]['peak']):>16}")
    la = s["live_allocations"]
    lines.append(f" {'live allocations':<24}{la['current']:>16}{la['peak']:>16}")
    peak_res = s["reserved"]["peak"]
    util = s["allocated"]["peak"] / peak_res if peak_res else 0.0
    ratio = peak_res / s["requested"]["peak"] if s["requested"]["peak"] else 0.0
    lines += [
        "-" * w,
        f" allocations {s['allocs']}, frees {s['frees']}; fast path {s['fast_allocs']}, "
        f"slow path {s['slow_allocs']}",
        f" stitches {s['stitches']} ({s['stitched_handles']} handles moved, "
        f"{s.get('recreated_handles', 0)} re-created), "
        f"extensions {s['extensions']}",
        f" handles: {s['handles']} now, {s['handles_created']} created, "
        f"{s['handles_released']} released",
        f" out of memory {s['ooms']}, event waits {s['event_waits']}, "
        f"pending frees {_fmt(s['pending_free'])}",
        f" peak reserved / peak requested {ratio:.3f}; "
        f"peak allocated / peak reserved {util:.3f}",
    ]
    rep = s.get("repeated_stitches", 0)
    if rep:
        # 1.05 x the peak rounded up to a MiB, as the library's stats::prealloc_for_peak.
        peak = s.get("requested_lifetime_peak", s["requested"]["peak"])
        lines.append(
            f" repeated stitches {rep}: a loop stitches at the same point of its steps; "
            f"prealloc:{-(-(peak + peak // 20) // (1 << 20))}MiB (1.05 x the peak requested) "
            f"can end them"
        )
    lines += [
        "-" * w,
        f" free spans {f['free_spans']} ({_fmt(f['free_bytes'])}), largest "
        f"{_fmt(f['largest_free_span'])}",
        f" free handles {f['free_handles']} ({_fmt(f['free_handle_bytes'])}), stranded "
        f"beside live data {_fmt(f['stranded_bytes'])}",
        f" rounding waste {_fmt(f['rounding_waste'])}, small pages {f['small_pages']}, "
        f"virtual address space {_fmt(f['va_reserved'])}",
        "-" * w,
        f" driver calls {doc['driver_calls']} (VMM {doc['vmm_calls']}): "
        + ", ".join(f"{k} {v}" for k, v in calls.items() if v),
        "=" * w,
    ]
    return "\n".join(lines)


def empty_cache(device=None):
    """Release the physical memory of free handles to the driver: on every device
    (``device=None``, what ``torch.cuda.empty_cache()`` does through the reset hook) or on
    one."""
    lib = load_library()
    if device is None:
        lib.stitch_reset()
        return
    if lib.stitch_empty_cache(_device_index(device)) != 0:
        raise RuntimeError(f"stitch_alloc: {_err(lib)}")


def retire_stream(stream, device=None):
    """Call before destroying a stream that stitch-alloc memory was freed on (your own
    ``cudaStreamDestroy``, a ``torch.cuda.ExternalStream``): waits for the frees made on it,
    so the library never records an event on it later. ``stream`` is a
    ``torch.cuda.Stream``/``ExternalStream`` or a raw ``cudaStream_t`` as an int."""
    lib = load_library()
    raw = getattr(stream, "cuda_stream", stream)
    if device is None:
        device = getattr(getattr(stream, "device", None), "index", None)
    if lib.stitch_retire_stream(_device_index(device), ctypes.c_void_p(int(raw))) != 0:
        raise RuntimeError(f"stitch_alloc: {_err(lib)}")
