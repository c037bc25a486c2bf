"""Paths B (``half_mma``) and D (``all_mma``): the mHC projection on tensor cores (TF32 wgmma), sm_90a.

Kernel 1 (``MmaFusedHcKernel``) streams one M tile x one K split per CTA through a TMA + mbarrier pipeline:

* a producer warp loads, per stage, the ``residual_prev [tile_m, 4, 32]`` and ``x_prev [tile_m, 32]`` tiles of
  one 32-wide block of H and the matching ``[n, 4 x 32]`` tile of the prepared weight (below);
* each MMA warpgroup owns 64 rows. Its threads compute ``residual_cur`` for the four streams straight into the
  register layout of the wgmma A operand (post-map), store it to global memory with 16-byte stores, add the
  squares of the bf16-rounded values, and issue TF32 wgmma with A from registers (exact: bf16 is a subset of
  TF32) and B (the weight) from shared memory. The delayed seam with one MMA warpgroup (m64) waits for a block's MMAs
  only after the next block's post-map (``mma_in_flight``); otherwise each block's MMAs are waited for at once.

Register A lets each thread own 8 *contiguous* H positions per row and stream: the K order inside every 32-wide
block is permuted so that wgmma's fragment (rows g/g+8, columns t/t+4 of each k8 step) lands on them, and the
weight is permuted the same way when it is prepared (``prepare_weight``). A dot product does not depend on the
order of K, only the rounding of the tensor core's sums does.

``precision="fp32"``: the weight is split into TF32 hi + lo (``hi = tf32_rn(fn)``, ``lo = tf32_rn(fn - hi)``)
and stacked along N, so one ``m64n48k8`` wgmma per K step computes both products. ``precision="tf32"``: hi
only, ``m64n24k8``. Either way the tensor cores accumulate one stage (K = 128) from zero and the stage sums
(hi + lo) are added in fp32 registers: a long accumulation inside HGMMA drifts by ~2e-5 relative at K = 28672.

Kernel 1 writes the split-K partials ``[split_k, M, 32]`` (columns 0..23 the unscaled dots of the split,
column 24 the sum of squares). Path B then launches the standalone big fuse (``big_fuse.BigFuseKernel``) from
the same compiled call; path D runs ``big_fuse.BigFusePhase`` in the CTA whose arrival completes its M tile's
counter (atomic election, no waiting; the counter is reset by that CTA).

The delayed seam (``delayed``, compile-time: "carried" or "identity"): the consumer threads also collapse the four
rounded streams they hold with the carried gates into ``x1`` (bf16), store it to ``layer_input`` (identity: stream
0) and with the norm add its squares into partial column 25; the big fuse writes the gates and normalises
``layer_input`` in place (``big_fuse.BigFusePhase.norm_in_place``).

The entry forms (``form``, compile-time). Without post (``"no_post"``) ``residual_prev`` is the streams: no
``x_prev`` tiles are loaded, nothing is stored to ``residual_cur``, and the big fuse collapses ``residual_prev``,
which the launch passes where ``residual_cur`` goes (``launch.KernelLaunch``). The broadcast entry
(``"broadcast"``): the embedding ``[M, H]`` is one input stream, stored four times as ``residual_cur`` and projected
over H with the prepared ``reference.broadcast_fn`` (K = 32 per stage); its sum of squares is stored times 4, so the
big fuse's mean over 4H is the SPEC's mean over H bit for bit (a power-of-two scale).
"""

from __future__ import annotations

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import functools  # noqa: E402
from typing import NamedTuple  # noqa: E402

import torch  # noqa: E402

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
import cutlass.pipeline as pipeline  # noqa: E402
from cutlass import BFloat16, Float32, Int32, const_expr  # noqa: E402
from cutlass._mlir.dialects import llvm  # noqa: E402
from cutlass.cutlass_dsl import dsl_user_op  # noqa: E402
from cutlass.cute.nvgpu import cpasync, warpgroup  # noqa: E402

from .. import tactics as tac  # noqa: E402
from ..tactics import HC_MULT, MMA_BLOCK_H as BLOCK_H, MMA_WG_THREADS as WG_THREADS  # noqa: E402
from ..tactics import N_MIXES, SUMSQ_COL  # noqa: E402
from ..tactics import MmaTactic, default_mma_tactic, mma_stage_bytes as stage_bytes  # noqa: E402
from ..reference import broadcast_fn  # noqa: E402
from ..weights import prepared  # noqa: E402
from . import device_utils as du  # noqa: E402
from . import (  # noqa: E402
    CompiledKernels, compile_in_processes, compile_kernel, delayed_mode, fake_buffer, fake_tensors,
    norm_dtype_of, resolve_tactic, seam_fakes, seam_scalars, spec_problem,
)
from .big_fuse import (  # noqa: E402
    X1_SUMSQ_COL, BigFusePhase, BigFuseScalars, flat_outputs, gate_rows, partials_view, standalone_big_fuse,
)
from .launch import KernelLaunch  # noqa: E402
from .wgmma_tf32 import make_tf32_tiled_mma  # noqa: E402



