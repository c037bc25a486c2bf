"""How fast can kernel 1's memory traffic go, as a function of the H width of a pipeline stage? A copy kernel
with kernel 1's structure and no arithmetic: per CTA one tile of ``tile_m`` tokens and a contiguous range of H
(``H / split`` positions), walked in stages of ``block_h`` positions through a TMA + mbarrier pipeline
(``residual_prev`` as a ``[tile_m, 4, block_h]`` box and ``x_prev`` as ``[tile_m, block_h]``, as kernel 1 loads
them at ``block_h = 32``); four warps per 64 rows copy the residual tile to ``residual_cur`` with 16-byte stores.
``--group G``: the consumers wait for G stages and store them together, so that each row piece they write is
``G * block_h`` wide while the loads stay ``block_h`` wide (which of the two widths the rate follows).
``--l2-promotion P``: the loads through descriptors built by the compiled host code (``cutlass.experimental.cuda``,
passed by value as CuTe's are) with that L2 promotion (0 none, 1 64 B, 2 128 B, 3 256 B: how much L2 fetches from
DRAM around each piece a TMA load asks for); ``inline``: CuTe's own descriptors (128 B, as measured).
Bytes moved per token: 18H, kernel 1's share of SPEC's floor. CUDA-graph replay over rotated inputs, median µs and
the achieved rate against the measured copy bandwidth.

    python bench/probes/probe_box_copy.py --hidden 7168 --m 8192 --block-h 32 64 128
    python bench/probes/probe_box_copy.py --hidden 7168 --m 2048 8192 --block-h 32 --group 1 2 4
    python bench/probes/probe_box_copy.py --hidden 7168 --m 2048 8192 --block-h 32 --l2-promotion inline 2 3
"""

import argparse
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from mhc_cute.kernels import compile_kernel, fake_tensors  # noqa: E402  (first: sets the DSL's target arch)

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
import cutlass.pipeline as pipeline  # noqa: E402
from cutlass import BFloat16  # noqa: E402
from cutlass.cute.nvgpu import cpasync  # noqa: E402
from cutlass.tensor_utils import TensorMapManager, TensorMapUpdateMode  # noqa: E402
from cutlass.experimental.cuda import (TensorMap, TensorMapL2Promotion,  # noqa: E402
                                       create_tensor_map_tiled_from_view)

from mhc_cute import benchmark as mb  # noqa: E402

VEC = 8  # bf16 per 16-byte vector
_TENSORMAPS = TensorMapManager(TensorMapUpdateMode.GMEM, 128)


@cute.jit
def param_tensormap(tensor_map: TensorMap):
    """The generic address of a by-value descriptor (in the kernel's parameters) as ``cute.copy``'s ``tma_desc_ptr``.
    Not ``tma_cache.cute_support.tma_desc_from_address``: that one also fences for a descriptor rewritten in global
    memory, which a kernel parameter never is."""
    return _TENSORMAPS.get_tensormap_ptr(cute.make_ptr(cutlass.Int64, tensor_map.get_ptr()), cute.AddressSpace.generic)


