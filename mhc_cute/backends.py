"""The backend registry: what each backend is, where it lives, and whether it can run on a device.

Backends are imported lazily so that ``import mhc_cute`` works on any machine (no GPU, no CuTe DSL, no Triton).
Each backend exposes ``prepare(problem: Problem, tactic, out: MhcFusedHcOutput) -> launch``. ``prepare`` resolves
once what depends only on the call's signature (op, form, shapes, dtypes, device, scalars, precision): its tactic,
compiled kernels, scratch sizes (``problem`` and ``out`` are one call's tensors of that signature).
``launch(inputs, out)`` reads the flattened operands ``inputs`` (``Problem.inputs``) of any call of that signature
and writes every element of its flattened output buffers ``out`` (which the dispatcher allocates, and which never
alias an input). ``tactic`` is None (the backend chooses) or a backend-specific tactic.
A backend's one ``prepare`` runs every op (``problem.op``: ``"fused_hc"``, ``"fused_hc_delayed"``) in every seam form
(``problem.form``: ``"regular"``, ``"no_post"``, ``"broadcast"``; compile-time flags of the same kernels), at the H
multiples ``Backend.h_multiple_for`` names.
"""

from __future__ import annotations

import functools
import importlib
import os
from dataclasses import dataclass

import torch

from .reference import fused_hc, fused_hc_delayed, row_chunks
from .tactics import FMA_BUCKETS, FmaTactic, MmaTactic
from .tactics import parse_tactic as parse_cute_tactic
from .triton.configs import TritonTactic, parse_triton_tactic


@dataclass(frozen=True)
class Backend:
    name: str
    entry: str  # "module:function": prepare(problem, tactic, out) -> launch(inputs, out), for every op and form
    kind: str  # "reference" | "cute" | "triton"
    summary: str
    h_multiple: int = 1  # kernel backends tile H by 64
    broadcast_h_multiple: int = 1  # the broadcast entry's H multiple where larger (paths E/F walk H / 4 in chunks)

    def h_multiple_for(self, form: str) -> int:
        """The multiple of H this backend runs seam ``form`` at."""
        return max(self.h_multiple, self.broadcast_h_multiple) if form == "broadcast" else self.h_multiple

    def load(self):
        """The backend's ``prepare``."""
        return load_entry(self.entry)


# paths E/F's broadcast entry: H / 4 in whole 64-position chunks (``tactics.fma_broadcast_tactic``)
FMA_BROADCAST_H = 256


# torch.cuda.current_device() without its Python checks (an eager call asks it once per launch)
current_cuda_device = getattr(torch._C, "_cuda_getDevice", None)


def call_on(device_index: int | None, fn, *args):
    """``fn(*args)`` with CUDA device ``device_index`` current (None: not a CUDA call, run as is): Triton and the
    TVM-FFI launches use the current device and its stream."""
    if device_index is None or device_index == current_cuda_device():
        return fn(*args)
    with torch.cuda.device(device_index):
        return fn(*args)


BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend("torch", "mhc_cute.backends:prepare_reference", "reference", "plain torch, fp32 compute, any device"),
        Backend("triton", "mhc_cute.triton.fused_hc:prepare", "triton",
                "Triton main + reduce kernels (ROCm gfx950 design; NVIDIA; CPU interpreter)", 64),
        Backend("half_fma", "mhc_cute.kernels.fma:prepare_half_fma", "cute",
                "path E: CuTe DSL, FFMA projection + big-fuse kernel (2 launches)", 64,
                broadcast_h_multiple=FMA_BROADCAST_H),
        Backend("all_fma", "mhc_cute.kernels.fma:prepare_all_fma", "cute",
                "path F: CuTe DSL, FFMA projection, last-CTA big fuse (1 launch)", 64,
                broadcast_h_multiple=FMA_BROADCAST_H),
        Backend("half_mma", "mhc_cute.kernels.mma:prepare_half_mma", "cute",
                "path B: CuTe DSL, TF32 wgmma projection + big-fuse kernel (2 launches)", 64),
        Backend("all_mma", "mhc_cute.kernels.mma:prepare_all_mma", "cute",
                "path D: CuTe DSL, TF32 wgmma projection, last-CTA big fuse (1 launch)", 64),
    )
}


def parse_tactic(backend: str, name: str | None):
    """The tactic of ``backend`` named ``name`` (None: the backend's own default); ValueError if it names none of
    that backend's."""
    if name is None:
        return None
    if backend == "triton":
        return parse_triton_tactic(name)
    tactic = parse_cute_tactic(name)
    if tactic.path != backend:
        raise ValueError(f"tactic {name!r} is one of backend {tactic.path!r}, not of {backend!r}")
    return tactic


def checked_tactic(backend: str, tactic):
    """``tactic`` (None, a tactic object or its name) as backend ``backend`` (a registered one) runs it; ValueError
    when it is not one of that backend's."""
    if tactic is None or isinstance(tactic, str):
        return parse_tactic(backend, tactic)
    if backend == "triton":
        ok = isinstance(tactic, TritonTactic)
    else:
        ok = isinstance(tactic, (FmaTactic, MmaTactic)) and tactic.path == backend
    if not ok:
        kinds = {"torch": "none (it has no tactics)", "triton": "a TritonTactic or its name"}
        raise ValueError(f"backend {backend!r} takes {kinds.get(backend, 'one of its tactics or a name')}; "
                         f"got {tactic!r}")
    return tactic


