"""Does path B's kernel 1 stream faster when ``residual_cur`` (and the delayed seam's ``layer_input``) leave through
TMA stores instead of each thread's 16-byte stores? ``ncu`` found its warps waiting 39-44% of their cycles on the
L1TEX scoreboard at one CTA of nine warps per SM (``h200_ncu_delayed_k1_3a60d1a_2026-12-04.txt``); the global
stores, whose source registers a thread must keep until the LSU has read them, are the candidate.

The variant is a subclass of the product's kernel 1: each consumer thread writes its rounded values back into the
stage's input slots (it holds in registers all it read there, and no other thread reads its positions), the
consumer threads meet at a named barrier after a generic-to-async proxy fence, and one thread stores the slots
with TMA (rows past M are clipped by TMA) and waits until TMA has read them before its warp releases the slot to
the producer (the slot's release needs every consumer warp's arrival, that thread's warp among them). The regular
form, the V4 seam and the delayed seam with carried gates; path B's big fuse follows, as in the product.

    python bench/probes/probe_k1_tma_store.py --m 2048 8192 --hidden 7168 5120   # on a GPU machine
    python bench/probes/probe_k1_tma_store.py --compile-only                      # anywhere: compiles the variants

Lines: ``TMASTORE H M seam tactic product_us variant_us ratio same_bits`` (µs per call, CUDA-graph replay over
inputs rotated out of L2, the median of alternating rounds; same_bits: every output of every set bit-identical to
the product kernel's). Not yet run on a GPU when written (2026-12-04).
"""

import argparse
import hashlib
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT)]

import torch  # noqa: E402

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
import cutlass.pipeline as pipeline  # noqa: E402
from cutlass import BFloat16, Float32, Int32, const_expr  # noqa: E402
from cutlass.cute.nvgpu import cpasync, warpgroup  # noqa: E402

from mhc_cute import benchmark as mb, selector, tactics as tac  # noqa: E402
from mhc_cute.kernels import (  # noqa: E402
    CompiledKernels, compile_kernel, delayed_mode, fake_buffer, fake_tensors, norm_dtype_of,
    seam_fakes, spec_problem,
)
from mhc_cute.kernels import device_utils as du  # noqa: E402
from mhc_cute.kernels.big_fuse import BigFuseScalars, flat_outputs, gate_rows, partials_view  # noqa: E402
from mhc_cute.kernels.launch import KernelLaunch  # noqa: E402
from mhc_cute.kernels.mma import BLOCK_H, HC_MULT, VEC, MmaFusedHcKernel, compiled_mma, weight_of  # noqa: E402
from mhc_cute.kernels.wgmma_tf32 import make_tf32_tiled_mma  # noqa: E402
from mhc_cute.tactics import mma_stage_bytes as stage_bytes  # noqa: E402

PROBE_DIGEST = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]
STORE_BARRIER = 1  # named barrier of the consumer threads before a stage's TMA store (kernel 1 uses no other)