class _Consumer(NamedTuple):
    """A consumer thread of kernel 1: its K slice, its two rows, and its register tensors."""
    quad: object  # t: H offsets [8 t, 8 t + 8) of each 32-wide block
    rows: tuple  # its rows g, g + 8 in the tile
    tCrA: cute.Tensor  # the A fragment of one block (post-mapped residual_cur)
    tCrB: cute.Tensor  # the B fragments of every weight stage
    acc: cute.Tensor  # one block's MMA sums
    dots: cute.Tensor  # the split's fp32 dots
    post: cute.Tensor  # post_mix of its rows
    comb: cute.Tensor  # comb_mix of its rows
    sumsq: cute.Tensor  # the squares of its rows
    pre: cute.Tensor  # the delayed seam's carried pre gates of its rows
    x1_sumsq: cute.Tensor  # the delayed seam with the norm: the squares of its rows' collapse x1


def finish_phase(tactic: MmaTactic, hidden: int, norm_dtype, delayed: bool = False) -> BigFusePhase:
    """The big fuse of path D: one M tile, run by all threads of the CTA that completes it."""
    # the Sinkhorn after the collapse: inside the batch loop its 16 values went to the stack in this kernel
    return BigFusePhase(hidden, tactic.split_k, tactic.tile_m, tactic.threads, norm_dtype, sinkhorn_last=True,
                        delayed=delayed)


# ---------------------------------------------------------------------------------------------------------------
# The weight, prepared once per fn tensor: TF32 hi (+ lo), K permuted to match the register A fragment
# ---------------------------------------------------------------------------------------------------------------


def _tf32_rn(v: torch.Tensor) -> torch.Tensor:
    """Round fp32 to the nearest TF32 value (10 explicit mantissa bits; ties to even), kept as fp32."""
    bits = v.contiguous().view(torch.int32)
    lsb = (bits >> 13) & 1
    rounded = (bits + 0x0FFF + lsb) & ~0x1FFF
    finite = torch.isfinite(v)
    return torch.where(finite, rounded.view(torch.float32), v)


