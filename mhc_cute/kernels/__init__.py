"""CuTe DSL kernels (sm_90a) and the host-side helpers their wrappers share.

Modules: ``device_utils`` (device helpers), ``big_fuse`` (SPEC steps 2-7, standalone kernel and device
phase), ``fma`` (paths E and F), ``mma`` and ``wgmma_tf32`` (paths B and D), ``post`` and ``collapse`` (the
standalone ops), ``launch`` (the per-call launch of the seams' kernels, host code only). The helpers below build
the fake tensors a kernel is compiled against, compile it for the TVM-FFI launch path and cache the result
(``CompiledKernels``). CuTe DSL is imported lazily so that importing this package (as the backend registry does
to find a backend) works on a machine without it.

Compiling a variant takes seconds. With ``MHC_CUTE_KERNEL_CACHE=<dir>`` compiled kernels are also kept as
object files in that directory and loaded from there (about a millisecond) by later processes; the file
names include a hash of the kernel sources that shape that family (every kernel module but the other families'
own modules and the host-only ``launch``, and the modules outside the package whose code shapes a kernel: tactics,
prepared weights) and the CuTe DSL version.
"""

from __future__ import annotations

import functools
import hashlib
import os
import threading
import warnings
from pathlib import Path

from ..tactics import PARTIAL_COLS

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # before the first `import cutlass` anywhere

KERNEL_CACHE_ENV = "MHC_CUTE_KERNEL_CACHE"


def partials_count(tactic, m: int) -> int:
    """Floats of the split-K partials ``[split_k, M, 32]`` a launch of ``tactic`` on ``m`` tokens needs. The kernels
    index them with 32-bit offsets: past 2^31 they would wrap, so such a launch is refused (only a tactic with many
    K splits at hundreds of thousands of tokens gets there; the defaults use one or two splits at such M)."""
    count = tactic.split_k * m * PARTIAL_COLS
    if count >= 2**31:
        raise ValueError(f"tactic {tactic.name}: split_k * M * {PARTIAL_COLS} = {count} partials, more than the "
                         f"kernels' 32-bit offsets reach (2^31); use a tactic with fewer K splits for M = {m}")
    return count


def cute_dtype(torch_dtype):
    """The CuTe numeric type of a torch dtype (the dtypes of this package's operands)."""
    import cutlass
    import torch

    return {torch.bfloat16: cutlass.BFloat16, torch.float32: cutlass.Float32, torch.int32: cutlass.Int32}[torch_dtype]


def norm_dtype_of(norm_weight):
    """The compile-time norm flag: None, or the CuTe dtype of ``norm_weight``."""
    return None if norm_weight is None else cute_dtype(norm_weight.dtype)


def scalar_args(scalars) -> tuple:
    """The runtime scalar arguments, in the order every compiled kernel of this package takes them."""
    return (scalars.rms_eps, scalars.hc_pre_eps, scalars.hc_sinkhorn_eps, scalars.hc_post_mult_value,
            scalars.sinkhorn_repeat, scalars.norm_eps)


