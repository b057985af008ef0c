"""Shared set-up: import the package from the source tree and find a built library.

The CPU tests load the library in this process with the host backend (real, writable host
memory; no GPU): the configuration below is set before the library's first call. A library
is looked up as stitch_alloc.find_library() does, then in debug builds; without one the
tests that need it are skipped.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PYDIR = os.path.dirname(HERE)
REPO = os.path.dirname(PYDIR)
sys.path.insert(0, PYDIR)

#: The configuration of the in-process (CPU) tests.
HOST_CONF = "backend:host,capacity_bytes:256MiB,devices:2,log:off"
os.environ["STITCH_ALLOC_CONF"] = HOST_CONF

import pytest  # noqa: E402

import stitch_alloc  # noqa: E402


def _find():
    try:
        return stitch_alloc.find_library()
    except FileNotFoundError:
        pass
    dirs = [os.path.join(REPO, "target", "debug")]
    if os.environ.get("CARGO_TARGET_DIR"):
        dirs.append(os.path.join(os.environ["CARGO_TARGET_DIR"], "debug"))
    for d in dirs:
        p = os.path.join(d, stitch_alloc.LIB_NAME)
        if os.path.isfile(p):
            return p
    return None


@pytest.fixture(scope="session")
def libpath():
    p = _find()
    if p is None:
        pytest.skip("libstitch_alloc.so is not built (cargo build --release --features capi, or set STITCH_ALLOC_LIB)")
    return p


@pytest.fixture(scope="session")
def lib(libpath):
    return stitch_alloc.load_library(libpath)


def subprocess_env(libpath, conf):
    """The environment of a child Python that imports stitch_alloc from the source tree."""
    env = dict(os.environ)
    env["PYTHONPATH"] = PYDIR + os.pathsep + env.get("PYTHONPATH", "")
    env["STITCH_ALLOC_LIB"] = libpath
    if conf is None:
        env.pop("STITCH_ALLOC_CONF", None)
    else:
        env["STITCH_ALLOC_CONF"] = conf
    return env