@functools.lru_cache(maxsize=None)
def load_entry(entry: str):
    """The function an entry ("module:function") names, imported on first use."""
    module, func = entry.split(":")
    return getattr(importlib.import_module(module), func)


def prepare_reference(problem, tactic, out):
    """Every op and form in plain torch (fp32); no post: ``out.residual_cur`` is None, nothing to write."""
    op = fused_hc_delayed if problem.delayed else fused_hc
    delayed, scalars = problem.delayed, problem.scalars.as_kwargs()

    per_token = 5 if delayed else 4  # x, residual, post_mix, comb_mix (, pre_mix): a row per token; then weights

    def launch(inputs, out):
        *tensors, norm_weight, pre_mix = inputs
        if delayed:
            tensors[4:4] = [pre_mix]
        residual = tensors[1]
        for rows in row_chunks(residual.shape[0], residual.shape[-1]):
            args = [t if t is None or i >= per_token else t[rows] for i, t in enumerate(tensors)]
            result = op(*args, norm_weight=norm_weight, compute_dtype=torch.float32, **scalars)
            for dst, src in zip(out, result):
                if dst is not None:
                    dst[rows].copy_(src)
    return launch


@functools.lru_cache(maxsize=None)
def _module_missing(kind: str) -> str | None:
    """Why a backend family cannot be imported here (None when it can)."""
    try:
        if kind == "cute":
            importlib.import_module("cutlass.cute")
            importlib.import_module("tvm_ffi")
        elif kind == "triton":
            importlib.import_module("triton")
    except Exception as e:  # any import failure means unavailable, with the reason shown
        return f"{type(e).__name__}: {e}"
    return None


def unavailable_reason(name: str, device: torch.device) -> str | None:
    """None if backend ``name`` can run on ``device``, else a short reason (cached: it is on the hot path)."""
    cpu = device.type == "cpu"  # the interpreter flag matters for CPU tensors only (an environment read costs µs)
    return _unavailable_reason(name, device.type, device.index, cpu and os.environ.get("TRITON_INTERPRET") == "1")


@functools.lru_cache(maxsize=None)
def _unavailable_reason(name: str, device_type: str, device_index, interpret: bool) -> str | None:
    b = BACKENDS[name]
    if b.kind == "reference":
        return None
    if b.kind == "cute":
        if device_type != "cuda" or torch.version.hip is not None:
            return "needs an NVIDIA GPU"
        if torch.cuda.get_device_capability(device_index) != (9, 0):
            return "needs sm_90 (Hopper)"
    if b.kind == "triton" and device_type != "cuda" and not (device_type == "cpu" and interpret):
        return "needs a CUDA/ROCm GPU, or TRITON_INTERPRET=1 for CPU tensors"
    return _module_missing(b.kind)


def available(device: torch.device) -> list[str]:
    """The seam backends that can run on ``device``."""
    return [n for n in BACKENDS if unavailable_reason(n, device) is None]


def _is_rocm() -> bool:
    return torch.version.hip is not None


# the heuristic's path E as far as its default tactic projects on warp MMA (M = 128), path B above
HEURISTIC_FMA_MAX_M = max(m for m, _, mma_tokens in FMA_BUCKETS if mma_tokens)


def pick_auto(device: torch.device, m: int, hidden: int) -> str:
    """The backend that ``backend="auto"`` uses when no tuned table applies (another GPU, another H): a
    heuristic by M.

    The ranking that ``mhc-cute tune`` measured on an H200 at H = 4096, 5120 and 7168 (``mhc_cute/tuned``): the
    FMA path E up to M = 128 (its default tactic projects on warp MMA from M = 9), the tensor-core path B above;
    Triton where the CuTe paths cannot run (ROCm, or no sm_90). ``MHC_CUTE_BACKEND`` overrides it, in
    ``selector.Selector.resolve``.
    """
    if device.type == "cuda" and hidden % 64 == 0:
        if _is_rocm():
            order = ("triton",)
        elif m <= HEURISTIC_FMA_MAX_M:
            order = ("half_fma", "half_mma", "triton")
        else:
            order = ("half_mma", "half_fma", "triton")
        for name in order:
            if unavailable_reason(name, device) is None:
                return name
    return "torch"


def pick_auto_for(device: torch.device, form: str, hidden: int) -> str:
    """``backend="auto"`` for a seam form at an H where the V4 seam's tuned pick cannot run it (the broadcast entry on
    paths E/F at H % 256 != 0): path B, else Triton, on a GPU; else the reference."""
    for name in ("half_mma", "triton"):
        b = BACKENDS[name]
        if device.type == "cuda" and hidden % b.h_multiple_for(form) == 0 and unavailable_reason(name, device) is None:
            return name
    return "torch"
