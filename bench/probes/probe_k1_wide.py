"""Path B's kernel 1 with wider TMA boxes for the activations: does the copy probe's gain for 128-wide stages
(`bench/probes/probe_box_copy.py`: 93-95% of the copy bandwidth against 79-82% for kernel 1's 32-wide ones,
`bench/measured/h200_k1_bound_2026-12-01.txt`) carry over to the kernel?

``WideBoxKernel`` is kernel 1 (``mma.MmaFusedHcKernel``) with its pipeline split in two: ``residual_prev`` and
``x_prev`` arrive ``box`` 32-wide blocks of H at a time (one TMA box of ``[tile_m, 4, 32 box]`` and one of ``[tile_m, 32
box]``, ``raw_stages`` of them in flight), the weight 32-wide block by block as now (``stages`` in flight, ring of its
own), each ring fed by a producer warp of its own so that neither waits for the other's. The consumers work block by
block exactly as kernel 1 does (same post-map, same MMAs in the same K order, same partials), so the outputs must be
bit-identical to kernel 1's with the same tactic: the probe checks that and the float64 contract, then times both
(CUDA-graph replay over rotated inputs, alternating rounds).

    python bench/probes/probe_k1_wide.py --hidden 7168 --m 8192 --baseline half_mma:k2:m64:s3:fbw \
        --variant 4:2:half_mma:k2:m64:s2:fbw 1:3:half_mma:k2:m64:s3:fbw    # box:raw_stages:tactic
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

# mhc_cute.kernels first: it sets the DSL's target architecture before cutlass is imported
from mhc_cute.kernels import device_utils as du, mma  # noqa: E402

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
import cutlass.pipeline as pipeline  # noqa: E402
from cutlass import BFloat16, Float32, Int32, const_expr  # noqa: E402
from cutlass.cute.nvgpu import cpasync, warpgroup  # noqa: E402

from mhc_cute import benchmark as mb  # noqa: E402
from mhc_cute.accuracy import check_outputs, problem_of, same_bits, tolerances  # noqa: E402
from mhc_cute.kernels.big_fuse import BigFuseScalars, flat_outputs, partials_view  # noqa: E402
from mhc_cute.kernels.wgmma_tf32 import make_tf32_tiled_mma  # noqa: E402
from mhc_cute.tactics import HC_MULT, MMA_BLOCK_H as BLOCK_H, MMA_SMEM_LIMIT, parse_tactic  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_k1_copy import launcher  # noqa: E402


class WideBoxKernel(mma.MmaFusedHcKernel):
    """Kernel 1 of path B with the activations in TMA boxes of ``box`` 32-wide blocks (see the module doc)."""

    def __init__(self, hidden: int, tactic, precision: str, norm_dtype, box: int = 4, raw_stages: int = 2):
        super().__init__(hidden, tactic, precision, norm_dtype)
        assert tactic.path == "half_mma", "path B only"
        assert (hidden // BLOCK_H) % (tactic.split_k * box) == 0, "whole boxes per split"
        self.box, self.raw_stages = box, raw_stages
        self.wide = BLOCK_H * box
        smem = (raw_stages * self.tile_m * (HC_MULT + 1) * self.wide * 2
                + self.stages * self.n * self.k_stage * 4 + 1024)
        assert smem <= MMA_SMEM_LIMIT, f"{smem} bytes of shared memory"

    @cute.jit
    def __call__(self, mX: cute.Tensor, mRes: cute.Tensor, mPost: cute.Tensor, mComb: cute.Tensor, mW: cute.Tensor,
                 mScale: cute.Tensor, mBase: cute.Tensor, mNormW, mResOut: cute.Tensor, mPostOut: cute.Tensor,
                 mCombOut: cute.Tensor, mLayerIn: cute.Tensor, workspace: cute.Tensor, counters: cute.Tensor,
                 mPre, mPreCur,  # kernel 1's arguments of the delayed seam: None here (mhc_fused_hc only)
                 rms_eps: Float32, hc_pre_eps: Float32, hc_sinkhorn_eps: Float32, hc_post_mult_value: Float32,
                 sinkhorn_repeat: Int32, norm_eps: Float32, stream):
        tile_m, wide, raw_stages, stages = self.tile_m, self.wide, self.raw_stages, self.stages
        m = mX.shape[0]
        res_layout, x_layout, tma_res, tma_mRes, tma_x, tma_mX = self.activation_tma(mRes, mX, wide, raw_stages)
        w_layout, tma_w, tma_mB = self.weight_tma(mW)
        tiled_mma = make_tf32_tiled_mma(self.n, warpgroup.OperandSource.RMEM)

        @cute.struct
        class SharedStorage:
            raw_mbar: cute.struct.MemRange[cutlass.Int64, raw_stages * 2]
            w_mbar: cute.struct.MemRange[cutlass.Int64, stages * 2]
            sW: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(w_layout)], 1024]
            sRes: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(res_layout)], 128]
            sX: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(x_layout)], 128]

        self.shared_storage = SharedStorage
        partials = partials_view(workspace, self.split_k, m)
        flat = flat_outputs(self.hidden, m, mResOut, mPostOut, mCombOut, mLayerIn)
        scalars = BigFuseScalars(rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value, sinkhorn_repeat, norm_eps)
        self.wide_kernel(tma_res, tma_mRes, tma_x, tma_mX, tma_w, tma_mB, mPost, mComb, mResOut, partials, tiled_mma,
                         res_layout, x_layout, w_layout).launch(
            grid=[cute.ceil_div(m, tile_m) * self.split_k, 1, 1], block=[self.threads + 32, 1, 1], stream=stream,
            use_pdl=True)
        self.big_fuse.launch(partials, mScale, mBase, mNormW, *flat, scalars, stream)

    @cute.kernel
    def wide_kernel(self, tma_res: cute.CopyAtom, tma_mRes: cute.Tensor, tma_x: cute.CopyAtom, tma_mX: cute.Tensor,
                    tma_w: cute.CopyAtom, tma_mB: cute.Tensor, mPost: cute.Tensor, mComb: cute.Tensor,
                    mResOut: cute.Tensor, mPartials: cute.Tensor, tiled_mma: cute.TiledMma, res_layout: cute.Layout,
                    x_layout: cute.Layout, w_layout: cute.ComposedLayout):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        if const_expr(self.tactic.fuse == "lat"):
            cute.arch.griddepcontrol_launch_dependents()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        split = bidx % self.split_k
        m_tile = bidx // self.split_k
        blk_begin = split * (self.n_hblk // self.split_k)
        n_blk = self.n_hblk // self.split_k
        if warp_idx == self.producer_warp:
            cpasync.prefetch_descriptor(tma_res)
            cpasync.prefetch_descriptor(tma_x)
        if warp_idx == self.producer_warp + 1:
            cpasync.prefetch_descriptor(tma_w)
        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        sRes = storage.sRes.get_tensor(res_layout)
        sX = storage.sX.get_tensor(x_layout)
        sW = storage.sW.get_tensor(w_layout.outer, swizzle=w_layout.inner)
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.mma_wgs * 4)
        raw_pipeline = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.raw_mbar.data_ptr(), num_stages=self.raw_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread), consumer_group=consumers,
            tx_count=self.tile_m * (HC_MULT + 1) * self.wide * 2, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)))
        w_pipeline = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.w_mbar.data_ptr(), num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread), consumer_group=consumers,
            tx_count=self.n * self.k_stage * 4, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)))
        cute.arch.griddepcontrol_wait()
        if warp_idx == self.producer_warp:
            self.produce_boxes(raw_pipeline, tma_res, tma_mRes, tma_x, tma_mX, sRes, sX, m_tile, blk_begin, n_blk)
        elif warp_idx == self.producer_warp + 1:
            self.produce_weights(w_pipeline, tma_w, tma_mB, sW, blk_begin, n_blk)
        else:
            self.consume_wide(raw_pipeline, w_pipeline, tiled_mma, sRes, sX, sW, mPost, mComb, mResOut, mPartials,
                              tidx, m_tile, split, blk_begin, n_blk)

    @cute.jit
    def produce_boxes(self, raw_pipeline, tma_res, tma_mRes, tma_x, tma_mX, sRes, sX, m_tile, blk_begin, n_blk):
        """The first producer warp: the split's activation boxes, ``raw_stages`` in flight."""
        gRes = cute.local_tile(tma_mRes, (self.tile_m, HC_MULT, self.wide), (m_tile, 0, None))
        gX = cute.local_tile(tma_mX, (self.tile_m, self.wide), (m_tile, None))
        one = cute.make_layout(1)
        tRs, tRg = cpasync.tma_partition(tma_res, 0, one, cute.group_modes(sRes, 0, 3), cute.group_modes(gRes, 0, 3))
        tXs, tXg = cpasync.tma_partition(tma_x, 0, one, cute.group_modes(sX, 0, 2), cute.group_modes(gX, 0, 2))
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.raw_stages)
        for b in cutlass.range(n_blk // self.box, unroll=1):
            box = blk_begin // self.box + b
            raw_pipeline.producer_acquire(state)
            bar = raw_pipeline.producer_get_barrier(state)
            cute.copy(tma_res, tRg[(None, box)], tRs[(None, state.index)], tma_bar_ptr=bar)
            cute.copy(tma_x, tXg[(None, box)], tXs[(None, state.index)], tma_bar_ptr=bar)
            raw_pipeline.producer_commit(state)
            state.advance()
        raw_pipeline.producer_tail(state)

    @cute.jit
    def produce_weights(self, w_pipeline, tma_w, tma_mB, sW, blk_begin, n_blk):
        """The second producer warp: the split's weight blocks, ``stages`` in flight."""
        gB = cute.local_tile(tma_mB, (self.n, self.k_stage), (0, None))
        tBs, tBg = cpasync.tma_partition(tma_w, 0, cute.make_layout(1), cute.group_modes(sW, 0, 2),
                                         cute.group_modes(gB, 0, 2))
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        for i in cutlass.range(n_blk, unroll=1):
            w_pipeline.producer_acquire(state)
            cute.copy(tma_w, tBg[(None, blk_begin + i)], tBs[(None, state.index)],
                      tma_bar_ptr=w_pipeline.producer_get_barrier(state))
            w_pipeline.producer_commit(state)
            state.advance()
        w_pipeline.producer_tail(state)

    @cute.jit
    def consume_wide(self, raw_pipeline, w_pipeline, tiled_mma, sRes, sX, sW, mPost, mComb, mResOut, mPartials, tidx,
                     m_tile, split, blk_begin, n_blk):
        """Kernel 1's ``consume`` (its helpers, block by block), the activations from the box's ``sub``-th 32
        positions: each ring waited for and released on its own."""
        m_total = mResOut.shape[0]
        ctx = self.consumer_setup(tiled_mma, sW, mPost, mComb, m_total, tidx, m_tile)
        raw_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.raw_stages)
        w_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        for i in cutlass.range(n_blk, unroll=1):
            sub = i % self.box
            if sub == 0:
                raw_pipeline.consumer_wait(raw_state)
            w_pipeline.consumer_wait(w_state)
            vec_in_row = sub * (BLOCK_H // du.VEC_BF16) + ctx.quad
            held = self.post_block(ctx, sX, sRes, raw_state.index, vec_in_row, mResOut, blk_begin + i, m_tile,
                                   m_total)
            self.project_block(ctx, tiled_mma, sRes, held, raw_state.index, vec_in_row, w_state.index,
                               blk_begin + i, m_tile, m_total)
            warpgroup.wait_group(0)
            w_pipeline.consumer_release(w_state)
            w_state.advance()
            if sub == self.box - 1:  # the box's last block: free for the next box
                raw_pipeline.consumer_release(raw_state)
                raw_state.advance()
            self.accumulate_block(ctx)
        self.store_partials(ctx, mPartials, split, m_tile, m_total)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, nargs="+", default=[7168])
    ap.add_argument("--m", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--variant", nargs="+", default=["4:2:half_mma:k2:m64:s2:fbw"],
                    help="BOX:RAW:TACTIC: 32-wide blocks per activation box, boxes in flight, the tactic (its s: "
                    "weight blocks in flight)")
    ap.add_argument("--baseline", default="half_mma:k2:m64:s3:fbw", help="kernel 1 as shipped, timed alongside")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "tf32"), help="tf32: the weight's hi part only "
                    "(half the weight ring's shared memory)")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    dev = torch.device("cuda")
    bw = mb.measure_copy_bandwidth(dev)
    print(f"GPU: {torch.cuda.get_device_name(dev)}, copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    for h in args.hidden:
        for m in args.m:
            sets = mb.rotated_sets(m, h, dev)
            problem = problem_of(sets[0], args.precision)
            floor_us = mb.floor_bytes(m, h) / bw * 1e6
            base = parse_tactic(args.baseline)
            calls = {f"kernel 1 {base.name}": launcher(
                base, problem, lambda: mma.MmaFusedHcKernel(h, base, args.precision, None))}
            for variant in args.variant:
                box, raw, name = variant.split(":", 2)
                t = parse_tactic(name)
                label = f"box {box} raw {raw} {t.name}"
                try:
                    calls[label] = launcher(t, problem, lambda t=t, box=int(box), raw=int(raw): WideBoxKernel(
                        h, t, args.precision, None, box, raw))
                except (AssertionError, ValueError) as e:
                    print(f"H={h} M={m} {label}: not built ({e})", flush=True)
            # correctness: the float64 contract, and the same bits as kernel 1 with the same tactic's split
            reference = {}
            for label, call in calls.items():
                out = call(sets[0], poison=True)
                torch.cuda.synchronize()
                try:
                    check_outputs(out, problem, **tolerances("half_mma", args.precision))
                    verdict = "ok"
                except AssertionError as e:
                    verdict = f"WRONG ({str(e).splitlines()[0][:120]})"
                split = label.split()[-1].split(":")[1]
                if split in reference:
                    verdict += ", same bits as kernel 1" if same_bits(out, reference[split]) else ", bits DIFFER"
                elif label.startswith("kernel 1"):
                    reference[split] = out
                print(f"H={h} M={m} check {label}: {verdict}", flush=True)
            for r in range(args.rounds):
                for label, call in calls.items():
                    us = mb.time_graph(call, sets)
                    print(f"H={h} M={m} round {r} {label:40s} {us:8.2f} us  {floor_us / us:6.1%} of floor",
                          flush=True)
            del sets
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
