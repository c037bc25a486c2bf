"""``mhc_post`` on CuTe DSL (SPEC step 1 alone): a streaming kernel, one thread per (token, 8 H positions).

Each thread issues all its loads at once (the token's 4 post and 16 comb coefficients as 16-byte fp32 vectors, L1 hits
after the token's first warp; ``x`` and the 4 ``residual`` vectors as 16-byte bf16 vectors), runs the post-map chain
of the seam kernels (``device_utils.post_element``: the same bits) and stores the 4 output vectors (16 bytes each):
one pass over 18H + 80 bytes per token. Small M gives a few CTAs (one memory round trip each); large M gives many
small CTAs, enough for every SM to keep its loads in flight.
"""

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import BFloat16, Float32  # noqa: E402

from ..tactics import HC_MULT  # noqa: E402
from . import CompiledKernels, compile_in_processes, compile_kernel, fake_tensors  # noqa: E402
from . import device_utils as du  # noqa: E402

THREADS = 128


class PostKernel:
    """``residual_cur [M, 4H] = post-map(x [M, H], residual [M, 4H], post [M, 4], comb [M, 16])``; static H."""

    def __init__(self, hidden: int, threads: int = THREADS):
        assert hidden % du.VEC_BF16 == 0
        self.hidden = hidden
        self.octets = hidden // du.VEC_BF16
        self.threads = threads

    @cute.jit
    def __call__(self, x: cute.Tensor, residual: cute.Tensor, post_mix: cute.Tensor, comb_mix: cute.Tensor,
                 out: cute.Tensor, stream):
        m, h = x.shape[0], self.hidden
        mX = cute.make_tensor(x.iterator, du.row_major(m, h))
        mRes = cute.make_tensor(residual.iterator, du.row_major(m, HC_MULT * h))
        mPost = cute.make_tensor(post_mix.iterator, du.row_major(m, HC_MULT))
        mComb = cute.make_tensor(comb_mix.iterator, du.row_major(m, HC_MULT * HC_MULT))
        mOut = cute.make_tensor(out.iterator, du.row_major(m, HC_MULT * h))
        self.kernel(mX, mRes, mPost, mComb, mOut).launch(
            grid=[cute.ceil_div(m * self.octets, self.threads), 1, 1], block=[self.threads, 1, 1], stream=stream,
            use_pdl=True)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mRes: cute.Tensor, mPost: cute.Tensor, mComb: cute.Tensor, mOut: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        m_total = mX.shape[0]
        task = bidx * self.threads + tidx
        # clamped: the tail threads load a valid vector and store nothing
        m = cutlass.min(task // self.octets, m_total - 1)
        o = task % self.octets
        # launched with programmatic dependent launch: every input may come from the grid before
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        coefs = cute.make_rmem_tensor((HC_MULT + HC_MULT * HC_MULT,), Float32)
        row_post, row_comb = du.token_row(mPost, m), du.token_row(mComb, m)
        cute.autovec_copy(cute.local_tile(row_post, (du.VEC_F32,), (0,)), cute.local_tile(coefs, (du.VEC_F32,), (0,)))
        for q in cutlass.range_constexpr(HC_MULT):
            cute.autovec_copy(cute.local_tile(row_comb, (du.VEC_F32,), (q,)), cute.local_tile(coefs, (du.VEC_F32,), (1 + q,)))
        raw = cute.make_rmem_tensor(du.row_major(1 + HC_MULT, du.VEC_BF16), BFloat16)
        cute.autovec_copy(cute.local_tile(du.token_row(mX, m), (du.VEC_BF16,), (o,)), raw[0, None])
        row_res = du.token_row(mRes, m)
        for k in cutlass.range_constexpr(HC_MULT):
            cute.autovec_copy(cute.local_tile(row_res, (du.VEC_BF16,), (k * self.octets + o,)), raw[1 + k, None])
        if task < m_total * self.octets:
            xv = du.widen_bf16x8(raw[0, None])
            res = [du.widen_bf16x8(raw[1 + k, None]) for k in range(HC_MULT)]
            row_out = du.token_row(mOut, m)
            for j in cutlass.range_constexpr(HC_MULT):
                comb_col = [coefs[HC_MULT + HC_MULT * k + j] for k in range(HC_MULT)]
                vals = cute.make_rmem_tensor((du.VEC_BF16,), Float32)
                for e in cutlass.range_constexpr(du.VEC_BF16):
                    vals[e] = du.post_element(coefs[j], xv[e], comb_col, [res[k][e] for k in range(HC_MULT)])
                du.store_bf16x8(cute.local_tile(row_out, (du.VEC_BF16,), (j * self.octets + o,)), vals.load())


_compiled = CompiledKernels("mhc_post", "post.py")


def compiled_post(hidden: int, x, residual, post_mix, comb_mix, out):
    return _compiled.get((hidden,), lambda: compile_post(hidden, x, residual, post_mix, comb_mix, out))


def compile_post(hidden: int, x, residual, post_mix, comb_mix, out):
    """Compile ``PostKernel`` for ``hidden`` against fake tensors shaped like the flat operands (symbolic M)."""
    m = cute.sym_int()
    return compile_kernel(PostKernel(hidden), *fake_tensors(x, residual, post_mix, comb_mix, out, tokens=m))


def run_post(x, residual, post_mix, comb_mix, out) -> None:
    """``mhc_cute.ops`` backend entry: flat ``x [M, H]``, ``residual [M, 4, H]``, ``post_mix [M, 4]``,
    ``comb_mix [M, 4, 4]`` into ``out [M, 4, H]``."""
    fn = compiled_post(x.shape[1], x, residual, post_mix, comb_mix, out)
    fn(x, residual, post_mix, comb_mix, out)


def spec_operands(hidden: int):
    """One-token CPU operands of ``hidden`` (enough to compile; no GPU needed)."""
    import torch

    bf16 = torch.bfloat16
    return (torch.empty(1, hidden, dtype=bf16), torch.empty(1, HC_MULT, hidden, dtype=bf16), torch.empty(1, HC_MULT),
            torch.empty(1, HC_MULT, HC_MULT), torch.empty(1, HC_MULT, hidden, dtype=bf16))


def _compile_spec(hidden: int) -> int:
    compiled_post(hidden, *spec_operands(hidden))
    return hidden


def precompile(hiddens, processes: int | None = None) -> list[int]:
    """Compile (and with ``$MHC_CUTE_KERNEL_CACHE`` persist) the kernel for each H in worker processes."""
    return compile_in_processes(_compile_spec, hiddens, processes)


