import contextlib
import fcntl
import importlib.util
import os
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

# Without a GPU the Triton backend runs under Triton's CPU interpreter; the variable is read when kernels are
# decorated (at import), so it is set before any test module imports mhc_cute.triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# CuTe DSL targets sm_100a when it sees no GPU; our kernels are sm_90a. Must be set before `import cutlass`.
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")


LARGE_M = 4096  # GPU tests from this many tokens hold the most memory (inputs, outputs, the float64 checks' chunks)
LARGE_M_SLOTS = 3  # at most this many of them at once across pytest-xdist's workers (the GPU's memory)


MAX_AUTO_WORKERS = 8  # `-n auto` on a many-core machine: each worker imports torch, CuTe DSL and Triton


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    return max(1, min(MAX_AUTO_WORKERS, len(os.sched_getaffinity(0))))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    """With ``$MHC_CUTE_FAILURES`` set, each failure is appended to that file as it happens (by the xdist controller
    only, or the one process): a GPU run stopped at its time limit keeps the reasons pytest prints at the end."""
    path = os.environ.get("MHC_CUTE_FAILURES")
    if path and report.failed and "PYTEST_XDIST_WORKER" not in os.environ:
        with open(path, "a") as f:
            f.write(f"== {report.nodeid} ({report.when})\n{report.longreprtext}\n")


def _is_large(item) -> bool:
    params = getattr(getattr(item, "callspec", None), "params", {})
    return max(params.get("m", 0), params.get("first_past", 0)) >= LARGE_M or "2_31" in item.name


@contextlib.contextmanager
def _large_m_slot():
    """One of ``LARGE_M_SLOTS`` lock files, held while a large-M test runs: under ``pytest -n 8`` eight of them at once
    would not fit in the GPU's memory; the workers are processes, so the slots are file locks."""
    folder = Path(tempfile.gettempdir()) / "mhc_cute_test_slots"
    folder.mkdir(exist_ok=True)
    while True:
        for i in range(LARGE_M_SLOTS):
            f = open(folder / f"slot{i}", "w")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                f.close()
                continue
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
                f.close()
            return
        time.sleep(0.1)


@pytest.fixture(autouse=True)
def share_the_gpu(request):
    """GPU tests under ``pytest -n N`` share one GPU: the large-M ones take a slot (``_large_m_slot``), and after each
    test the memory torch's caching allocator keeps is given back for the other workers."""
    if "gpu" not in request.keywords or not torch.cuda.is_available():
        yield
        return
    with _large_m_slot() if _is_large(request.node) else contextlib.nullcontext():
        yield
    torch.cuda.empty_cache()


@pytest.fixture(scope="session")
def cuobjdump():
    """Path of the cuobjdump that Triton's NVIDIA backend bundles (reads the SASS and resource usage of a cubin)."""
    triton = pytest.importorskip("triton")
    exe = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(exe):
        pytest.skip("no cuobjdump (triton's) to read the SASS and resource usage")
    return exe


@pytest.fixture(scope="session")
def dump_env():
    """``dump_env(dump_dir, keep)``: the environment of a subprocess that compiles CuTe kernels for sm_90a for real
    (no persisted kernel cache: loading a cached object dumps nothing) and keeps ``keep`` ("ptx,cubin") files in
    ``dump_dir``, with the repository and tests/ importable."""
    tests = os.path.dirname(os.path.abspath(__file__))

    def make(dump_dir, keep: str = "ptx,cubin") -> dict:
        env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP=keep, CUTE_DSL_DUMP_DIR=str(dump_dir))
        env.pop("MHC_CUTE_KERNEL_CACHE", None)
        env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(tests), tests, env.get("PYTHONPATH", "")])
        return env
    return make


BENCH = Path(__file__).resolve().parents[1] / "bench"


@contextlib.contextmanager
def bench_script(relative: str):
    """A script of ``bench/`` loaded as a module, registered in ``sys.modules`` while in use (its dataclasses resolve
    their annotations through it)."""
    name = Path(relative).stem
    spec = importlib.util.spec_from_file_location(name, BENCH / relative)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[name]
