"""Is path B's kernel 1 bound by its memory traffic or by its work? On the GPU, in one process: ``half_mma`` (kernel
1 + big fuse) of a tactic against the same two kernels with kernel 1's consumer warps replaced by a plain copy of
each stage's residual tile to ``residual_cur`` (the same TMA loads of ``residual_prev``, ``x_prev`` and the weight,
the same 16-byte stores; no post-map arithmetic, no MMA, no partials, so its results are garbage: the big fuse
then reads stale partials, which leaves its memory traffic unchanged). CUDA-graph replay over rotated inputs,
median µs per call and % of SPEC's floor, alternating the two a few times.

    python bench/probes/probe_k1_copy.py --hidden 7168 --m 2048 8192 --tactic half_mma:k2:m64:s3:fbw
    python bench/probes/probe_k1_copy.py --once 8192 7168 ...   # one call of each (for ncu)
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

# mhc_cute.kernels first: it sets the DSL's target architecture before cutlass is imported
from mhc_cute.kernels import compile_kernel, fake_buffer, fake_tensors, mma, scalar_args, seam_scalars  # noqa: E402
from mhc_cute.kernels import device_utils as du  # noqa: E402

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
import cutlass.pipeline as pipeline  # noqa: E402
from cutlass import BFloat16, Float32, Int32  # noqa: E402

from mhc_cute import benchmark as mb  # noqa: E402
from mhc_cute.accuracy import poisoned_outputs, problem_of  # noqa: E402
from mhc_cute.tactics import HC_MULT, MMA_BLOCK_H, MMA_WG_THREADS, PARTIAL_COLS, parse_tactic  # noqa: E402
from mhc_cute.workspace import get_workspace  # noqa: E402


class CopyOnlyKernel(mma.MmaFusedHcKernel):
    """Kernel 1 whose consumers only copy the stage's residual tile out (same rows, streams and vectors)."""

    @cute.jit
    def consume(self, ab_pipeline, tiled_mma, sRes, sX, sW, mPost, mComb, mPre, mResOut, mLayerIn, mPartials, tidx,
                m_tile, split, blk_begin, n_blk):
        m_total = mResOut.shape[0]
        wg, wg_tid, lane = tidx // MMA_WG_THREADS, tidx % MMA_WG_THREADS, tidx % 32
        quad = lane % 4
        row0 = wg * 64 + (wg_tid // 32) * 16 + lane // 4
        rows = (row0, row0 + 8)
        out = cute.make_rmem_tensor((du.VEC_BF16,), BFloat16)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        for i in cutlass.range(n_blk, unroll=1):
            vec_idx = (blk_begin + i) * (MMA_BLOCK_H // du.VEC_BF16) + quad
            ab_pipeline.consumer_wait(state)
            for j in cutlass.range_constexpr(HC_MULT):
                for r in cutlass.range_constexpr(2):
                    cute.autovec_copy(self._vec(sRes[(rows[r], j, None, state.index)], quad), out)
                    m = m_tile * self.tile_m + rows[r]
                    if m < m_total:
                        cute.autovec_copy(out, self._vec(mResOut[(m, j, None)], vec_idx))
            ab_pipeline.consumer_release(state)
            state.advance()


def compile_variant(make_kernel, problem, out):
    """``mma.compile_mma``'s fake arguments for the kernel object ``make_kernel()`` (kernel 1's class or a probe's
    variant of it; no GPU needed)."""
    h = problem.hidden
    kernel = make_kernel()
    m = cute.sym_int()
    tokens = fake_tensors(problem.x, problem.residual, problem.post_mix, problem.comb_mix, tokens=m)
    weight, = fake_tensors(torch.empty(h // MMA_BLOCK_H, HC_MULT, kernel.n, MMA_BLOCK_H))
    scale, base = fake_tensors(problem.hc_scale, problem.hc_base, align=4)
    return compile_kernel(kernel, *tokens, weight, scale, base, None, *fake_tensors(*out, tokens=m),
                          fake_buffer(Float32), fake_buffer(Int32), None, None, *seam_scalars())


def launcher(tactic, problem, make_kernel):
    """A call(inputs, poison=False) -> outputs of the compiled ``make_kernel()`` at ``problem``'s precision (fresh
    outputs each call; NaN-filled first with ``poison``, for a check: not in timed calls, which would time the fill)."""
    fn = compile_variant(make_kernel, problem, problem.empty_outputs())

    def call(s, poison=False):
        p = problem_of(s, problem.precision)
        out = poisoned_outputs(p) if poison else p.empty_outputs()
        ws = get_workspace(p.x.device)
        parts = ws.partials(tactic.split_k * p.m * PARTIAL_COLS)
        counters = ws.counters(-(-p.m // tactic.tile_m))
        fn(p.x, p.residual, p.post_mix, p.comb_mix, mma.cached_weight(p.fn, p.precision), p.hc_scale, p.hc_base,
           p.norm_weight, *out, parts, counters, None, None, *scalar_args(p.scalars))
        return out
    return call


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, nargs="+", default=[7168])
    ap.add_argument("--m", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--tactic", default="half_mma:k2:m64:s3:fbw")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--once", type=int, nargs=2, metavar=("M", "H"))
    args = ap.parse_args()
    dev = torch.device("cuda")
    tactic = parse_tactic(args.tactic)
    if args.once:
        sets = mb.make_sets(args.once[0], args.once[1], 1, dev, False)
        problem = problem_of(sets[0])
        for cls in (mma.MmaFusedHcKernel, CopyOnlyKernel):
            call = launcher(tactic, problem, lambda cls=cls: cls(args.once[1], tactic, "fp32", None))
            for _ in range(2):
                call(sets[0])
        torch.cuda.synchronize()
        return 0
    bw = mb.measure_copy_bandwidth(dev)
    print(f"GPU: {torch.cuda.get_device_name(dev)}, copy bandwidth {bw / 1e12:.2f} TB/s, tactic {tactic.name}")
    for h in args.hidden:
        for m in args.m:
            sets = mb.rotated_sets(m, h, dev)
            floor_us = mb.floor_bytes(m, h) / bw * 1e6
            problem = problem_of(sets[0])
            calls = {name: launcher(tactic, problem, lambda cls=cls: cls(h, tactic, "fp32", None))
                     for name, cls in (("kernel", mma.MmaFusedHcKernel), ("copy-only", CopyOnlyKernel))}
            for r in range(args.rounds):
                for name, call in calls.items():
                    us = mb.time_graph(call, sets)
                    print(f"H={h} M={m} round {r} {name:9s} {us:8.2f} us  {floor_us / us:6.1%} of floor", flush=True)
            del sets
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