class TmaStoreKernel1(MmaFusedHcKernel):
    """Path B's kernel 1 with TMA stores of ``residual_cur`` and ``layer_input`` (module docstring)."""

    def __init__(self, hidden, tactic, precision, norm_dtype, delayed=None, form="regular"):
        assert form == "regular" and tactic.path == "half_mma", (form, tactic.path)
        super().__init__(hidden, tactic, precision, norm_dtype, delayed, form)

    @cute.jit
    def __call__(self, mX, mRes, mPost, mComb, mW, mScale, mBase, mNormW, mResOut, mPostOut, mCombOut, mLayerIn,
                 workspace, counters, mPre, mPreCur, rms_eps: Float32, hc_pre_eps: Float32,
                 hc_sinkhorn_eps: Float32, hc_post_mult_value: Float32, sinkhorn_repeat: Int32, norm_eps: Float32,
                 stream):
        tile_m, stages = self.tile_m, self.stages
        m = mRes.shape[0]
        res_layout, x_layout, tma_res, tma_mRes, tma_x, tma_mX = self.activation_tma(mRes, mX, BLOCK_H, stages)
        w_layout, tma_w, tma_mB = self.weight_tma(mW)
        tiled_mma = make_tf32_tiled_mma(self.n, warpgroup.OperandSource.RMEM)
        s2g = cpasync.CopyBulkTensorTileS2GOp()
        tma_out_res, tma_mResOut = cpasync.make_tiled_tma_atom(
            s2g, mResOut, cute.slice_(res_layout, (None, None, None, 0)), (tile_m, HC_MULT, BLOCK_H))
        tma_out_x1, tma_mLayerIn = cpasync.make_tiled_tma_atom(
            s2g, mLayerIn, cute.slice_(x_layout, (None, None, 0)), (tile_m, BLOCK_H))

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, stages * 2]
            is_last: cute.struct.MemRange[Int32, 1]
            sW: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(w_layout)], 1024]
            sRes: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(res_layout)], 128]
            sX: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(x_layout)], 128]

        self.shared_storage = SharedStorage
        partials = partials_view(workspace, self.split_k, m)
        flat = flat_outputs(self.hidden, m, mResOut, mPostOut, mCombOut, mLayerIn)
        scalars = BigFuseScalars(rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value, sinkhorn_repeat, norm_eps)
        pre, pre_out = gate_rows(m, mPre), gate_rows(m, mPreCur)
        self.kernel(
            tma_res, tma_mRes, tma_x, tma_mX, tma_w, tma_mB, mPost, mComb, mResOut, partials, tiled_mma,
            res_layout, x_layout, w_layout, pre, tma_out_res, tma_mResOut, tma_out_x1, tma_mLayerIn,
        ).launch(grid=[cute.ceil_div(m, tile_m) * self.split_k, 1, 1], block=[self.threads, 1, 1], stream=stream,
                 use_pdl=True)
        self.big_fuse.launch(partials, mScale, mBase, mNormW, *flat, scalars, stream, pre_out)

    @cute.kernel
    def kernel(self, tma_res: cute.CopyAtom, tma_mRes: cute.Tensor, tma_x, tma_mX, tma_w: cute.CopyAtom,
               tma_mB: cute.Tensor, mPost, mComb, mResOut: cute.Tensor, mPartials: cute.Tensor,
               tiled_mma: cute.TiledMma, res_layout: cute.Layout, x_layout: cute.Layout,
               w_layout: cute.ComposedLayout, mPre, tma_out_res: cute.CopyAtom, tma_mResOut: cute.Tensor,
               tma_out_x1: cute.CopyAtom, tma_mLayerIn: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        if const_expr(self.tactic.fuse == "lat"):
            cute.arch.griddepcontrol_launch_dependents()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        split = bidx % self.split_k
        m_tile = bidx // self.split_k
        blk_begin = split * self.n_hblk // self.split_k
        n_blk = (split + 1) * self.n_hblk // self.split_k - blk_begin
        if warp_idx == self.producer_warp:
            cpasync.prefetch_descriptor(tma_res)
            cpasync.prefetch_descriptor(tma_x)
            cpasync.prefetch_descriptor(tma_w)
        if tidx == 0:
            cpasync.prefetch_descriptor(tma_out_res)
            if const_expr(self.delayed is not None):
                cpasync.prefetch_descriptor(tma_out_x1)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        sRes = storage.sRes.get_tensor(res_layout)
        sX = storage.sX.get_tensor(x_layout)
        sW = storage.sW.get_tensor(w_layout.outer, swizzle=w_layout.inner)
        ab_pipeline = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.mma_wgs * 4),
            tx_count=stage_bytes(self.tile_m, self.n_parts, with_x=True, streams=self.in_streams),
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
        )
        cute.arch.griddepcontrol_wait()
        if warp_idx == self.producer_warp:
            self.produce(ab_pipeline, tma_res, tma_mRes, tma_x, tma_mX, tma_w, tma_mB, sRes, sX, sW, m_tile,
                         blk_begin, n_blk)
        else:
            self.consume_to_tma(ab_pipeline, tiled_mma, sRes, sX, sW, mPost, mComb, mPre, mResOut, mPartials, tidx,
                                m_tile, split, blk_begin, n_blk, tma_out_res, tma_mResOut, tma_out_x1, tma_mLayerIn)

    @cute.jit
    def consume_to_tma(self, ab_pipeline, tiled_mma, sRes, sX, sW, mPost, mComb, mPre, mResOut, mPartials, tidx,
                       m_tile, split, blk_begin, n_blk, tma_out_res, tma_mResOut, tma_out_x1, tma_mLayerIn):
        m_total = mResOut.shape[0]
        ctx = self.consumer_setup(tiled_mma, sW, mPost, mComb, m_total, tidx, m_tile, mPre)
        one = cute.make_layout(1)
        gResOut = cute.local_tile(tma_mResOut, (self.tile_m, HC_MULT, BLOCK_H), (m_tile, 0, None))
        tOs, tOg = cpasync.tma_partition(tma_out_res, 0, one, cute.group_modes(sRes, 0, 3),
                                         cute.group_modes(gResOut, 0, 3))
        gX1 = cute.local_tile(tma_mLayerIn, (self.tile_m, BLOCK_H), (m_tile, None))
        tXs, tXg = cpasync.tma_partition(tma_out_x1, 0, one, cute.group_modes(sX, 0, 2), cute.group_modes(gX1, 0, 2))
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        for i in cutlass.range(n_blk, unroll=1):
            ab_pipeline.consumer_wait(state)
            si = state.index
            self.project_block_in_place(ctx, tiled_mma, sX, sRes, si)
            # the slots' new values, written by the generic proxy, must be visible to TMA (the async proxy)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=STORE_BARRIER, number_of_threads=self.mma_wgs * 128)
            if tidx == 0:
                cute.copy(tma_out_res, tOs[(None, si)], tOg[(None, blk_begin + i)])
                if const_expr(self.delayed is not None):
                    cute.copy(tma_out_x1, tXs[(None, si)], tXg[(None, blk_begin + i)])
                cute.arch.cp_async_bulk_commit_group()
                cute.arch.cp_async_bulk_wait_group(0, read=True)  # the slot may be refilled only after this
            ab_pipeline.consumer_release(state)
            state.advance()
            self.accumulate_block(ctx)
        if tidx == 0:
            cute.arch.cp_async_bulk_wait_group(0)
        self.store_partials(ctx, mPartials, split, m_tile, m_total)

    @cute.jit
    def project_block_in_place(self, ctx, tiled_mma, sX, sRes, si):
        """``project_block`` of the regular form with the rounded streams written back over ``residual_prev`` in
        the stage's slot and the delayed seam's collapse over ``x_prev`` (rows past M included: TMA clips them)."""
        xv = cute.make_rmem_tensor((2, VEC), Float32)
        rv = cute.make_rmem_tensor((2, HC_MULT, VEC), Float32)
        out = cute.make_rmem_tensor((VEC,), BFloat16)
        xf = cute.make_rmem_tensor((VEC,), Float32)
        x1 = cute.make_rmem_tensor((2, VEC), Float32)
        for r in cutlass.range_constexpr(2):
            xv[r, None].store(self._vec(sX[(ctx.rows[r], None, si)], ctx.quad).load().to(Float32))
            for k in cutlass.range_constexpr(HC_MULT):
                rv[r, k, None].store(self._vec(sRes[(ctx.rows[r], k, None, si)], ctx.quad).load().to(Float32))
        for j in cutlass.range_constexpr(HC_MULT):
            for r in cutlass.range_constexpr(2):
                for e in cutlass.range_constexpr(VEC):
                    out[e] = du.post_element(ctx.post[r, j], xv[r, e], [ctx.comb[r, k, j] for k in range(HC_MULT)],
                                             [rv[r, k, e] for k in range(HC_MULT)]).to(BFloat16)
                cute.autovec_copy(out, self._vec(sRes[(ctx.rows[r], j, None, si)], ctx.quad))
                xf.store(out.load().to(Float32))
                for e in cutlass.range_constexpr(VEC):
                    ctx.sumsq[r] = cute.math.fma(xf[e], xf[e], ctx.sumsq[r])
                    ctx.tCrA[(r + 2 * (e % 2), 0, j * 4 + e // 2)] = xf[e]
                if const_expr(self.delayed == "carried"):
                    for e in cutlass.range_constexpr(VEC):
                        if const_expr(j == 0):
                            x1[r, e] = ctx.pre[r, 0] * xf[e]
                        else:
                            x1[r, e] = cute.math.fma(ctx.pre[r, j], xf[e], x1[r, e])
                if const_expr(self.delayed == "identity" and j == 0):
                    x1[r, None].store(xf.load())
        if const_expr(self.delayed is not None):
            for r in cutlass.range_constexpr(2):
                rounded = du.store_bf16x8(self._vec(sX[(ctx.rows[r], None, si)], ctx.quad), x1[r, None].load())
                if const_expr(self.x1_norm):
                    ctx.x1_sumsq[r] = ctx.x1_sumsq[r] + du.sum_squares(rounded)
        warpgroup.fence()
        mma_atom = cute.make_mma_atom(tiled_mma.op)
        mma_atom.set(warpgroup.Field.ACCUMULATE, False)
        for ks in cutlass.range_constexpr(self.k_stage // 8):
            cute.gemm(mma_atom, ctx.acc, ctx.tCrA[(None, None, ks)], ctx.tCrB[(None, None, ks, si)], ctx.acc)
            mma_atom.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()
        warpgroup.wait_group(0)


_compiled = CompiledKernels("mhc_probe_k1_tma_store")


def compiled_variant(tactic, problem, out):
    """The variant compiled against fakes shaped like ``problem`` (as ``mma.compile_mma`` does the product's)."""
    h = problem.hidden
    key = (tactic.name, h, problem.precision, str(problem.norm_weight is not None), delayed_mode(problem),
           PROBE_DIGEST)

    def build():
        kernel = TmaStoreKernel1(h, tactic, problem.precision, norm_dtype_of(problem.norm_weight),
                                 delayed_mode(problem))
        m = cute.sym_int()
        tokens = fake_tensors(problem.x, problem.residual, problem.post_mix, problem.comb_mix, tokens=m)
        outputs = fake_tensors(*out[:4], tokens=m)
        weight, norm_weight = fake_tensors(torch.empty(h // BLOCK_H, HC_MULT, kernel.n, BLOCK_H), problem.norm_weight)
        scale, base = fake_tensors(problem.hc_scale, problem.hc_base, align=4)
        return compile_kernel(kernel, *tokens, weight, scale, base, norm_weight, *outputs, fake_buffer(Float32),
                              fake_buffer(Int32), *seam_fakes(problem, out, m))
    return _compiled.get(key, build)


def shipped_mma_tactic(m: int, hidden: int):
    """Path B's tactic of the shipped H200 table at M's bucket (the table's pick where it is path B, else the
    default)."""
    from mhc_cute import __version__

    key = selector.TuneKey("NVIDIA H200", 132, hidden, "fp32", False, __version__).as_str()
    choice = selector.nearest(selector.load_shipped_tables()[key], selector.bucket_of(m))
    if choice.backend == "half_mma":
        return tac.parse_tactic(choice.tactic)
    return tac.default_mma_tactic("half_mma", m, hidden, 132)


SEAMS = {"v4": None, "delayed": "carried"}


def launches(m: int, hidden: int, seam: str):
    """(product launch, variant launch, tactic) for ``seam`` at (M, H): both ``KernelLaunch``es of one tactic."""
    problem = spec_problem(hidden, "fp32", None, SEAMS[seam])
    out = problem.empty_outputs()
    tactic = shipped_mma_tactic(m, hidden)
    counters = -(-m // tactic.tile_m)
    return (KernelLaunch(compiled_mma(tactic, problem, out), problem, tactic, counters, weight_of("fp32")),
            KernelLaunch(compiled_variant(tactic, problem, out), problem, tactic, counters, weight_of("fp32")),
            tactic)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--hidden", type=int, nargs="+", default=[7168, 5120])
    ap.add_argument("--seams", nargs="+", default=list(SEAMS), choices=list(SEAMS))
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--compile-only", action="store_true")
    args = ap.parse_args(argv)
    if args.compile_only or not torch.cuda.is_available():
        for h in args.hidden:
            for m in args.m:
                for seam in args.seams:
                    launches(m, h, seam)
        print("compiled" + ("" if args.compile_only else " (no GPU: nothing timed)"))
        return 0 if args.compile_only else 2
    from mhc_cute.problem import validate

    dev = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name()}; µs per call, graph replay over rotated inputs, median of "
          f"{args.rounds} alternating rounds")
    with torch.inference_mode():
        for h in args.hidden:
            for m in args.m:
                for seam in args.seams:
                    product, variant, tactic = launches(m, h, seam)
                    sets = mb.rotated_sets(m, h, dev)
                    if seam == "delayed":
                        sets = mb.with_carried_gates(sets)

                    def runner(launch):
                        def call(s):
                            problem, _ = validate(s["x_prev"], s["residual_prev"], s["post_mix_prev"],
                                                  s["comb_mix_prev"], s["fn"], s["hc_scale"], s["hc_base"], None,
                                                  (1e-6, 1e-6, 1e-6, 2.0, 20, 1e-6), "fp32", s.get("pre_mix_prev"),
                                                  delayed=seam == "delayed")
                            out = problem.empty_outputs()
                            launch(problem.inputs, out)
                            return out
                        return call

                    calls = {"product": runner(product), "variant": runner(variant)}
                    same = all(all(torch.equal(a, b) for a, b in zip(calls["product"](s), calls["variant"](s)))
                               for s in sets)
                    graphs = {k: mb.capture(c, sets) for k, c in calls.items()}
                    times = mb.alternating_rounds(
                        {k: (lambda g=g: statistics.median(mb.replay_us(g, len(sets), 5))) for k, g in graphs.items()},
                        args.rounds)
                    p, v = (statistics.median(times[k]) for k in ("product", "variant"))
                    print(f"TMASTORE {h} {m} {seam} {tactic.name} {p:.2f} {v:.2f} {v / p:.3f} {same}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
