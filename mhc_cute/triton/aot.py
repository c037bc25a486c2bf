"""Ahead-of-time compilation of the Triton kernels for a target GPU on any machine (Triton's own compilers;
no GPU needed): the tests use it to check that every architecture's tactics compile,
``bench/probes/triton_registers.py`` to read the resource usage of the NVIDIA build.

Must run outside the CPU interpreter (``TRITON_INTERPRET`` unset), since ``fused_hc`` reads that at import.
"""

from __future__ import annotations

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from . import fused_hc as F
from .configs import TritonTactic

TARGETS = {
    "sm90": GPUTarget("cuda", 90, 32),
    "gfx950": GPUTarget("hip", "gfx950", 64),
    "gfx942": GPUTarget("hip", "gfx942", 64),
}
_FLOAT_SCALARS = ("rms_eps", "pre_eps", "sinkhorn_eps", "post_mult", "norm_eps")


def _compile(fn, consts: dict, target: GPUTarget, num_warps: int, num_stages: int = 1, **options):
    """``fn`` specialised on ``consts``, pointer arguments (and H) 16-byte divisible as at run time."""
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            continue
        if name == "w_ptr":  # the weight's bf16 terms for the tensor-core projection, else fn itself
            sig[name] = "*bf16" if consts.get("USE_DOT") else "*fp32"
        elif name.endswith("_ptr"):
            sig[name] = "*bf16" if "res" in name or name in ("x_ptr", "li_ptr", "norm_ptr") else "*fp32"
        else:
            sig[name] = "fp32" if name in _FLOAT_SCALARS else "i32"
    aligned = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, ty in sig.items() if ty[0] == "*" or n == "H"}
    sig.update({name: "constexpr" for name in consts})
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=aligned)
    return triton.compile(src, target=target, options=dict(num_warps=num_warps, num_stages=num_stages, **options))


# the main kernel's form flags of mhc_fused_hc's regular seam (``compile_main``'s ``form`` overrides them)
REGULAR_FORM = dict(HAS_POST=True, BROADCAST=False, DELAYED=False, IDENTITY=False, HAS_NORM=False)


def compile_main(t: TritonTactic, target: GPUTarget, form: dict | None = None, **options):
    """The main kernel of tactic ``t`` (``form``: flags that differ from ``REGULAR_FORM``, e.g. ``DELAYED=True``;
    ``options``: extra Triton compile options, e.g. ``maxnreg``)."""
    consts = dict(BLOCK_M=t.block_m, BLOCK_H=t.block_h, USE_DOT=t.uses_dot, **{**REGULAR_FORM, **(form or {})})
    return _compile(F._main_kernel, consts, target, t.num_warps, t.num_stages, **options)


def compile_reduce(t: TritonTactic, hidden: int, norm: bool, target: GPUTarget, delayed: bool = False,
                   broadcast: bool = False):
    """The reduce kernel of tactic ``t`` at hidden size ``hidden`` (of the delayed seam, of the broadcast entry)."""
    consts = dict(S_POW2=triton.next_power_of_2(t.split_k), BLOCK_T=t.reduce_block_t, BLOCK_H=t.reduce_block_h,
                  SINGLE_TILE=t.reduce_block_h >= hidden, HAS_NORM=norm, RMS_STREAMS=1 if broadcast else 4,
                  DELAYED=delayed)
    return _compile(F._reduce_kernel, consts, target, t.reduce_warps)
