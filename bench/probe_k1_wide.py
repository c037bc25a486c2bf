"""Path B's kernel 1 with wider TMA boxes for the activations: does the copy probe's gain for 128-wide stages
(`bench/probe_box_copy.py`: 93-95% of the copy bandwidth against 79-82% for kernel 1's 32-wide ones,
`bench/measured/h200_k1_bound_stop14.txt`) carry over to the kernel?

``WideBoxKernel`` is kernel 1 (``mma.MmaFusedHcKernel``) with its pipeline split in two: ``residual_prev`` and
``x_prev`` arrive ``box`` 32-wide blocks of H at a time (one TMA box of ``[tile_m, 4, 32 box]`` and one of
``[tile_m, 32 box]``, ``raw_stages`` of them in flight), the weight 32-wide block by block as now (``stages`` in
flight, ring of its own), each ring fed by a producer warp of its own so that neither waits for the other's. The consumers work block by block exactly as kernel 1 does (same post-map, same MMAs in
the same K order, same partials), so the outputs must be bit-identical to kernel 1's with the same tactic: the probe
checks that and the float64 contract, then times both (CUDA-graph replay over rotated inputs, alternating rounds).

    python bench/probe_k1_wide.py --hidden 7168 --m 8192 --baseline half_mma:k2:m64:s3:fbw \
        --variant 4:2:half_mma:k2:m64:s2:fbw 1:3:half_mma:k2:m64:s3:fbw    # box:raw_stages:tactic
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

# mhc_cute.kernels first: it sets the DSL's target architecture before cutlass is imported
from mhc_cute.kernels import compile_kernel, fake_buffer, fake_tensors, mma, scalar_args  # noqa: E402

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
import cutlass.pipeline as pipeline  # noqa: E402
from cutlass import BFloat16, Float32, Int32, const_expr  # noqa: E402
from cutlass.cute.nvgpu import cpasync, warpgroup  # noqa: E402

from mhc_cute import benchmark as mb  # noqa: E402
from mhc_cute.accuracy import check_outputs, poisoned_outputs, problem_of, same_bits, tolerances  # noqa: E402
from mhc_cute.kernels.big_fuse import BigFuseScalars, flat_outputs, partials_view  # noqa: E402
from mhc_cute.kernels.wgmma_tf32 import make_tf32_tiled_mma  # noqa: E402
from mhc_cute.tactics import HC_MULT, MMA_BLOCK_H as BLOCK_H, MMA_WG_THREADS, N_MIXES, PARTIAL_COLS  # noqa: E402
from mhc_cute.tactics import parse_tactic  # noqa: E402
from mhc_cute.workspace import get_workspace  # noqa: E402

SMEM_LIMIT = 227 * 1024


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
        assert smem <= SMEM_LIMIT, f"{smem} bytes of shared memory"

    @cute.jit
    def __call__(self, mX: cute.Tensor, mRes: cute.Tensor, mPost: cute.Tensor, mComb: cute.Tensor, mW: cute.Tensor,
                 mScale: cute.Tensor, mBase: cute.Tensor, mNormW, mResOut: cute.Tensor, mPostOut: cute.Tensor,
                 mCombOut: cute.Tensor, mLayerIn: cute.Tensor, workspace: cute.Tensor, counters: cute.Tensor,
                 rms_eps: Float32, hc_pre_eps: Float32, hc_sinkhorn_eps: Float32, hc_post_mult_value: Float32,
                 sinkhorn_repeat: Int32, norm_eps: Float32, stream):
        tile_m, wide, raw_stages, stages = self.tile_m, self.wide, self.raw_stages, self.stages
        m = mX.shape[0]
        # as kernel 1's, each row ``wide`` long: [stream][row][wide]
        res_layout = cute.make_layout((tile_m, HC_MULT, wide, raw_stages),
                                      stride=(wide, tile_m * wide, 1, tile_m * wide * HC_MULT))
        x_layout = cute.make_layout((tile_m, wide, raw_stages), stride=(wide, 1, tile_m * wide))
        w_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, Float32)
        w_stage_layout = cute.tile_to_shape(w_atom, (self.n, self.k_stage), order=(0, 1))
        w_layout = cute.tile_to_shape(w_atom, (self.n, self.k_stage, stages), order=(0, 1, 2))
        mB = cute.make_tensor(
            mW.iterator,
            cute.make_layout((self.n, (BLOCK_H, HC_MULT * self.n_hblk)), stride=(BLOCK_H, (1, BLOCK_H * self.n))),
        )
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_res, tma_mRes = cpasync.make_tiled_tma_atom(
            g2s, mRes, cute.slice_(res_layout, (None, None, None, 0)), (tile_m, HC_MULT, wide))
        tma_x, tma_mX = cpasync.make_tiled_tma_atom(g2s, mX, cute.slice_(x_layout, (None, None, 0)), (tile_m, wide))
        tma_w, tma_mB = cpasync.make_tiled_tma_atom(g2s, mB, w_stage_layout, (self.n, self.k_stage))
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
        """Kernel 1's ``consume``, block by block from the activations' boxes (the box's ``sub``-th 32 positions)."""
        m_total = mResOut.shape[0]
        wg = tidx // MMA_WG_THREADS
        wg_tid = tidx % MMA_WG_THREADS
        lane = tidx % 32
        quad = lane % 4
        row0 = wg * 64 + (wg_tid // 32) * 16 + lane // 4
        rows = (row0, row0 + 8)
        thr_mma = tiled_mma.get_slice(wg_tid)
        tCrA = thr_mma.make_fragment_A(thr_mma.partition_shape_A((64, self.k_stage)))
        tCrB = thr_mma.make_fragment_B(thr_mma.partition_B(sW))
        acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((64, self.n)), Float32)
        dots = cute.make_rmem_tensor((N_MIXES // 2,), Float32)
        dots.fill(0.0)
        post = cute.make_rmem_tensor((2, HC_MULT), Float32)
        comb = cute.make_rmem_tensor((2, HC_MULT, HC_MULT), Float32)
        post.fill(0.0)
        comb.fill(0.0)
        for r in cutlass.range_constexpr(2):
            m = m_tile * self.tile_m + rows[r]
            if m < m_total:
                for j in cutlass.range_constexpr(HC_MULT):
                    post[r, j] = mPost[m, j]
                    for k in cutlass.range_constexpr(HC_MULT):
                        comb[r, k, j] = mComb[m, k, j]
        sumsq = cute.make_rmem_tensor((2,), Float32)
        sumsq.fill(0.0)
        xv = cute.make_rmem_tensor((2, mma.VEC), Float32)
        rv = cute.make_rmem_tensor((2, HC_MULT, mma.VEC), Float32)
        out = cute.make_rmem_tensor((mma.VEC,), BFloat16)
        xf = cute.make_rmem_tensor((mma.VEC,), Float32)
        raw_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.raw_stages)
        w_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        for i in cutlass.range(n_blk, unroll=1):
            vec_idx = (blk_begin + i) * (BLOCK_H // mma.VEC) + quad
            sub_vec = (i % self.box) * (BLOCK_H // mma.VEC) + quad  # this thread's vector in the box's rows
            if i % self.box == 0:
                raw_pipeline.consumer_wait(raw_state)
            w_pipeline.consumer_wait(w_state)
            si, wi = raw_state.index, w_state.index
            for r in cutlass.range_constexpr(2):
                xv[r, None].store(self._vec(sX[(rows[r], None, si)], sub_vec).load().to(Float32))
                for k in cutlass.range_constexpr(HC_MULT):
                    rv[r, k, None].store(self._vec(sRes[(rows[r], k, None, si)], sub_vec).load().to(Float32))
            if i % self.box == self.box - 1:  # the box is read: free for the next one
                raw_pipeline.consumer_release(raw_state)
                raw_state.advance()
            for j in cutlass.range_constexpr(HC_MULT):
                for r in cutlass.range_constexpr(2):
                    for e in cutlass.range_constexpr(mma.VEC):
                        a = post[r, j] * xv[r, e]
                        for k in cutlass.range_constexpr(HC_MULT):
                            a = cute.math.fma(comb[r, k, j], rv[r, k, e], a)
                        out[e] = a.to(BFloat16)
                    m = m_tile * self.tile_m + rows[r]
                    if m < m_total:
                        cute.autovec_copy(out, self._vec(mResOut[(m, j, None)], vec_idx))
                    xf.store(out.load().to(Float32))
                    for e in cutlass.range_constexpr(mma.VEC):
                        sumsq[r] = cute.math.fma(xf[e], xf[e], sumsq[r])
                        tCrA[(r + 2 * (e % 2), 0, j * 4 + e // 2)] = xf[e]
            warpgroup.fence()
            mma_atom = cute.make_mma_atom(tiled_mma.op)
            mma_atom.set(warpgroup.Field.ACCUMULATE, False)
            for ks in cutlass.range_constexpr(self.k_stage // 8):
                cute.gemm(mma_atom, acc, tCrA[(None, None, ks)], tCrB[(None, None, ks, wi)], acc)
                mma_atom.set(warpgroup.Field.ACCUMULATE, True)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            w_pipeline.consumer_release(w_state)
            w_state.advance()
            for c in cutlass.range_constexpr(N_MIXES // 2):
                if const_expr(self.n_parts == 2):
                    dots[c] = dots[c] + (acc[c] + acc[c + N_MIXES // 2])
                else:
                    dots[c] = dots[c] + acc[c]
        for r in cutlass.range_constexpr(2):
            sumsq[r] = mma.du.warp_sum(sumsq[r], lanes=4)
        for r in cutlass.range_constexpr(2):
            m = m_tile * self.tile_m + rows[r]
            if m < m_total:
                for c in cutlass.range_constexpr(N_MIXES // 8):
                    for a in cutlass.range_constexpr(2):
                        mPartials[split, m, 8 * c + 2 * quad + a] = dots[a + 2 * r + 4 * c]
                if quad == 0:
                    mPartials[split, m, mma.SUMSQ_COL] = sumsq[r]


def compile_variant(make_kernel, problem, out):
    """``mma.compile_mma``'s fake arguments for the kernel object ``make_kernel()`` (no GPU needed)."""
    h = problem.hidden
    kernel = make_kernel()
    m = cute.sym_int()
    tokens = fake_tensors(problem.x, problem.residual, problem.post_mix, problem.comb_mix, tokens=m)
    weight, = fake_tensors(torch.empty(h // BLOCK_H, HC_MULT, kernel.n, BLOCK_H))
    scale, base = fake_tensors(problem.hc_scale, problem.hc_base, align=4)
    return compile_kernel(kernel, *tokens, weight, scale, base, None, *fake_tensors(*out, tokens=m),
                          fake_buffer(Float32), fake_buffer(Int32))


def launcher(tactic, problem, make_kernel):
    """A call(inputs, poison=False) -> outputs of the compiled kernel (fresh outputs each call; NaN-filled first
    with ``poison``, for the check: not in timed calls, where the fill would be timed too)."""
    fn = compile_variant(make_kernel, problem, problem.empty_outputs())

    def call(s, poison=False):
        p = problem_of(s, problem.precision)
        out = poisoned_outputs(p) if poison else p.empty_outputs()
        ws = get_workspace(p.x.device)
        parts = ws.partials(tactic.split_k * p.m * PARTIAL_COLS)
        counters = ws.counters(-(-p.m // tactic.tile_m))
        fn(p.x, p.residual, p.post_mix, p.comb_mix, mma.cached_weight(p.fn, p.precision), p.hc_scale, p.hc_base,
           p.norm_weight, *out, parts, counters, *scalar_args(p.scalars))
        return out
    return call


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