def split_tf32(fn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``fn = hi + lo`` (to about 2^-22 relative) with both parts exactly representable in TF32. An infinite weight
    is ``hi`` alone (``lo`` 0: inf - inf would make its products NaN where IEEE gives an infinity); NaN stays NaN."""
    hi = _tf32_rn(fn.float())
    lo = _tf32_rn(torch.where(torch.isinf(hi), 0.0, fn.float() - hi))
    return hi, lo


def block_permutation(device=None) -> torch.Tensor:
    """``perm[p]`` = the H offset (inside a 32-wide block) that MMA K position ``p`` of that block reads.

    K position ``8 s + c`` is column ``c`` of k8 step ``s``; wgmma gives thread ``t`` (of a quad) columns ``t``
    and ``t + 4``, which we map to H offsets ``8 t + 2 s`` and ``8 t + 2 s + 1``: thread ``t`` then holds the
    contiguous H range ``[8 t, 8 t + 8)``.
    """
    s = torch.arange(4, device=device)[:, None]  # built on the device: no host copy (legal during capture)
    c = torch.arange(8, device=device)[None, :]
    t = c % 4
    return (8 * t + 2 * s + c // 4).reshape(-1)


def prepare_weight(fn: torch.Tensor, precision: str, streams: int = HC_MULT) -> torch.Tensor:
    """The weight as the kernel's B tiles: ``[H/32, streams, n, 32]`` fp32, ``n = 48`` (hi rows 0..23, lo rows
    24..47) for ``"fp32"``, ``n = 24`` (hi) for ``"tf32"``; inside each 32-block the K order is permuted by
    ``block_permutation``. ``fn``: ``[24, streams * H]`` (the broadcast entry's ``broadcast_fn``: one stream)."""
    n_mix, k = fn.shape
    hidden = k // streams
    hi, lo = split_tf32(fn)
    parts = [hi, lo] if precision == "fp32" else [hi]
    w = torch.cat(parts, dim=0)  # [n, streams * H], column j*H + h
    n = w.shape[0]
    w = w.view(n, streams, hidden // BLOCK_H, BLOCK_H)[..., block_permutation(w.device)]
    return w.permute(2, 1, 0, 3).contiguous()


def _prepare_broadcast_weight(fn: torch.Tensor, precision: str) -> torch.Tensor:
    return prepare_weight(broadcast_fn(fn), precision, 1)


@functools.lru_cache(maxsize=None)
def weight_of(precision: str, broadcast: bool = False):
    """``fn -> cached_weight(fn, precision)`` (the broadcast entry: of ``broadcast_fn(fn)``) with its arguments to
    ``weights.prepared`` built once (a launch calls it per call)."""
    if broadcast:
        kind, prepare = f"mma_{precision}_broadcast", functools.partial(_prepare_broadcast_weight, precision=precision)
    else:
        kind, prepare = f"mma_{precision}", functools.partial(prepare_weight, precision=precision)
    return lambda fn: prepared(fn, kind, prepare)


def cached_weight(fn: torch.Tensor, precision: str) -> torch.Tensor:
    """``prepare_weight`` once per weight tensor and precision (``weights.prepared``)."""
    return weight_of(precision)(fn)


# ---------------------------------------------------------------------------------------------------------------
# Kernel 1: post-map + residual_cur store + sum of squares + TF32 wgmma projection -> split-K partials
# ---------------------------------------------------------------------------------------------------------------


@dsl_user_op
def fence_register(val: Float32, *, loc=None, ip=None) -> Float32:
    """``val`` through an empty volatile asm: no instruction, but the compiler cannot move a read of the register
    above an earlier volatile operation (a ``wgmma.wait_group``), as ptxas needs to keep wgmma asynchronous."""
    return Float32(llvm.inline_asm(Float32.mlir_type, [Float32(val).ir_value(loc=loc, ip=ip)], "", "=f,0",
                                   has_side_effects=True, is_align_stack=False,
                                   asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@cute.jit
def fence_registers(frag: cute.Tensor):
    """``fence_register`` on every element of the fp32 register tensor ``frag`` (an MMA accumulator, after its
    wait)."""
    for i in cutlass.range_constexpr(cute.size(frag)):
        frag[i] = fence_register(frag[i])


class MmaFusedHcKernel:
    """Kernel 1 (post-map, ``residual_cur``, sum of squares, TF32 wgmma projection, split-K partials) for one
    (H, tactic, precision, norm dtype, seam: ``delayed`` None, or "carried" / "identity" as ``kernels.delayed_mode``
    names it; ``form``: "regular", "no_post" or "broadcast", as ``Problem.form``). Path B launches the standalone big
    fuse after it; path D runs the big fuse in the CTA that completes an M tile (last-arriver election on a per-tile
    counter, no waiting)."""

    def __init__(self, hidden: int, tactic: MmaTactic, precision: str, norm_dtype, delayed: str | None = None,
                 form: str = "regular"):
        tactic.check(hidden)
        self.hidden = hidden
        self.delayed = delayed
        self.has_post = form == "regular"  # else no x_prev tiles, no post coefficients
        self.broadcast = form == "broadcast"
        self.in_streams = 1 if self.broadcast else HC_MULT  # streams of the activation tiles and the weight
        self.x1_norm = delayed is not None and norm_dtype is not None  # kernel 1 sums x1's squares
        self.tactic = tactic
        self.tile_m = tactic.tile_m
        self.split_k = tactic.split_k
        self.stages = tactic.stages
        self.n_parts = 2 if precision == "fp32" else 1
        self.n = N_MIXES * self.n_parts
        self.n_hblk = hidden // BLOCK_H
        self.mma_wgs = self.tile_m // 64
        self.producer_warp = self.mma_wgs * 4
        self.threads = tactic.threads
        self.k_stage = self.in_streams * BLOCK_H  # MMA K per stage: 4 streams (the broadcast entry: 1) x 32
        self.fused = tactic.path == "all_mma"
        # the delayed seam on path B with one MMA warpgroup: a block's MMAs run under the next block's post-map (its
        # A fragment and accumulator live across it: 253 registers; two warpgroups' 168 would spill). Measured
        # faster there only, not for the V4 seam or path D (docs/experiments.md, 2026-12-05)
        self.mma_in_flight = self.tile_m == 64 and delayed is not None and not self.fused
        if self.fused:
            self.finish = finish_phase(tactic, hidden, norm_dtype, delayed is not None)
        else:
            self.big_fuse = standalone_big_fuse(hidden, tactic.split_k, norm_dtype, tactic.fuse, delayed is not None)

    # -------------------------------------------------------------------- host side
    @cute.jit
    def __call__(
        self,
        mX,  # [M, H] bf16 | None (no post)
        mRes: cute.Tensor,  # [M, 4, H] bf16 (the broadcast entry: [M, H])
        mPost,  # [M, 4] f32 | None (no post)
        mComb,  # [M, 4, 4] f32 | None (no post)
        mW: cute.Tensor,  # [H/32, 4, n, 32] f32 (prepare_weight)
        mScale: cute.Tensor,  # [3] f32
        mBase: cute.Tensor,  # [24] f32
        mNormW,  # [H] bf16 | f32 | None
        mResOut: cute.Tensor,  # [M, 4, H] bf16 (no post: residual_prev, read by the big fuse)
        mPostOut: cute.Tensor,  # [M, 4, 1] f32
        mCombOut: cute.Tensor,  # [M, 4, 4] f32
        mLayerIn: cute.Tensor,  # [M, H] bf16
        workspace: cute.Tensor,  # flat f32, holds the partials [split_k, M, 32]
        counters: cute.Tensor,  # flat i32, one per M tile, zero between calls (path D)
        mPre,  # [M, 4] f32 | None: the delayed seam's carried gates (None: identity, or mhc_fused_hc)
        mPreCur,  # [M, 4] f32 | None: the delayed seam's output gates
        rms_eps: Float32,
        hc_pre_eps: Float32,
        hc_sinkhorn_eps: Float32,
        hc_post_mult_value: Float32,
        sinkhorn_repeat: Int32,
        norm_eps: Float32,
        stream,
    ):
        tile_m, stages = self.tile_m, self.stages
        m = mRes.shape[0]
        if const_expr(self.broadcast):  # the embedding as one stream
            mRes = cute.make_tensor(mRes.iterator, cute.make_layout((m, 1, self.hidden),
                                                                    stride=(mRes.stride[0], self.hidden, 1)))
        res_layout, x_layout, tma_res, tma_mRes, tma_x, tma_mX = self.activation_tma(mRes, mX, BLOCK_H, stages)
        w_layout, tma_w, tma_mB = self.weight_tma(mW)
        tiled_mma = make_tf32_tiled_mma(self.n, warpgroup.OperandSource.RMEM)

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
            res_layout, x_layout, w_layout, mScale, mBase, mNormW, flat, counters, scalars, pre, pre_out,
        ).launch(
            grid=[cute.ceil_div(m, tile_m) * self.split_k, 1, 1], block=[self.threads, 1, 1], stream=stream,
            use_pdl=True,
        )
        if const_expr(not self.fused):
            self.big_fuse.launch(partials, mScale, mBase, mNormW, *flat, scalars, stream, pre_out)

    @cute.jit
    def activation_tma(self, mRes: cute.Tensor, mX: cute.Tensor, wide: int, stages: int):
        """The activations' stage layouts and TMA atoms: ``residual_prev [tile_m, 4, wide]`` and ``x_prev
        [tile_m, wide]`` per stage, ``stages`` of them (no post: no x tiles; a one-element layout keeps the shared
        storage's shape). The residual tile as [stream][row][wide]: at ``wide`` = 32 the 8 rows a quarter-warp
        reads are 64 B apart, conflict-free.

        Inline descriptors (encoded by the compiled host code, passed by value) rather than tma_cache's
        device-resident ones, for every operand: they cost less host time than a cache hit, and a by-pointer
        descriptor adds a per-CTA tensormap fence and fetch (measured: tma_cache/README.md)."""
        tile_m = self.tile_m
        streams = self.in_streams
        res_layout = cute.make_layout(
            (tile_m, streams, wide, stages), stride=(wide, tile_m * wide, 1, tile_m * wide * streams)
        )
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_res, tma_mRes = cpasync.make_tiled_tma_atom(
            g2s, mRes, cute.slice_(res_layout, (None, None, None, 0)), (tile_m, streams, wide)
        )
        if const_expr(not self.has_post):
            return res_layout, cute.make_layout(1), tma_res, tma_mRes, None, None
        x_layout = cute.make_layout((tile_m, wide, stages), stride=(wide, 1, tile_m * wide))
        tma_x, tma_mX = cpasync.make_tiled_tma_atom(g2s, mX, cute.slice_(x_layout, (None, None, 0)), (tile_m, wide))
        return res_layout, x_layout, tma_res, tma_mRes, tma_x, tma_mX

    @cute.jit
    def weight_tma(self, mW: cute.Tensor):
        """The weight's stage layout (K-major, 128-byte swizzle, [stream][n][32] per stage, ``stages`` of them) and
        its TMA atom over B viewed as (n, K) with K in stage order: k = k_stage * block + 32 * stream + p (k_stage 128,
        32 for the broadcast entry's one stream). The stage layout is built on its own: slicing the staged composed
        layout aborts the 4.8.1 compiler for n = 48."""
        w_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, Float32)
        w_stage_layout = cute.tile_to_shape(w_atom, (self.n, self.k_stage), order=(0, 1))
        w_layout = cute.tile_to_shape(w_atom, (self.n, self.k_stage, self.stages), order=(0, 1, 2))
        mB = cute.make_tensor(
            mW.iterator,
            cute.make_layout((self.n, (BLOCK_H, self.in_streams * self.n_hblk)),
                             stride=(BLOCK_H, (1, BLOCK_H * self.n))),
        )
        tma_w, tma_mB = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mB, w_stage_layout,
                                                    (self.n, self.k_stage))
        return w_layout, tma_w, tma_mB

    # -------------------------------------------------------------------- device side
    @cute.kernel
    def kernel(
        self,
        tma_res: cute.CopyAtom,
        tma_mRes: cute.Tensor,
        tma_x,  # None without a post
        tma_mX,
        tma_w: cute.CopyAtom,
        tma_mB: cute.Tensor,
        mPost,
        mComb,
        mResOut: cute.Tensor,
        mPartials: cute.Tensor,
        tiled_mma: cute.TiledMma,
        res_layout: cute.Layout,
        x_layout: cute.Layout,
        w_layout: cute.ComposedLayout,
        mScale: cute.Tensor,
        mBase: cute.Tensor,
        mNormW,
        flat: tuple,
        counters: cute.Tensor,
        scalars: BigFuseScalars,
        mPre,
        mPreOut,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        if const_expr(not self.fused and self.tactic.fuse == "lat"):
            # path B at latency-bound sizes: the big-fuse CTAs launch while this grid runs and wait for it
            # (griddepcontrol.wait), so their launch latency leaves the critical path. Not for "bw", where it was
            # slower: CTAs placed while this grid holds the SMs crowd onto the few idle ones (docs/experiments.md)
            cute.arch.griddepcontrol_launch_dependents()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        split = bidx % self.split_k
        m_tile = bidx // self.split_k
        # this split's 32-wide H blocks: [blk_begin, blk_begin + n_blk)
        blk_begin = split * self.n_hblk // self.split_k
        n_blk = (split + 1) * self.n_hblk // self.split_k - blk_begin

        if warp_idx == self.producer_warp:
            cpasync.prefetch_descriptor(tma_res)
            if const_expr(self.has_post):
                cpasync.prefetch_descriptor(tma_x)
            cpasync.prefetch_descriptor(tma_w)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        finish_storage = None
        if const_expr(self.fused):
            finish_storage = self.finish.allocate(smem)
        sRes = storage.sRes.get_tensor(res_layout)
        sX = storage.sX.get_tensor(x_layout) if const_expr(self.has_post) else None
        sW = storage.sW.get_tensor(w_layout.outer, swizzle=w_layout.inner)

        ab_pipeline = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.mma_wgs * 4),
            tx_count=stage_bytes(self.tile_m, self.n_parts, with_x=self.has_post, streams=self.in_streams),
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
        )

        # launched with programmatic dependent launch: the setup above overlaps the previous kernel's end
        cute.arch.griddepcontrol_wait()
        if const_expr(self.fused):
            cute.arch.griddepcontrol_launch_dependents()
        if warp_idx == self.producer_warp:
            self.produce(ab_pipeline, tma_res, tma_mRes, tma_x, tma_mX, tma_w, tma_mB, sRes, sX, sW, m_tile,
                         blk_begin, n_blk)
        # two ifs, not if/else: compiled with the else branch, the consumer's main loop spilled registers and the
        # kernel had 9-10% more instructions (sm_90a SASS, docs/experiments.md 2026-12-05)
        if warp_idx < self.producer_warp:
            self.consume(ab_pipeline, tiled_mma, sRes, sX, sW, mPost, mComb, mPre, mResOut, flat[3], mPartials, tidx,
                         m_tile, split, blk_begin, n_blk)

        if const_expr(self.fused):
            # last-arriver election: every thread fences its partial and residual stores (release) before the
            # barrier; the CTA whose arrival completes the tile's count runs the big fuse for it, the others exit
            if const_expr(self.split_k == 1):
                # the tile's partials, residual_cur (and x1) were stored by the other consumer threads: a CTA barrier
                # orders those stores before the big fuse's loads (its first barrier comes after some of them)
                cute.arch.sync_threads()
                self.finish_tile(finish_storage, m_tile, mPartials, mScale, mBase, mNormW, flat, scalars, mPreOut)
            else:
                cute.arch.fence_acq_rel_gpu()
                cute.arch.sync_threads()
                is_last = storage.is_last.get_tensor(cute.make_layout(1))
                if tidx == 0:
                    arrived = cute.arch.atomic_add(counters.iterator + m_tile, Int32(1), sem="acq_rel", scope="gpu")
                    is_last[0] = Int32(arrived == self.split_k - 1)
                cute.arch.sync_threads()
                if is_last[0] != 0:
                    cute.arch.fence_acq_rel_gpu()  # acquire: the other splits' stores are visible
                    self.finish_tile(finish_storage, m_tile, mPartials, mScale, mBase, mNormW, flat, scalars,
                                     mPreOut)
                    if tidx == 0:
                        counters[m_tile] = Int32(0)  # ready for the next call without a zeroing launch

    @cute.jit
    def finish_tile(self, finish_storage, m_tile, mPartials, mScale, mBase, mNormW, flat, scalars, mPreOut):
        self.finish(finish_storage, m_tile * self.tile_m, mPartials, mScale, mBase, mNormW, *flat, scalars, mPreOut)

    @cute.jit
    def produce(self, ab_pipeline, tma_res, tma_mRes, tma_x, tma_mX, tma_w, tma_mB, sRes, sX, sW, m_tile,
                blk_begin, n_blk):
        tile_m = self.tile_m
        gRes = cute.local_tile(tma_mRes, (tile_m, self.in_streams, BLOCK_H), (m_tile, 0, None))
        gB = cute.local_tile(tma_mB, (self.n, self.k_stage), (0, None))
        one = cute.make_layout(1)
        tRs, tRg = cpasync.tma_partition(tma_res, 0, one, cute.group_modes(sRes, 0, 3), cute.group_modes(gRes, 0, 3))
        tXs, tXg = None, None
        if const_expr(self.has_post):
            gX = cute.local_tile(tma_mX, (tile_m, BLOCK_H), (m_tile, None))
            tXs, tXg = cpasync.tma_partition(tma_x, 0, one, cute.group_modes(sX, 0, 2), cute.group_modes(gX, 0, 2))
        tBs, tBg = cpasync.tma_partition(tma_w, 0, one, cute.group_modes(sW, 0, 2), cute.group_modes(gB, 0, 2))
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        for i in cutlass.range(n_blk, unroll=1):
            blk = blk_begin + i
            ab_pipeline.producer_acquire(state)
            bar = ab_pipeline.producer_get_barrier(state)
            cute.copy(tma_res, tRg[(None, blk)], tRs[(None, state.index)], tma_bar_ptr=bar)
            if const_expr(self.has_post):
                cute.copy(tma_x, tXg[(None, blk)], tXs[(None, state.index)], tma_bar_ptr=bar)
            cute.copy(tma_w, tBg[(None, blk)], tBs[(None, state.index)], tma_bar_ptr=bar)
            ab_pipeline.producer_commit(state)
            state.advance()
        ab_pipeline.producer_tail(state)

    @cute.jit
    def consume(self, ab_pipeline, tiled_mma, sRes, sX, sW, mPost, mComb, mPre, mResOut, mLayerIn, mPartials, tidx,
                m_tile, split, blk_begin, n_blk):
        m_total = mResOut.shape[0]
        ctx = self.consumer_setup(tiled_mma, sW, mPost, mComb, m_total, tidx, m_tile, mPre)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        for i in cutlass.range(n_blk, unroll=1):
            ab_pipeline.consumer_wait(state)
            si = state.index
            held = self.post_block(ctx, sX, sRes, si, ctx.quad, mResOut, blk_begin + i, m_tile, m_total)
            if const_expr(self.mma_in_flight):
                # the previous block's MMAs ran under this block's post-map: only now wait for them
                self.finish_previous_block(ctx, ab_pipeline, state, i > 0)
            self.project_block(ctx, tiled_mma, sRes, held, si, ctx.quad, si, blk_begin + i, m_tile, m_total, mLayerIn)
            if const_expr(not self.mma_in_flight):
                warpgroup.wait_group(0)
                ab_pipeline.consumer_release(state)
                self.accumulate_block(ctx)
            state.advance()
        if const_expr(self.mma_in_flight):
            self.finish_previous_block(ctx, ab_pipeline, state, n_blk > 0)
        self.store_partials(ctx, mPartials, split, m_tile, m_total)

    @cute.jit
    def finish_previous_block(self, ctx: "_Consumer", ab_pipeline, state, had_previous):
        """``mma_in_flight``: wait for the block before ``state``'s MMAs (if ``had_previous``), then free its stage
        (its weight tile) and add its sums into the dots."""
        warpgroup.wait_group(0)
        fence_registers(ctx.acc)
        if had_previous:
            ab_pipeline.consumer_release(self._previous(state))
            self.accumulate_block(ctx)

    @cute.jit
    def _previous(self, state):
        """The consumer state one stage before ``state`` (only its index is read by a release)."""
        return pipeline.PipelineState(self.stages, state.count, (state.index + (self.stages - 1)) % self.stages,
                                      state.phase)

    @cute.jit
    def consumer_setup(self, tiled_mma, sW, mPost, mComb, m_total, tidx, m_tile, mPre=None) -> "_Consumer":
        """A consumer thread's fragments, accumulators and mixing coefficients (``_Consumer``)."""
        wg = tidx // WG_THREADS
        wg_tid = tidx % WG_THREADS
        lane = tidx % 32
        quad = lane % 4  # t: the thread's 8-wide H slice [8 t, 8 t + 8) and its K columns t, t + 4
        # rows (inside the tile) of the wgmma fragment: g and g + 8 of this warp's 16-row slab
        row0 = wg * 64 + (wg_tid // 32) * 16 + lane // 4
        rows = (row0, row0 + 8)

        thr_mma = tiled_mma.get_slice(wg_tid)
        tCrA = thr_mma.make_fragment_A(thr_mma.partition_shape_A((64, self.k_stage)))
        tCrB = thr_mma.make_fragment_B(thr_mma.partition_B(sW))
        # the tensor cores accumulate one stage (128 K) into acc; the stage sums (hi + lo) are added into
        # dots with fp32 FADD. A long accumulation inside the tensor cores loses precision (Hopper's
        # accumulator is not a full fp32 adder); a 128-deep one does not matter.
        acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((64, self.n)), Float32)
        dots = cute.make_rmem_tensor((N_MIXES // 2,), Float32)  # columns 2 t + a + 8 c of rows g, g + 8
        dots.fill(0.0)

        # post_mix[m, j] and comb_mix[m, k, j] of this thread's two rows (zero past M: those rows are not stored;
        # none without a post)
        post = cute.make_rmem_tensor((2, HC_MULT), Float32)
        comb = cute.make_rmem_tensor((2, HC_MULT, HC_MULT), Float32)
        post.fill(0.0)
        comb.fill(0.0)
        if const_expr(self.has_post):
            for r in cutlass.range_constexpr(2):
                m = m_tile * self.tile_m + rows[r]
                if m < m_total:
                    for j in cutlass.range_constexpr(HC_MULT):
                        post[r, j] = mPost[m, j]
                        for k in cutlass.range_constexpr(HC_MULT):
                            comb[r, k, j] = mComb[m, k, j]
        pre = cute.make_rmem_tensor((2, HC_MULT), Float32)  # the carried gates (delayed seam, "carried")
        pre.fill(0.0)
        if const_expr(mPre is not None):
            for r in cutlass.range_constexpr(2):
                m = m_tile * self.tile_m + rows[r]
                if m < m_total:
                    for j in cutlass.range_constexpr(HC_MULT):
                        pre[r, j] = mPre[m, j]
        sumsq = cute.make_rmem_tensor((2,), Float32)
        sumsq.fill(0.0)
        x1_sumsq = cute.make_rmem_tensor((2,), Float32)
        x1_sumsq.fill(0.0)
        return _Consumer(quad, rows, tCrA, tCrB, acc, dots, post, comb, sumsq, pre, x1_sumsq)

    @cute.jit
    def post_block(self, ctx: "_Consumer", sX, sRes, si, vec_in_row, mResOut, blk, m_tile, m_total):
        """One 32-wide block of H, the part that does not touch the MMA's registers: the post-map of the thread's
        8-vectors (``vec_in_row`` of its rows in the activation stage ``si``) into ``residual_cur`` (H block ``blk``;
        the broadcast entry: the embedding four times), row by row. Returns the rounded streams for
        ``project_block`` (None without a post: it reads them from the stage)."""
        if const_expr(not self.has_post and not self.broadcast):
            return None
        # each 8-vector contiguous: stored with one 16-byte store
        held = cute.make_rmem_tensor(cute.make_layout((2, HC_MULT, du.VEC_BF16), stride=(HC_MULT * du.VEC_BF16,
                                                                                         du.VEC_BF16, 1)), BFloat16)
        xv = cute.make_rmem_tensor((du.VEC_BF16,), Float32)
        rv = cute.make_rmem_tensor((self.in_streams, du.VEC_BF16), Float32)
        vec_idx = blk * (BLOCK_H // du.VEC_BF16) + ctx.quad
        for r in cutlass.range_constexpr(2):
            if const_expr(self.has_post):
                xv.store(du.load_bf16x8(self._vec(sX[(ctx.rows[r], None, si)], vec_in_row)))
            for k in cutlass.range_constexpr(self.in_streams):
                rv[k, None].store(du.load_bf16x8(self._vec(sRes[(ctx.rows[r], k, None, si)], vec_in_row)))
            m = m_tile * self.tile_m + ctx.rows[r]
            for j in cutlass.range_constexpr(HC_MULT):
                if const_expr(self.broadcast):
                    held[r, j, None].store(rv[0, None].load().to(BFloat16))  # stream j is a copy of the embedding
                else:
                    # SPEC step 1: acc = post[j] x[h]; acc = fma(comb[k][j], res[k][h], acc), k = 0..3
                    for e in cutlass.range_constexpr(du.VEC_BF16):
                        held[r, j, e] = du.post_element(ctx.post[r, j], xv[e],
                                                        [ctx.comb[r, k, j] for k in range(HC_MULT)],
                                                        [rv[k, e] for k in range(HC_MULT)]).to(BFloat16)
            if m < m_total:
                for j in cutlass.range_constexpr(HC_MULT):
                    cute.autovec_copy(held[r, j, None], self._vec(mResOut[(m, j, None)], vec_idx))
        return held

    @cute.jit
    def project_block(self, ctx: "_Consumer", tiled_mma, sRes, held, si, vec_in_row, wi, blk, m_tile, m_total,
                      mLayerIn=None):
        """The rest of the block once the previous block's MMAs are done: the squares and the A fragment of the
        rounded streams (``held``; without a post the stage's ``residual_prev``), the delayed seam's collapse x1
        into ``layer_input`` (``store_x1``), then the block's MMAs against weight stage ``wi``, issued and not
        waited for: ``consume`` waits right after, or with ``mma_in_flight`` under the next block's post-map."""
        xf = cute.make_rmem_tensor((du.VEC_BF16,), Float32)
        x1 = cute.make_rmem_tensor((2, du.VEC_BF16), Float32)  # the carried collapse's fp32 chain, per row
        vec_idx = blk * (BLOCK_H // du.VEC_BF16) + ctx.quad
        for j in cutlass.range_constexpr(HC_MULT):
            for r in cutlass.range_constexpr(2):
                if const_expr(held is None):
                    xf.store(du.load_bf16x8(self._vec(sRes[(ctx.rows[r], j, None, si)], vec_in_row)))
                else:
                    xf.store(held[r, j, None].load().to(Float32))  # not widen_bf16x8: here it made the loop spill
                if const_expr(j < self.in_streams):  # the broadcast entry projects stream 0 alone
                    for e in cutlass.range_constexpr(du.VEC_BF16):
                        ctx.sumsq[r] = cute.math.fma(xf[e], xf[e], ctx.sumsq[r])
                        # H offset 8 t + e is K column t (e even) or t + 4 (e odd) of k8 step 4 j + e // 2
                        ctx.tCrA[(r + 2 * (e % 2), 0, j * 4 + e // 2)] = xf[e]
                if const_expr(self.delayed == "carried"):
                    for e in cutlass.range_constexpr(du.VEC_BF16):
                        x1[r, e] = du.collapse_term(j, ctx.pre[r, j], xf[e], None if const_expr(j == 0) else x1[r, e])
                if const_expr(self.delayed == "identity" and j == 0):
                    x1[r, None].store(xf.load())
        if const_expr(self.delayed is not None):
            for r in cutlass.range_constexpr(2):
                self.store_x1(ctx, x1, r, mLayerIn, m_tile * self.tile_m + ctx.rows[r], m_total, vec_idx)
        warpgroup.fence()
        mma_atom = cute.make_mma_atom(tiled_mma.op)  # a fresh atom per stage: its ACCUMULATE flag changes
        mma_atom.set(warpgroup.Field.ACCUMULATE, False)
        for ks in cutlass.range_constexpr(self.k_stage // 8):
            cute.gemm(mma_atom, ctx.acc, ctx.tCrA[(None, None, ks)], ctx.tCrB[(None, None, ks, wi)], ctx.acc)
            mma_atom.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()

    @cute.jit
    def store_x1(self, ctx: "_Consumer", x1: cute.Tensor, r, mLayerIn: cute.Tensor, m, m_total, vec_idx):
        """Row ``r``'s collapse (``x1[r]``, fp32) to ``layer_input`` as bf16 (8-vector ``vec_idx`` of token ``m``),
        with the norm its rounded squares into ``ctx.x1_sumsq``."""
        if m < m_total:
            rounded = du.store_bf16x8(self._vec(du.token_row(mLayerIn, m), vec_idx), x1[r, None].load())
            if const_expr(self.x1_norm):
                ctx.x1_sumsq[r] = ctx.x1_sumsq[r] + du.sum_squares(rounded)

    @cute.jit
    def accumulate_block(self, ctx: "_Consumer"):
        """The block's MMA sums into the fp32 dots (hi rows 0..23 + lo rows 24..47)."""
        for i in cutlass.range_constexpr(N_MIXES // 2):
            if const_expr(self.n_parts == 2):
                ctx.dots[i] = ctx.dots[i] + (ctx.acc[i] + ctx.acc[i + N_MIXES // 2])
            else:
                ctx.dots[i] = ctx.dots[i] + ctx.acc[i]

    @cute.jit
    def store_partials(self, ctx: "_Consumer", mPartials, split, m_tile, m_total):
        """partials[split, m, c] = dots (columns 2 t, 2 t + 1 of each 8-column block), the sum of squares (and the
        delayed seam's sum of squares of x1 with the norm)."""
        for r in cutlass.range_constexpr(2):
            ctx.sumsq[r] = du.warp_sum(ctx.sumsq[r], lanes=4)
            if const_expr(self.x1_norm):
                ctx.x1_sumsq[r] = du.warp_sum(ctx.x1_sumsq[r], lanes=4)
        for r in cutlass.range_constexpr(2):
            m = m_tile * self.tile_m + ctx.rows[r]
            if m < m_total:
                for c in cutlass.range_constexpr(N_MIXES // 8):
                    for a in cutlass.range_constexpr(2):
                        mPartials[split, m, 8 * c + 2 * ctx.quad + a] = ctx.dots[a + 2 * r + 4 * c]
                if ctx.quad == 0:
                    if const_expr(self.broadcast):
                        # 4 x the squares over H: the big fuse's sum over the 4H of the copies
                        mPartials[split, m, SUMSQ_COL] = ctx.sumsq[r] * Float32(HC_MULT)
                    else:
                        mPartials[split, m, SUMSQ_COL] = ctx.sumsq[r]
                    if const_expr(self.x1_norm):
                        mPartials[split, m, X1_SUMSQ_COL] = ctx.x1_sumsq[r]

    @staticmethod
    @cute.jit
    def _vec(row: cute.Tensor, idx) -> cute.Tensor:
        """The ``idx``-th 8-element (16-byte) vector of a 1-D bf16 tensor."""
        return cute.local_tile(row, (du.VEC_BF16,), (idx,))


# ---------------------------------------------------------------------------------------------------------------
# Compilation (fake tensors, TVM-FFI) and the torch-facing launchers
# ---------------------------------------------------------------------------------------------------------------


_compiled = CompiledKernels("mhc_mma", "mma.py")


def compiled_mma(tactic: MmaTactic, problem, out):
    """The compiled launcher for (tactic, H, precision, norm dtype, seam, form), compiled (or loaded) on first use."""
    norm = None if problem.norm_weight is None else str(problem.norm_weight.dtype)
    key = (tactic.name, problem.hidden, problem.precision, norm)
    if problem.delayed:  # mhc_fused_hc's keys (and persisted file names) stay as they were
        key += (delayed_mode(problem),)
    if problem.form != "regular":
        key += (problem.form,)
    return _compiled.get(key, lambda: compile_mma(tactic, problem, out))


def compile_mma(tactic: MmaTactic, problem, out):
    """Compile ``tactic.path`` against fake tensors shaped like ``problem`` and ``out`` (no GPU needed)."""
    h = problem.hidden
    no_post = problem.form == "no_post"
    kernel = MmaFusedHcKernel(h, tactic, problem.precision, norm_dtype_of(problem.norm_weight), delayed_mode(problem),
                              problem.form)
    m = cute.sym_int()
    token_tensors = fake_tensors(problem.x, problem.residual, problem.post_mix, problem.comb_mix, tokens=m)
    # without a post the big fuse collapses residual_prev, passed where residual_cur goes (``KernelLaunch``)
    outputs = fake_tensors(problem.residual if no_post else out[0], *out[1:4], tokens=m)
    weight = torch.empty(h // BLOCK_H, kernel.in_streams, kernel.n, BLOCK_H)  # shape of the prepared weight
    weight, norm_weight = fake_tensors(weight, problem.norm_weight)
    scale, base = fake_tensors(problem.hc_scale, problem.hc_base, align=4)  # read as scalars
    return compile_kernel(kernel, *token_tensors, weight, scale, base, norm_weight, *outputs, fake_buffer(Float32),
                          fake_buffer(Int32), *seam_fakes(problem, out, m), *seam_scalars())


@functools.lru_cache(maxsize=4096)
def _default_tactic(path: str, m: int, hidden: int, sm_count: int) -> MmaTactic:
    return default_mma_tactic(path, m, hidden, sm_count)


def _prepare(path: str, problem, tactic, out):
    tactic = resolve_tactic(path, tactic, problem, _default_tactic)
    return KernelLaunch(compiled_mma(tactic, problem, out), problem, tactic, -(-problem.m // tactic.tile_m),
                        weight_of(problem.precision, problem.broadcast))


def prepare_half_mma(problem, tactic, out):
    """Path B: kernel 1, then the big-fuse kernel (two launches, one host call); both seams, every form."""
    return _prepare("half_mma", problem, tactic, out)


def prepare_all_mma(problem, tactic, out):
    """Path D: one launch; the CTA that completes an M tile runs its big fuse. Both seams, every form."""
    return _prepare("all_mma", problem, tactic, out)


def _compile_spec(spec) -> str:
    """Process-pool worker of ``precompile``: compile (and persist) one (tactic name, H, precision, norm[, seam[,
    form]])."""
    name, hidden, precision, norm, *seam = spec
    problem = spec_problem(hidden, precision, norm, *seam)
    compiled_mma(tac.parse_tactic(name), problem, problem.empty_outputs())
    return name


def precompile(specs, processes: int | None = None) -> list[str]:
    """Compile (tactic name, H, precision, norm dtype name or None[, seam: ``delayed_mode``'s "carried" /
    "identity" or None[, form: "regular" / "no_post" / "broadcast"]]) variants in parallel worker processes."""
    return compile_in_processes(_compile_spec, specs, processes)
