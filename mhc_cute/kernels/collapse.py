"""``mhc_collapse`` on CuTe DSL (SPEC steps 6-7 with the given gates): one CTA per token.

The collapse and the norm are the big fuse's (``big_fuse.BigFusePhase``, shaped for one token: ``load_batch``,
``collapse_batch``, ``group_sum``, ``normalise_batch``), with the token's 4 gates read from ``pre_mix`` instead of
derived from the mixes. The CTA has enough threads that each thread's 8-vectors of the row fit one batch of 4 loads
in flight (the big fuse's "lat" shape), so the collapse costs one memory round trip; with the norm the rounded row
stays in registers for the second pass. One pass over 10H + 16 bytes per token.

With the norm, the weight's 8-vectors can be loaded before ``griddepcontrol_wait`` and held in registers
(``prefetch_norm``), which takes a round trip off each CTA but holds registers through the row's loads; at large H
the registers cost a resident CTA per SM, so ``run_collapse`` prefetches up to ``PREFETCH_NORM_MAX_H`` (measured:
``docs/experiments.md``).
"""

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Float32  # noqa: E402

from ..tactics import HC_MULT  # noqa: E402
from . import CompiledKernels, compile_in_processes, compile_kernel, cute_dtype, fake_tensors  # noqa: E402
from . import device_utils as du  # noqa: E402
from .big_fuse import BigFusePhase  # noqa: E402

BATCH = 4  # 8-vectors per thread in flight together
PREFETCH_NORM_MAX_H = 5120  # the largest H whose collapse prefetches the norm weight (measured at 5120 and 7168)


def prefetches_norm(hidden: int) -> bool:
    """Whether the collapse at this H holds the norm weight in registers from the start (``run_collapse``'s rule)."""
    return hidden <= PREFETCH_NORM_MAX_H


def collapse_threads(hidden: int) -> int:
    """Threads of the CTA: each thread one batch of ``BATCH`` 8-vectors of the row, at least 64."""
    return du.batch_threads(hidden, BATCH, 1024)


class CollapseKernel:
    """``out [M, H] = collapse(residual [M, 4H], pre_mix [M, 4])`` (+ RMSNorm with ``norm_weight``); static H,
    norm dtype and ``prefetch_norm`` (the norm weight held in registers from the start, where the phase can)."""

    def __init__(self, hidden: int, norm_dtype, prefetch_norm: bool = True):
        self.hidden = hidden
        self.norm_dtype = norm_dtype
        self.phase = BigFusePhase(hidden, 1, 1, collapse_threads(hidden), norm_dtype, BATCH)
        self.phase.prefetch_norm = self.phase.prefetch_norm and prefetch_norm
        assert self.phase.batches <= 2  # compile-time batch indices below

    @cute.jit
    def __call__(self, residual: cute.Tensor, pre_mix: cute.Tensor, norm_weight, out: cute.Tensor, norm_eps: Float32,
                 stream):
        m, h = residual.shape[0], self.hidden
        mRes = cute.make_tensor(residual.iterator, du.row_major(m, HC_MULT * h))
        mPre = cute.make_tensor(pre_mix.iterator, du.row_major(m, HC_MULT))
        mOut = cute.make_tensor(out.iterator, du.row_major(m, h))
        self.kernel(mRes, mPre, norm_weight, mOut, norm_eps).launch(
            grid=[m, 1, 1], block=[self.phase.threads, 1, 1], stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, mRes: cute.Tensor, mPre: cute.Tensor, mNormW, mOut: cute.Tensor, norm_eps: Float32):
        phase = self.phase
        tidx, _, _ = cute.arch.thread_idx()
        m, _, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        scratch = smem.allocate_tensor(Float32, du.row_major(phase.warps), 16)
        # the norm weight is a weight, never written by the grid before: loaded before waiting for it
        norm_w = phase.load_norm_weights(mNormW) if cutlass.const_expr(phase.prefetch_norm) else None
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        row_res, row_out = du.token_row(mRes, m), du.token_row(mOut, m)
        batches = [phase.load_batch(b, tidx, row_res) for b in range(phase.batches)]
        pre = [mPre[m, j] for j in range(HC_MULT)]
        rounded = cute.make_rmem_tensor((phase.slots if phase.keep_rounded else 1, du.VEC_BF16), Float32)
        sumsq = Float32(0.0)
        valid = m < mOut.shape[0]
        for b in cutlass.range_constexpr(phase.batches):
            sumsq = phase.collapse_batch(b, tidx, valid, batches[b], pre, row_out, rounded, sumsq)
        if cutlass.const_expr(self.norm_dtype is not None):
            phase.normalise_row(tidx, phase.group_sum(sumsq, scratch, 0), norm_eps, mNormW, row_out, rounded, norm_w)


_compiled = CompiledKernels("mhc_collapse", "collapse.py")


def compiled_collapse(residual, pre_mix, norm_weight, out, prefetch_norm: bool = True):
    hidden = residual.shape[2]
    norm = None if norm_weight is None else norm_weight.dtype
    prefetch_norm = prefetch_norm and norm is not None
    return _compiled.get((hidden, norm, prefetch_norm),
                         lambda: compile_collapse(residual, pre_mix, norm_weight, out, prefetch_norm))


def compile_collapse(residual, pre_mix, norm_weight, out, prefetch_norm: bool = True):
    """Compile ``CollapseKernel`` against fake tensors shaped like the flat operands (symbolic M)."""
    m = cute.sym_int()
    norm_dtype = None if norm_weight is None else cute_dtype(norm_weight.dtype)
    kernel = CollapseKernel(residual.shape[2], norm_dtype, prefetch_norm)
    res, pre, out_t = fake_tensors(residual, pre_mix, out, tokens=m)
    (norm,) = fake_tensors(norm_weight)
    return compile_kernel(kernel, res, pre, norm, out_t, Float32(0.0))


def run_collapse(residual, pre_mix, norm_weight, norm_eps, out) -> None:
    """``mhc_cute.ops`` backend entry: flat ``residual [M, 4, H]``, ``pre_mix [M, 4]``, ``norm_weight [H]`` or None
    into ``out [M, H]``."""
    fn = compiled_collapse(residual, pre_mix, norm_weight, out, prefetches_norm(residual.shape[2]))
    fn(residual, pre_mix, norm_weight, out, norm_eps)


def spec_operands(hidden: int, norm: str | None):
    """One-token CPU operands (``norm``: None or a torch dtype name): enough to compile, no GPU needed."""
    import torch

    bf16 = torch.bfloat16
    norm_weight = None if norm is None else torch.empty(hidden, dtype=getattr(torch, norm.removeprefix("torch.")))
    return (torch.empty(1, HC_MULT, hidden, dtype=bf16), torch.empty(1, HC_MULT), norm_weight,
            torch.empty(1, hidden, dtype=bf16))


def _compile_spec(spec) -> tuple:
    hidden, norm, *prefetch = spec
    compiled_collapse(*spec_operands(hidden, norm), prefetch[0] if prefetch else prefetches_norm(hidden))
    return spec


def precompile(specs, processes: int | None = None) -> list:
    """Compile (and with ``$MHC_CUTE_KERNEL_CACHE`` persist) the (H, norm dtype name or None[, prefetch_norm])
    variants in worker processes (``prefetch_norm``, moot without a norm: ``run_collapse``'s choice when left out)."""
    return compile_in_processes(_compile_spec, specs, processes)