class BoxCopyKernel:
    def __init__(self, hidden: int, tile_m: int, block_h: int, split: int, stages: int, group: int = 1,
                 l2_promotion: int | None = None):
        assert stages % group == 0 and (hidden // block_h // split) % group == 0
        self.hidden, self.tile_m, self.block_h, self.split, self.stages = hidden, tile_m, block_h, split, stages
        self.group = group
        self.l2_promotion = l2_promotion
        self.n_hblk = hidden // block_h
        self.consumers = tile_m // 64 * 128
        self.threads = self.consumers + 32

    @cute.jit
    def __call__(self, mX: cute.Tensor, mRes: cute.Tensor, mResOut: cute.Tensor, stream):
        tile_m, bh, stages = self.tile_m, self.block_h, self.stages
        res_layout = cute.make_layout((tile_m, 4, bh, stages), stride=(bh, tile_m * bh, 1, tile_m * bh * 4))
        x_layout = cute.make_layout((tile_m, bh, stages), stride=(bh, 1, tile_m * bh))
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_res, tma_mRes = cpasync.make_tiled_tma_atom(g2s, mRes, cute.slice_(res_layout, (None, None, None, 0)),
                                                        (tile_m, 4, bh))
        tma_x, tma_mX = cpasync.make_tiled_tma_atom(g2s, mX, cute.slice_(x_layout, (None, None, 0)), (tile_m, bh))
        res_map, x_map = None, None
        if cutlass.const_expr(self.l2_promotion is not None):
            # TMA dimensions in the order of CuTe's own descriptors (the shared box's): H, tokens, streams
            promotion = TensorMapL2Promotion(self.l2_promotion)
            res_map = create_tensor_map_tiled_from_view(mRes, (tile_m, 4, bh), stride_order=(2, 0, 1),
                                                        l2_promotion=promotion)
            x_map = create_tensor_map_tiled_from_view(mX, (tile_m, bh), stride_order=(1, 0), l2_promotion=promotion)

        @cute.struct
        class Storage:
            mbar: cute.struct.MemRange[cutlass.Int64, stages * 2]
            sRes: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(res_layout)], 128]
            sX: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(x_layout)], 128]

        self.storage = Storage
        m = mX.shape[0]
        self.kernel(tma_res, tma_mRes, tma_x, tma_mX, mResOut, res_map, x_map, res_layout, x_layout).launch(
            grid=[cute.ceil_div(m, tile_m) * self.split, 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, tma_res, tma_mRes, tma_x, tma_mX, mResOut, res_map: cutlass.GridConstant[TensorMap],
               x_map: cutlass.GridConstant[TensorMap], res_layout: cute.Layout, x_layout: cute.Layout):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        split, m_tile = bidx % self.split, bidx // self.split
        blk_begin = split * self.n_hblk // self.split
        n_blk = (split + 1) * self.n_hblk // self.split - blk_begin
        smem = cutlass.memory.SmemAllocator()
        st = smem.allocate(self.storage)
        sRes = st.sRes.get_tensor(res_layout)
        sX = st.sX.get_tensor(x_layout)
        tile_m, bh = self.tile_m, self.block_h
        pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=st.mbar.data_ptr(), num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.consumers // 32),
            tx_count=tile_m * 5 * bh * 2, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)))
        if warp == self.consumers // 32:
            gRes = cute.local_tile(tma_mRes, (tile_m, 4, bh), (m_tile, 0, None))
            gX = cute.local_tile(tma_mX, (tile_m, bh), (m_tile, None))
            one = cute.make_layout(1)
            tRs, tRg = cpasync.tma_partition(tma_res, 0, one, cute.group_modes(sRes, 0, 3),
                                             cute.group_modes(gRes, 0, 3))
            tXs, tXg = cpasync.tma_partition(tma_x, 0, one, cute.group_modes(sX, 0, 2), cute.group_modes(gX, 0, 2))
            res_desc, x_desc = None, None
            if cutlass.const_expr(self.l2_promotion is not None):
                # as tensormap pointers: cute.copy ignores a plain pointer (and the IR refuses a cute one)
                res_desc, x_desc = param_tensormap(res_map), param_tensormap(x_map)
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
            for i in cutlass.range(n_blk, unroll=1):
                pipe.producer_acquire(state)
                bar = pipe.producer_get_barrier(state)
                cute.copy(tma_res, tRg[(None, blk_begin + i)], tRs[(None, state.index)], tma_bar_ptr=bar,
                          tma_desc_ptr=res_desc)
                cute.copy(tma_x, tXg[(None, blk_begin + i)], tXs[(None, state.index)], tma_bar_ptr=bar,
                          tma_desc_ptr=x_desc)
                pipe.producer_commit(state)
                state.advance()
            pipe.producer_tail(state)
        else:
            m_total = mResOut.shape[0]
            vecs = bh // VEC
            group = self.group
            out = cute.make_rmem_tensor((VEC,), BFloat16)
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            for i in cutlass.range(n_blk // group, unroll=1):
                # a group's stages are adjacent in the ring (stages % group == 0): indices state.index + g
                waiting = state.clone()
                for _ in cutlass.range_constexpr(group):
                    pipe.consumer_wait(waiting)
                    waiting.advance()
                for k in cutlass.range_constexpr(tile_m * 4 * vecs * group // self.consumers):
                    v = tidx + k * self.consumers
                    vec, row, j = v % (vecs * group), (v // (vecs * group)) % tile_m, v // (vecs * group * tile_m)
                    src = sRes[(row, j, None, state.index + vec // vecs)]
                    cute.autovec_copy(cute.local_tile(src, (VEC,), (vec % vecs,)), out)
                    mrow = m_tile * tile_m + row
                    if mrow < m_total:
                        first = (blk_begin + i * group) * vecs
                        dst = cute.local_tile(mResOut[(mrow, j, None)], (VEC,), (first + vec,))
                        cute.autovec_copy(out, dst)
                for _ in cutlass.range_constexpr(group):
                    pipe.consumer_release(state)
                    state.advance()


def compiled(hidden, tile_m, block_h, split, stages, sets, group=1, l2_promotion=None):
    s = sets[0]
    kernel = BoxCopyKernel(hidden, tile_m, block_h, split, stages, group, l2_promotion)
    m = cute.sym_int()
    x, res, out = fake_tensors(s["x_prev"], s["residual_prev"], s["residual_prev"], tokens=m)
    return compile_kernel(kernel, x, res, out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, nargs="+", default=[7168])
    ap.add_argument("--m", type=int, nargs="+", default=[8192])
    ap.add_argument("--block-h", type=int, nargs="+", default=[32, 64, 128])
    ap.add_argument("--tile-m", type=int, default=64)
    ap.add_argument("--split", type=int, default=2)
    ap.add_argument("--group", type=int, nargs="+", default=[1],
                    help="stages stored together (row pieces of group * block_h written at once)")
    ap.add_argument("--l2-promotion", nargs="+", default=["inline"], choices=["inline", "0", "1", "2", "3"],
                    help="CuTe's inline descriptors, or descriptors built by the compiled host code with this L2 "
                         "promotion")
    ap.add_argument("--in-flight", type=int, default=120 * 1024,
                    help="pipeline depth: as many stages as fit in this many bytes per CTA (at least 2)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    bw = mb.measure_copy_bandwidth(dev)
    print(f"GPU: {torch.cuda.get_device_name(dev)}, copy bandwidth {bw / 1e12:.2f} TB/s")
    kernels = {}
    for h in args.hidden:
        for m in args.m:
            sets = mb.rotated_sets(m, h, dev)
            outs = [torch.empty_like(s["residual_prev"]) for s in sets]
            by_id = {id(s): o for s, o in zip(sets, outs)}
            for bh, group, promotion in itertools.product(args.block_h, args.group, args.l2_promotion):
                stages = max(2, args.in_flight // (args.tile_m * 5 * bh * 2)) // group * group
                stages = max(stages, 2 * group)
                key = (h, bh, group, stages, promotion)
                if key not in kernels:  # compiled for any M
                    l2_promotion = None if promotion == "inline" else int(promotion)
                    kernels[key] = compiled(h, args.tile_m, bh, args.split, stages, sets, group, l2_promotion)
                fn = kernels[key]

                def call(s):
                    fn(s["x_prev"], s["residual_prev"], by_id[id(s)])
                for o in outs:
                    o.zero_()
                us = mb.time_graph(call, sets)
                ok = all(torch.equal(o, s["residual_prev"]) for s, o in zip(sets, outs))
                rate = 18 * h * m / (us * 1e-6)
                print(f"H={h} M={m} tile_m={args.tile_m} split={args.split} block_h={bh:4d} group={group} "
                      f"descriptors={promotion} stages={stages} {us:8.2f} us  "
                      f"{rate / 1e12:.2f} TB/s = {rate / bw:6.1%} of copy  copy ok={ok}", flush=True)
            del sets, outs
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