def fake_tensors(*tensors, tokens=None, align: int = 16) -> list:
    """Fake CuTe tensors for ``cute.compile`` shaped like the torch ``tensors`` (None stays None).

    Shapes and strides are static, except with ``tokens`` (a ``cute.sym_int()``): then the first dimension
    of every tensor is that symbolic size (the token count M) with a symbolic stride (a size-1 token
    dimension may carry any stride). Base pointers are assumed ``align``-byte aligned (16 lets the kernels use
    16-byte vector accesses; torch allocations are 16-byte aligned).
    """
    import cutlass.cute as cute

    fakes = []
    for t in tensors:
        if t is None:
            fakes.append(None)
            continue
        dtype = cute_dtype(t.dtype)
        shape, stride = tuple(t.shape), tuple(t.stride())
        if tokens is not None:
            row = 1
            for d in t.shape[1:]:
                row *= d
            shape = (tokens,) + shape[1:]
            stride = (cute.sym_int64(divisibility=min(row, 128 // dtype.width)),) + stride[1:]
        fakes.append(cute.runtime.make_fake_tensor(dtype, shape, stride, assumed_align=align))
    return fakes


def fake_buffer(dtype):
    """A fake flat buffer (1-D, symbolic length) of CuTe ``dtype``: a workspace."""
    import cutlass.cute as cute

    return cute.runtime.make_fake_tensor(dtype, (cute.sym_int(),), (1,), assumed_align=16)


def seam_scalars() -> tuple:
    """Fake runtime scalars of a seam kernel, in ``scalar_args`` order (the standalone ops take fewer)."""
    from cutlass import Float32, Int32

    return (Float32(0.0), Float32(0.0), Float32(0.0), Float32(0.0), Int32(0), Float32(0.0))


def compile_kernel(kernel, *fake_args):
    """``cute.compile`` for the TVM-FFI launch path: the fake arguments (tensors, then the runtime scalars the
    kernel takes), then the stream (taken from torch's current stream at call time). Not thread-safe (CuTe DSL
    compilation is not)."""
    import cutlass.cute as cute

    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(kernel, *fake_args, stream, options="--enable-tvm-ffi")


# modules outside this package whose code shapes a compiled kernel: the tactics' derived shapes and constants (the
# partial rows' layout), the prepared weight's layout the tensor-core kernels read
KERNEL_INPUT_MODULES = ("tactics.py", "weights.py")
# modules of this package that compile nothing: the per-call launch (host code only), whose edits keep every file
HOST_MODULES = ("launch.py",)


# the modules that each define one family of compiled kernels and import no other (tests/test_cute_compile.py checks
# it): a family's file names skip the other families' modules, so an edit of one path keeps the others' files valid
FAMILY_MODULES = ("fma.py", "mma.py", "post.py", "collapse.py")


@functools.lru_cache(maxsize=None)
def _sources_digest(family: str | None = None) -> str:
    """A digest of the kernel sources of ``family`` (its module in ``FAMILY_MODULES``; None: every kernel source),
    of ``KERNEL_INPUT_MODULES`` and of the CuTe DSL version: persisted kernels are only reused by the code that built
    them."""
    import cutlass

    here = Path(__file__).parent
    skipped = (set(FAMILY_MODULES) - {family} if family else set()) | set(HOST_MODULES)
    h = hashlib.sha256(getattr(cutlass, "__version__", "?").encode())
    for path in sorted(here.glob("*.py")) + [here.parent / name for name in KERNEL_INPUT_MODULES]:
        if path.parent == here and path.name in skipped:
            continue
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


_compile_lock = threading.Lock()  # cute.compile is not thread-safe


class CompiledKernels:
    """Compiled kernels of one family (``prefix``; ``family``: its module in ``FAMILY_MODULES``, None for kernels
    defined elsewhere, such as the probes), keyed by a tuple of static parameters (hashable, with a stable ``repr``):
    in memory, and as object files under ``$MHC_CUTE_KERNEL_CACHE`` when it is set."""

    def __init__(self, prefix: str, family: str | None = None):
        self.prefix, self.family = prefix, family
        self._fns: dict = {}

    def get(self, key: tuple, build):
        """The compiled kernel for ``key``; ``build()`` compiles it (``compile_kernel``) on a miss."""
        fn = self._fns.get(key)
        if fn is None:
            with _compile_lock:
                fn = self._fns.get(key)
                if fn is None:
                    fn = self._load_or_build(key, build)
                    self._fns[key] = fn
        return fn

    def file_of(self, key: tuple, folder) -> Path:
        """The object file of ``key`` in ``folder``; its stem is also the exported function's name."""
        digest = hashlib.sha256((repr(key) + _sources_digest(self.family)).encode()).hexdigest()[:24]
        return Path(folder) / f"{self.prefix}_{digest}.o"

    def _load_or_build(self, key: tuple, build):
        folder = os.environ.get(KERNEL_CACHE_ENV)
        if not folder:
            return build()
        import cutlass.cute as cute

        path = self.file_of(key, folder)
        name = path.stem
        compiled = None
        if not path.exists():
            compiled = build()
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp.o")
            compiled.export_to_c(str(tmp), function_name=name)
            os.replace(tmp, path)  # atomic: concurrent builders of the same kernel are harmless
        try:
            return getattr(cute.runtime.load_module(str(path), enable_tvm_ffi=True), name)
        except Exception as e:  # a stale or corrupt file is rebuilt once, never fatal
            path.unlink(missing_ok=True)
            if compiled is not None:  # the file was just written: use the kernel in memory rather than loop
                warnings.warn(f"mhc_cute: cannot load {path.name} ({type(e).__name__}: {e}); using it uncached",
                              stacklevel=2)
                return compiled
            warnings.warn(f"mhc_cute: recompiling {path.name} ({type(e).__name__}: {e})", stacklevel=2)
            return self._load_or_build(key, build)


# --- host-side helpers shared by the kernel paths ---------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(device_index).multi_processor_count


def resolve_tactic(path: str, tactic, problem, default):
    """The tactic a path runs: the caller's (a tactic object of ``path``, checked by the API), else
    ``default(path, M, H, SMs)`` (memoised by the caller)."""
    if tactic is None:
        return default(path, problem.m, problem.hidden, sm_count(problem.residual.device.index))
    return tactic


def delayed_mode(problem) -> str | None:
    """The compile-time seam flag of a problem: None (``mhc_fused_hc``), or for ``mhc_fused_hc_delayed``
    ``"carried"`` (the collapse with ``pre_mix_prev``) or ``"identity"`` (``pre_mix_prev`` None: stream 0)."""
    if not problem.delayed:
        return None
    return "identity" if problem.pre_mix is None else "carried"


def spec_problem(hidden: int, precision: str, norm: str | None, delayed: str | None = None, form: str = "regular"):
    """A one-token CPU ``Problem`` with the dtypes of a variant (``delayed``: as ``delayed_mode`` names it; ``form``:
    "regular", "no_post" or "broadcast"): enough to compile it (no GPU needed)."""
    import torch

    from ..problem import Problem, Scalars
    from ..reference import HC_MULT, N_MIXES

    bf16 = torch.bfloat16
    norm_weight = None if norm is None else torch.empty(hidden, dtype=getattr(torch, norm.removeprefix("torch.")))
    pre_mix = torch.empty(1, HC_MULT) if delayed == "carried" else None
    post = form == "regular"
    return Problem(
        torch.empty(1, hidden, dtype=bf16) if post else None,
        torch.empty(1, hidden, dtype=bf16) if form == "broadcast" else torch.empty(1, HC_MULT, hidden, dtype=bf16),
        torch.empty(1, HC_MULT) if post else None, torch.empty(1, HC_MULT, HC_MULT) if post else None,
        torch.empty(N_MIXES, HC_MULT * hidden), torch.empty(3),
        torch.empty(N_MIXES), norm_weight, Scalars(), precision, pre_mix, delayed is not None,
    )


def seam_fakes(problem, out, tokens) -> tuple:
    """The fake ``pre_mix_prev`` and ``pre_mix_cur`` a kernel of the delayed seam is compiled against (None, None
    for ``mhc_fused_hc``; ``pre_mix_prev`` None for the identity)."""
    if not problem.delayed:
        return None, None
    return tuple(fake_tensors(problem.pre_mix, out.pre_mix_cur, tokens=tokens))


def compile_in_processes(worker, specs, processes: int | None = None) -> list:
    """``worker(spec)`` for each distinct spec in spawned processes (``cute.compile`` is not thread-safe); with
    ``$MHC_CUTE_KERNEL_CACHE`` set the workers persist what they compile for later processes to load."""
    import multiprocessing as mp

    specs = list(dict.fromkeys(specs))
    with mp.get_context("spawn").Pool(processes or min(len(specs), os.cpu_count() or 1)) as pool:
        return pool.map(worker, specs, chunksize=1)
