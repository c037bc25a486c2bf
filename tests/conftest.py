import contextlib
import importlib.util
import os
import sys
import zlib
from pathlib import Path

import pytest
import torch

# Without a GPU the Triton backend runs under Triton's CPU interpreter; the variable is read when kernels are
# decorated (at import), so it is set before any test module imports mhc_cute.triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# CuTe DSL targets sm_100a when it sees no GPU; our kernels are sm_90a. Must be set before `import cutlass`.
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")


LARGE_M = 4096  # GPU tests from this many tokens hold up to ~20 GB each (float64 checks)
LARGE_M_WORKERS = 3  # at most this many of them at once: ~60 GB of an H200's 140


@pytest.hookimpl(tryfirst=True)  # before xdist's worker hook, which reads the groups into the node ids
def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        # under ``pytest -n N --dist loadgroup`` the large tests go to LARGE_M_WORKERS workers, so that eight of
        # them never hold the GPU's memory at once (out of memory on the H200 with -n 8, 2026-12-04)
        for item in items:
            params = getattr(getattr(item, "callspec", None), "params", {})
            if "gpu" in item.keywords and (params.get("m", 0) >= LARGE_M or "2_31" in item.name):
                group = zlib.crc32(item.nodeid.encode()) % LARGE_M_WORKERS
                item.add_marker(pytest.mark.xdist_group(f"large_m_{group}"))
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def release_cached_gpu_memory(request):
    """After each GPU test, the memory torch's caching allocator keeps is given back: under ``pytest -n N`` the
    workers' processes share the GPU, and blocks one keeps cached are memory the others cannot have."""
    yield
    if "gpu" in request.keywords and torch.cuda.is_available():
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
