"""Paths E (``half_fma``) and F (``all_fma``): the mHC boundary op with a CUDA-core (FFMA) projection.

The projection kernel, grid ``(ceil(M / tokens_per_cta), split_k)``: a CTA owns ``tokens_per_cta`` tokens
and one H range of all 4 streams, walked in chunks of ``chunk_h`` positions. Per chunk:

1. post-map (SPEC step 1), every ``burst`` chunks: a thread per (token, 8 positions) loads ``x_prev`` and the
   4 ``residual_prev`` vectors (16-byte loads), runs the exact chain ``acc = post[j] * x; acc = fma(comb[k][j],
   res[k], acc)``, stores ``residual_cur`` (bf16) and puts the rounded values, widened to fp32, in shared
   memory (a larger burst keeps more threads busy and more bytes in flight per step);
2. projection: thread (column group g, K vector v) multiplies the chunk's 4 activations of v by its
   ``tile_n`` weight rows (16-byte loads from L2, issued before step 1 so they overlap it), for every token,
   and group 0 also accumulates the sum of squares.

Then the CTA reduces over its threads (a reduce-scatter across each warp, then warps in order) and writes one
partial row per token: ``partials[split, m, 0..23]`` dots, ``[.., 24]`` the sum of squares (layout: ``big_fuse``).
With ``warp_mma`` (``:mma`` tactics) step 2 runs on the tensor cores instead (``project_mma``: each warp a K range
of the chunk, every column, up to 32 tokens, TF32 hi + lo) and the CTA reduces over its warps only
(``write_partials_mma``); on the H200 that pays from M = 16 (``docs/experiments.md``).

The entry forms (``form``, compile-time): without a post (``"no_post"``) the streams are ``residual_prev`` itself,
read and never written. The broadcast entry (``"broadcast"``) reads the embedding ``[M, H]`` once and writes it
four times as ``residual_cur``; its projection runs over H with the summed weight ``reference.broadcast_fn``, which
the kernel walks as if the embedding's four quarters were the four streams of a seam of H / 4 (same K layout:
quarter q of ``fn_b`` is at q H / 4), with the split of ``tactics.fma_broadcast_tactic``; its sum of squares is
stored times 4, so the big fuse's mean over 4H is the SPEC's mean over H exactly.

The delayed seam (``delayed``, compile-time: "carried" or "identity"): the post-map step also collapses the 4
rounded streams with the carried gates into ``x1`` (bf16) and stores it to ``layer_input`` (identity: stream 0),
and with the norm each task's sum of squares of x1 goes to shared memory, summed per token in a fixed order into
partial column 25 (``store_x1_sumsq``); the big fuse then writes the gates and normalises ``layer_input`` in place.

Path E launches the standalone big-fuse kernel after it (two launches, one compiled call). Path F runs the
big fuse in the same launch: each CTA publishes its partials (release fence, atomic add on its token block's
counter); the CTA that arrives last (acquire fence) runs ``BigFusePhase`` for the block and resets the
counter to zero, so counters need no zeroing launch. No CTA ever waits for another.

Weights and activations are plain 16-byte loads (no TMA yet): at decode sizes each CTA moves a few KiB per
step and all loads of a step are in flight at once. ``stages=2`` loads the next chunk's weights while the
current chunk is computed; ``burst`` widens the post-map step. ``post_map`` is the seam for a TMA pipeline:
a TMA-fed version would fill the step's bf16 source tiles in shared memory from descriptors (inline
``make_tiled_tma_atom``, or ``tma_cache``) instead of loading them into registers.
"""


import functools
import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import BFloat16, Float32, Int32, TFloat32  # noqa: E402
from cutlass.cute.nvgpu import warp  # noqa: E402

from .. import tactics as tac  # noqa: E402
from ..tactics import HC_MULT, MMA_TILE_ROWS, N_MIXES, SUMSQ_COL, FmaTactic  # noqa: E402
from . import (  # noqa: E402
    CompiledKernels, compile_in_processes, compile_kernel, delayed_mode, fake_buffer, fake_tensors,
    norm_dtype_of, resolve_tactic, seam_fakes, seam_scalars, spec_problem,
)
from ..weights import broadcast_weight  # noqa: E402
from . import device_utils as du  # noqa: E402
from .big_fuse import (  # noqa: E402
    X1_SUMSQ_COL, BigFusePhase, BigFuseScalars, flat_outputs, gate_rows, partials_view, standalone_big_fuse,
)
from .launch import KernelLaunch  # noqa: E402

MMA_N = 8  # mix columns per warp-MMA tile (m16n8k8): three tiles cover the 24
MMA_K_VEC = 16  # K elements per 16-byte vector of a lane: two m16n8k8 steps (see ``project_mma``)
PRE_AT = HC_MULT + HC_MULT * HC_MULT  # the carried pre gates' place in a task's coefficients (after post, comb)


class FmaFusedHc:
    """Paths E/F for one tactic, hidden size, norm flag, seam (``delayed``: None, or for the delayed seam
    "carried" / "identity", ``kernels.delayed_mode``) and form ("regular", "no_post" or "broadcast", as
    ``Problem.form``), all compile-time. The broadcast entry's ``tactic`` is ``tactics.fma_broadcast_tactic``'s."""

    def __init__(self, tactic: FmaTactic, hidden: int, norm_dtype, delayed: str | None = None,
                 form: str = "regular"):
        self.broadcast = form == "broadcast"
        self.has_post = form == "regular"  # else no x, post_mix, comb_mix (the broadcast entry writes residual_cur)
        # the length of an input stream: the broadcast entry's embedding is walked as four quarters of H / 4
        self.stream_h = hidden // HC_MULT if self.broadcast else hidden
        tactic.check(self.stream_h)
        self.tactic = tactic
        self.hidden = hidden
        self.delayed = delayed
        self.x1_norm = delayed is not None and norm_dtype is not None  # kernel 1 sums x1's squares
        self.tokens = tactic.tokens_per_cta
        self.threads = tactic.threads
        self.warps = tactic.threads // du.WARP
        self.tile_n = tactic.tile_n
        self.group_threads = tactic.threads * tactic.tile_n // N_MIXES  # one K vector each, = chunk_h
        self.warps_per_group = self.group_threads // du.WARP
        self.chunk_h = tactic.chunk_h
        self.quads = self.chunk_h // du.VEC_F32  # K vectors per stream in a chunk
        self.burst = tactic.burst  # chunks per post-map step
        self.load_h = self.chunk_h * tactic.burst  # hidden positions per post-map step
        self.octets = self.load_h // du.VEC_BF16  # post-map tasks per token per step
        self.split_k = tactic.split_k
        self.split_h = self.stream_h // tactic.split_k
        self.n_chunks = self.split_h // self.chunk_h
        self.post_tasks = self.tokens * self.octets
        self.post_rounds = -(-self.post_tasks // self.threads)
        self.red_cols = self.tokens * (self.tile_n + 1)  # per warp: dots, then sums of squares
        self.warp_mma = tactic.warp_mma
        if self.warp_mma:
            self.m_tiles = tactic.mma_rows // MMA_TILE_ROWS
            self.act_rows = tactic.mma_rows  # token rows of sAct: whole MMA tiles (rows past the tokens unused)
            self.warp_k = tactic.mma_warp_k
            # a lane's weight fragment: rows g, g + 8, g + 16 (one per 8-column N tile) x its 16-byte vectors
            self.w_shape = (N_MIXES // MMA_N, self.warp_k // MMA_K_VEC, du.VEC_F32)
        else:
            self.act_rows = self.tokens
            self.w_shape = (self.tile_n, 1, du.VEC_F32)  # a thread's tile_n weight rows at its K vector
        self.fused = tactic.path == "all_fma"
        if self.fused:
            self.phase = BigFusePhase(hidden, tactic.split_k, self.tokens, self.threads, norm_dtype,
                                      delayed=delayed is not None)
        else:
            self.big_fuse = standalone_big_fuse(hidden, tactic.split_k, norm_dtype, tactic.fuse, delayed is not None)

    @cute.jit
    def __call__(
        self,
        x: cute.Tensor,
        residual: cute.Tensor,
        post_mix: cute.Tensor,
        comb_mix: cute.Tensor,
        fn: cute.Tensor,
        hc_scale: cute.Tensor,
        hc_base: cute.Tensor,
        norm_weight,
        residual_cur: cute.Tensor,
        post_mix_cur: cute.Tensor,
        comb_mix_cur: cute.Tensor,
        layer_input: cute.Tensor,
        workspace: cute.Tensor,
        counters,
        pre_mix,  # [M, 4] f32 | None: the delayed seam's carried gates (None: identity, or mhc_fused_hc)
        pre_mix_cur,  # [M, 4] f32 | None: the delayed seam's output gates
        rms_eps: Float32,
        hc_pre_eps: Float32,
        hc_sinkhorn_eps: Float32,
        hc_post_mult_value: Float32,
        sinkhorn_repeat: Int32,
        norm_eps: Float32,
        stream,
    ):
        m, h = (x if self.has_post else residual).shape[0], self.hidden
        mRes = cute.make_tensor(residual.iterator, du.row_major(m, HC_MULT * self.stream_h))
        mX, mPost, mComb = None, None, None  # no post: x, post_mix, comb_mix are None
        if cutlass.const_expr(self.has_post):
            mX = cute.make_tensor(x.iterator, du.row_major(m, h))
            mPost = cute.make_tensor(post_mix.iterator, du.row_major(m, HC_MULT))
            mComb = cute.make_tensor(comb_mix.iterator, du.row_major(m, HC_MULT * HC_MULT))
        outs = flat_outputs(h, m, residual_cur, post_mix_cur, comb_mix_cur, layer_input)
        mPartials = partials_view(workspace, self.split_k, m)
        mPre, mPreOut = gate_rows(m, pre_mix), gate_rows(m, pre_mix_cur)
        scalars = BigFuseScalars(rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value, sinkhorn_repeat, norm_eps)
        self.kernel(mX, mRes, mPost, mComb, fn, hc_scale, hc_base, norm_weight, *outs, mPartials, counters, mPre,
                    mPreOut, scalars).launch(grid=[cute.ceil_div(m, self.tokens), self.split_k, 1],
                                    block=[self.threads, 1, 1], stream=stream, use_pdl=True,
                                    smem=tac.ONE_PER_SM_SMEM_BYTES if self.tactic.one_per_sm else None)
        if cutlass.const_expr(not self.fused):
            self.big_fuse.launch(mPartials, hc_scale, hc_base, norm_weight, *outs, scalars, stream, mPreOut)

    @cute.kernel
    def kernel(
        self,
        mX: cute.Tensor,
        mRes: cute.Tensor,
        mPost: cute.Tensor,
        mComb: cute.Tensor,
        mFn: cute.Tensor,
        mScale: cute.Tensor,
        mBase: cute.Tensor,
        mNormW,
        mResCur: cute.Tensor,
        mPostOut: cute.Tensor,
        mCombOut: cute.Tensor,
        mLayerIn: cute.Tensor,
        mPartials: cute.Tensor,
        mCounters,
        mPre,
        mPreOut,
        scalars: BigFuseScalars,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        block, split, _ = cute.arch.block_idx()
        if cutlass.const_expr(not self.fused):
            cute.arch.griddepcontrol_launch_dependents()  # the big-fuse CTAs start early and wait for this grid
        smem = cutlass.memory.SmemAllocator()
        if cutlass.const_expr(self.warp_mma):
            # one buffer: the activations, then (once the last chunk is projected) the reduction over warps
            buf = smem.allocate_tensor(Float32, cute.make_layout(self.tactic.smem_bytes() // 4), 16)
            sAct = cute.make_tensor(buf.iterator, du.row_major(self.act_rows, HC_MULT, self.load_h))
            sRed = cute.make_tensor(buf.iterator, du.row_major(self.warps, self.act_rows, N_MIXES + 1))
        else:
            sAct = smem.allocate_tensor(Float32, du.row_major(self.tokens, HC_MULT, self.load_h), 16)
            sRed = smem.allocate_tensor(Float32, du.row_major(self.warps, self.red_cols), 16)
        if cutlass.const_expr(self.fused):
            storage = self.phase.allocate(smem)
            sArrival = smem.allocate_tensor(Int32, cute.make_layout(1), 4)
        sX1Sq = None
        x1_sumsq = None
        if cutlass.const_expr(self.x1_norm):
            sX1Sq = smem.allocate_tensor(Float32, cute.make_layout(self.post_tasks), 16)  # per post-map task
            x1_sumsq = cute.make_rmem_tensor((self.post_rounds,), Float32)
            x1_sumsq.fill(0.0)

        m0 = block * self.tokens
        if cutlass.const_expr(self.warp_mma):
            # warp w owns K range [w warp_k, (w + 1) warp_k) of each chunk (inside one stream), every column
            lane = cute.arch.lane_idx()
            k0 = cute.arch.warp_idx() * self.warp_k
            stream_j, quad = k0 // self.chunk_h, (k0 % self.chunk_h) // du.VEC_F32 + lane % 4
            w_row0, w_row_step = lane // 4, MMA_N
            acc = cute.make_rmem_tensor((self.m_tiles, N_MIXES // MMA_N, 4), Float32)  # C fragments, summed
            sumsq = cute.make_rmem_tensor((self.m_tiles, 2), Float32)  # rows g and g + 8 of each tile
        else:
            group = tidx // self.group_threads  # warp-uniform
            kvec = tidx % self.group_threads
            stream_j, quad = kvec // self.quads, kvec % self.quads
            w_row0, w_row_step = group * self.tile_n, 1
            acc = cute.make_rmem_tensor((self.tokens, self.tile_n), Float32)
            sumsq = cute.make_rmem_tensor((self.tokens,), Float32)
        acc.fill(0.0)
        sumsq.fill(0.0)
        # quad index of this thread's (first) K vector in a weight row, at chunk 0 of this split
        fn_quad0 = stream_j * (self.stream_h // du.VEC_F32) + split * (self.split_h // du.VEC_F32) + quad
        weights = cute.make_rmem_tensor(self.w_shape, Float32)
        self.load_weights(weights, mFn, w_row0, w_row_step, fn_quad0)
        # launched with programmatic dependent launch: the first weights (an input no kernel of the stream writes)
        # load while the previous kernel finishes; everything it may have written is read after this wait
        cute.arch.griddepcontrol_wait()
        if cutlass.const_expr(self.fused):
            cute.arch.griddepcontrol_launch_dependents()  # the next kernel may start its own prologue
        coefs = self.load_post_coefficients(m0, mPost if self.has_post else mRes, mPost, mComb, mPre)
        for c in cutlass.range(self.n_chunks, unroll=1):
            if cutlass.const_expr(self.tactic.stages == 2):
                next_weights = cute.make_rmem_tensor(self.w_shape, Float32)
                if c + 1 < self.n_chunks:
                    self.load_weights(next_weights, mFn, w_row0, w_row_step, fn_quad0 + (c + 1) * self.quads)
            elif c > 0:
                self.load_weights(weights, mFn, w_row0, w_row_step, fn_quad0 + c * self.quads)
            sub = c % self.burst
            if sub == 0:
                if c > 0:
                    cute.arch.sync_threads()  # the previous step's projections are done with sAct
                self.post_map(m0, split * self.split_h + c * self.chunk_h, coefs, mX, mRes, mResCur, sAct, mLayerIn,
                              x1_sumsq)
                cute.arch.sync_threads()
            if cutlass.const_expr(self.warp_mma):
                self.project_mma(sAct, stream_j, sub * self.quads + quad, weights, acc, sumsq)
            else:
                for t in cutlass.range_constexpr(self.tokens):
                    a = cute.local_tile(sAct[t, stream_j, None], (du.VEC_F32,), (sub * self.quads + quad,)).load()
                    # a 4-term dot first, then one rounding into the long accumulator (halves its rounding error)
                    for i in cutlass.range_constexpr(self.tile_n):
                        dot = a[0] * weights[i, 0, 0]
                        for e in cutlass.range_constexpr(1, du.VEC_F32):
                            dot = cute.math.fma(a[e], weights[i, 0, e], dot)
                        acc[t, i] = acc[t, i] + dot
                    if group == 0:
                        sumsq[t] = sumsq[t] + du.sum_squares(a)
            if cutlass.const_expr(self.tactic.stages == 2):
                weights.store(next_weights.load())
        if cutlass.const_expr(self.x1_norm):  # published to the CTA by write_partials' barriers
            for r in cutlass.range_constexpr(self.post_rounds):
                if tidx + r * self.threads < self.post_tasks:
                    sX1Sq[tidx + r * self.threads] = x1_sumsq[r]
        if cutlass.const_expr(self.warp_mma):
            self.write_partials_mma(m0, split, acc, sumsq, sRed, mPartials)
        else:
            self.write_partials(m0, split, acc, sumsq, sRed, mPartials)
        if cutlass.const_expr(self.x1_norm):
            self.store_x1_sumsq(m0, split, sX1Sq, mPartials)

        if cutlass.const_expr(self.fused):
            # publish this CTA's partials and residual_cur: the barrier orders every thread's stores before
            # thread 0's release (fence cumulativity), then count the arrival on the token block
            cute.arch.sync_threads()
            if tidx == 0:
                cute.arch.fence_acq_rel_gpu()
                sArrival[0] = cute.arch.atomic_add(mCounters.iterator + block, Int32(1), sem="acq_rel", scope="gpu")
            cute.arch.sync_threads()
            if sArrival[0] == self.split_k - 1:  # the last CTA of this token block
                cute.arch.fence_acq_rel_gpu()  # acquire: the other CTAs' stores are visible to this CTA
                self.phase(storage, m0, mPartials, mScale, mBase, mNormW, mResCur, mPostOut, mCombOut, mLayerIn,
                           scalars, mPreOut)
                if tidx == 0:
                    mCounters[block] = Int32(0)  # every CTA of the block has arrived: ready for the next call

    @cute.jit
    def load_post_coefficients(self, m0: Int32, mTokens: cute.Tensor, mPost, mComb, mPre):
        """post[j] and comb[k][j] of the token of each post-map task this thread runs (20 fp32 per task; none
        without a post), then the carried pre gates (``mPre``, the delayed seam's "carried": 4 more at ``PRE_AT``).
        ``mTokens``: a row-per-token input (its rows are the tokens)."""
        tidx, _, _ = cute.arch.thread_idx()
        m_last = mTokens.shape[0] - 1
        n_coef = PRE_AT + (HC_MULT if mPre is not None else 0)
        coefs = cute.make_rmem_tensor((self.post_rounds, n_coef), Float32)
        for r in cutlass.range_constexpr(self.post_rounds):
            task = tidx + r * self.threads
            m = cutlass.min(m0 + task // self.octets, m_last)  # clamped: the tail tasks' values are unused
            if cutlass.const_expr(self.has_post):
                for j in cutlass.range_constexpr(HC_MULT):
                    coefs[r, j] = mPost[m, j]
                for i in cutlass.range_constexpr(HC_MULT * HC_MULT):
                    coefs[r, HC_MULT + i] = mComb[m, i]
            if cutlass.const_expr(mPre is not None):
                for j in cutlass.range_constexpr(HC_MULT):
                    coefs[r, PRE_AT + j] = mPre[m, j]
        return coefs

    @cute.jit
    def load_weights(self, weights: cute.Tensor, mFn: cute.Tensor, row0: Int32, row_step: int, fn_quad: Int32):
        """``weights[i, v]`` = the 4 fp32 of weight row ``row0 + i row_step`` at quad ``fn_quad`` + 4 v."""
        for i in cutlass.range_constexpr(self.w_shape[0]):
            row = mFn[row0 + i * row_step, None]
            for v in cutlass.range_constexpr(self.w_shape[1]):
                vec = cute.local_tile(row, (du.VEC_F32,), (fn_quad + v * (MMA_K_VEC // du.VEC_F32),))
                weights[i, v, None].store(du.load_f32x4(vec))

    @cute.jit
    def project_mma(self, sAct: cute.Tensor, stream_j, quad0, weights: cute.Tensor, acc: cute.Tensor,
                    sumsq: cute.Tensor):
        """One chunk's projection on the tensor cores (``warp_mma``): ``acc += A W`` for this warp's K range.

        The K order inside each 16-wide vector is permuted so that both operands are 16-byte loads: lane (g, q)
        holds H offsets 4q..4q+3 of it, and offsets 4q + 2s and 4q + 2s + 1 are its K columns q and q + 4 of
        k-step s (the A fragment's rows g and g + 8 from shared memory, the B fragment's column g from its
        weight row); a dot product does not depend on the order of K. The weight is split into TF32 hi + lo
        (``du.split_tf32``; the activations are bf16 values, exact in TF32), two MMAs per step, and the
        tensor cores accumulate one chunk from zero (their long sums drift) before an fp32 add into ``acc``.
        """
        lane = cute.arch.lane_idx()
        atom = cute.make_mma_atom(warp.MmaTF32Op((MMA_TILE_ROWS, MMA_N, 8)))
        hi = cute.make_rmem_tensor(self.w_shape, Float32)
        lo = cute.make_rmem_tensor(self.w_shape, Float32)
        du.split_tf32(weights, hi, lo)
        n_tiles = N_MIXES // MMA_N
        for mt in cutlass.range_constexpr(self.m_tiles):
            tile = [cute.make_rmem_tensor((4, 1, 1), Float32) for _ in range(n_tiles)]
            for nt in cutlass.range_constexpr(n_tiles):
                tile[nt].fill(0.0)
            for v in cutlass.range_constexpr(self.w_shape[1]):
                rows = [sAct[mt * MMA_TILE_ROWS + lane // 4 + 8 * r, stream_j, None] for r in range(2)]
                a = [cute.local_tile(row, (du.VEC_F32,), (quad0 + v * (MMA_K_VEC // du.VEC_F32),)).load() for row in rows]
                for r in cutlass.range_constexpr(2):
                    sumsq[mt, r] = sumsq[mt, r] + du.sum_squares(a[r])
                for s in cutlass.range_constexpr(2):
                    frag_a = cute.make_rmem_tensor((4, 1, 1), TFloat32)
                    for e in cutlass.range_constexpr(4):  # (g, q), (g + 8, q), (g, q + 4), (g + 8, q + 4)
                        frag_a[e, 0, 0] = a[e % 2][2 * s + e // 2]
                    for nt in cutlass.range_constexpr(n_tiles):
                        for part in (hi, lo):
                            frag_b = cute.make_rmem_tensor((2, 1, 1), TFloat32)  # (q, g), (q + 4, g)
                            for e in cutlass.range_constexpr(2):
                                frag_b[e, 0, 0] = part[nt, v, 2 * s + e]
                            cute.gemm(atom, tile[nt], frag_a, frag_b, tile[nt])
            for nt in cutlass.range_constexpr(n_tiles):
                for i in cutlass.range_constexpr(4):
                    acc[mt, nt, i] = acc[mt, nt, i] + tile[nt][i, 0, 0]

    @cute.jit
    def post_map(self, m0: Int32, h0: Int32, coefs: cute.Tensor, mX, mRes, mResCur, sAct: cute.Tensor, mLayerIn,
                 x1_sumsq):
        """SPEC step 1 for the ``burst`` chunks at h0: residual_cur to global memory, fp32 values to ``sAct``
        (without a post: residual_prev's values, nothing stored; the broadcast entry: the embedding's quarters,
        each stored to all four streams); the delayed seam's collapse ``x1`` of the rounded streams to
        ``layer_input`` (``collapse_carried``), and with the norm its squares added to the task's ``x1_sumsq``.

        Every task's loads are issued first, unconditionally (token and task clamped to valid ones), and a warp
        barrier follows them: otherwise ptxas issued two of the four residual loads only after computing with
        the first two, which cost a second memory round trip on the critical path at small M (seen in the SASS).
        """
        tidx, _, _ = cute.arch.thread_idx()
        m_total = (mX if self.has_post else mRes).shape[0]
        octets_in = self.stream_h // du.VEC_BF16  # 8-vectors per input stream (the broadcast entry: per quarter)
        octets_h = self.hidden // du.VEC_BF16  # 8-vectors per output stream
        raw = cute.make_rmem_tensor(du.row_major(self.post_rounds, 1 + HC_MULT, du.VEC_BF16), BFloat16)
        for r in cutlass.range_constexpr(self.post_rounds):
            task = cutlass.min(tidx + r * self.threads, self.post_tasks - 1)
            m = cutlass.min(m0 + task // self.octets, m_total - 1)
            vec = h0 // du.VEC_BF16 + task % self.octets  # index of this 8-vector within an input stream row
            if cutlass.const_expr(self.has_post):
                cute.autovec_copy(cute.local_tile(du.token_row(mX, m), (du.VEC_BF16,), (vec,)), raw[r, 0, None])
            for k in cutlass.range_constexpr(HC_MULT):
                src = cute.local_tile(du.token_row(mRes, m), (du.VEC_BF16,), (k * octets_in + vec,))
                cute.autovec_copy(src, raw[r, 1 + k, None])
        cute.arch.sync_warp()
        for r in cutlass.range_constexpr(self.post_rounds):
            task = tidx + r * self.threads
            if task < self.post_tasks:
                t, o = task // self.octets, task % self.octets
                m = m0 + t
                if m < m_total:
                    vec = h0 // du.VEC_BF16 + o
                    if cutlass.const_expr(self.has_post or self.broadcast):
                        row_out = du.token_row(mResCur, m)
                    if cutlass.const_expr(self.has_post):
                        xv = du.widen_bf16x8(raw[r, 0, None])
                    res = [du.widen_bf16x8(raw[r, 1 + k, None]) for k in range(HC_MULT)]
                    streams = []
                    for j in cutlass.range_constexpr(HC_MULT):
                        if cutlass.const_expr(not self.has_post):
                            rounded = res[j]  # bf16 values, exact in fp32
                            if cutlass.const_expr(self.broadcast):  # quarter j, at its place in every stream
                                for copy in cutlass.range_constexpr(HC_MULT):
                                    dst = cute.local_tile(row_out, (du.VEC_BF16,),
                                                          (copy * octets_h + j * octets_in + vec,))
                                    cute.autovec_copy(raw[r, 1 + j, None], dst)
                        else:
                            out = cute.make_rmem_tensor((du.VEC_BF16,), Float32)
                            comb_col = [coefs[r, HC_MULT + HC_MULT * k + j] for k in range(HC_MULT)]
                            for e in cutlass.range_constexpr(du.VEC_BF16):
                                out[e] = du.post_element(coefs[r, j], xv[e], comb_col,
                                                         [res[k][e] for k in range(HC_MULT)])
                            rounded = du.store_bf16x8(
                                cute.local_tile(row_out, (du.VEC_BF16,), (j * octets_h + vec,)), out.load())
                        cute.local_tile(sAct[t, j, None], (du.VEC_BF16,), (o,)).store(rounded)
                        streams.append(rounded)
                    if cutlass.const_expr(self.delayed is not None):
                        row_in = du.token_row(mLayerIn, m)
                        # the broadcast entry: each quarter is a position range of four equal streams
                        ranges = ([([streams[j]] * HC_MULT, j * octets_in + vec) for j in range(HC_MULT)]
                                  if self.broadcast else [(streams, vec)])
                        for i in cutlass.range_constexpr(len(ranges)):
                            x1 = self.collapse_carried(ranges[i][0], coefs, r,
                                                       cute.local_tile(row_in, (du.VEC_BF16,), (ranges[i][1],)))
                            if cutlass.const_expr(self.x1_norm):
                                x1_sumsq[r] = x1_sumsq[r] + du.sum_squares(x1)
                else:
                    for j in cutlass.range_constexpr(HC_MULT):
                        cute.local_tile(sAct[t, j, None], (du.VEC_BF16,), (o,)).fill(0.0)

    @cute.jit
    def collapse_carried(self, streams, coefs: cute.Tensor, r, dst: cute.Tensor):
        """The delayed seam's collapse of one 8-vector (SPEC "V4.1: the delayed seam", step 3): ``acc = pre[0] r0``,
        then ``acc = fma(pre[j], rj, acc)`` for j = 1..3 on the rounded streams, stored to ``dst`` as bf16; the
        identity stores stream 0 (exactly). Returns the stored values widened to fp32."""
        if cutlass.const_expr(self.delayed == "identity"):
            return du.store_bf16x8(dst, streams[0])
        x1 = cute.make_rmem_tensor((du.VEC_BF16,), Float32)
        for e in cutlass.range_constexpr(du.VEC_BF16):
            acc = None
            for j in cutlass.range_constexpr(HC_MULT):
                acc = du.collapse_term(j, coefs[r, PRE_AT + j], streams[j][e], acc)
            x1[e] = acc
        return du.store_bf16x8(dst, x1.load())

    @cute.jit
    def store_x1_sumsq(self, m0: Int32, split: Int32, sX1Sq: cute.Tensor, mPartials: cute.Tensor):
        """Partial column ``X1_SUMSQ_COL`` of each token: its post-map tasks' sums of squares of x1 (``sX1Sq``,
        published by a barrier), in task order."""
        tidx, _, _ = cute.arch.thread_idx()
        m_total = mPartials.shape[1]
        for base in cutlass.range_constexpr(0, self.tokens, self.threads):
            t = base + tidx
            if t < self.tokens and m0 + t < m_total:
                total = Float32(0.0)
                for o in cutlass.range_constexpr(self.octets):
                    total = total + sX1Sq[t * self.octets + o]
                mPartials[split, m0 + t, X1_SUMSQ_COL] = total

    @cute.jit
    def write_partials(self, m0: Int32, split: Int32, acc: cute.Tensor, sumsq: cute.Tensor,
                       sRed: cute.Tensor, mPartials: cute.Tensor):
        """Sum the register tiles over the threads of each column group, in a fixed order, into the partial rows."""
        warp = cute.arch.warp_idx()
        # one warp reduction for all red_cols values (the sums of squares are zero outside group 0, unread)
        vals = [acc[t, i] for t in range(self.tokens) for i in range(self.tile_n)]
        sums, first, owner = du.warp_reduce_scatter(vals + [sumsq[t] for t in range(self.tokens)])
        if owner:
            for k in cutlass.range_constexpr(len(sums)):
                if first + k < self.red_cols:
                    sRed[warp, first + k] = sums[k]
        cute.arch.sync_threads()
        self.store_partials(m0, split, sRed, mPartials)

    @cute.jit
    def write_partials_mma(self, m0: Int32, split: Int32, acc: cute.Tensor, sumsq: cute.Tensor,
                           sRed: cute.Tensor, mPartials: cute.Tensor):
        """``write_partials`` for ``warp_mma``: each warp's C fragments (row g + 8 r, columns 8 nt + 2 q + a) and
        its rows' sums of squares (over the lanes of a quad) to ``sRed``, then summed over the warps in order."""
        lane, warp_i = cute.arch.lane_idx(), cute.arch.warp_idx()
        cute.arch.sync_threads()  # every warp is done with the last chunk: sRed reuses sAct's memory
        for mt in cutlass.range_constexpr(self.m_tiles):
            for r in cutlass.range_constexpr(2):
                sq = du.warp_sum(sumsq[mt, r], lanes=4)
                row = mt * MMA_TILE_ROWS + lane // 4 + 8 * r
                if row < self.tokens:
                    for nt in cutlass.range_constexpr(N_MIXES // MMA_N):
                        for a in cutlass.range_constexpr(2):
                            sRed[warp_i, row, nt * MMA_N + 2 * (lane % 4) + a] = acc[mt, nt, 2 * r + a]
                    if lane % 4 == 0:
                        sRed[warp_i, row, SUMSQ_COL] = sq
        cute.arch.sync_threads()
        self.store_partials(m0, split, sRed, mPartials)

    @cute.jit
    def store_partials(self, m0: Int32, split: Int32, sRed: cute.Tensor, mPartials: cute.Tensor):
        """The CTA's partial rows from ``sRed`` (filled before a barrier): each (token, column) summed over the warps
        that hold it, in a fixed order (the column group's warps, or with ``warp_mma`` every warp)."""
        tidx, _, _ = cute.arch.thread_idx()
        m_total = mPartials.shape[1]
        row_cols = N_MIXES + 1
        for base in cutlass.range_constexpr(0, self.tokens * row_cols, self.threads):
            idx = base + tidx
            if idx < self.tokens * row_cols:
                t, col = idx // row_cols, idx % row_cols
                if m0 + t < m_total:
                    total = Float32(0.0)
                    if cutlass.const_expr(self.warp_mma):
                        for w in cutlass.range_constexpr(self.warps):
                            total = total + sRed[w, t, col]
                    else:
                        if col < N_MIXES:
                            g, i = col // self.tile_n, col % self.tile_n
                            for u in cutlass.range_constexpr(self.warps_per_group):
                                total = total + sRed[g * self.warps_per_group + u, t * self.tile_n + i]
                        else:
                            for u in cutlass.range_constexpr(self.warps_per_group):
                                total = total + sRed[u, self.tokens * self.tile_n + t]
                    if cutlass.const_expr(self.broadcast):  # the mean over 4H of four equal streams (exact)
                        if col == SUMSQ_COL:
                            total = total * Float32(HC_MULT)
                    mPartials[split, m0 + t, col] = total


_compiled = CompiledKernels("mhc_fma", "fma.py")


def compiled_fma(tactic: FmaTactic, problem, out):
    """The compiled kernel for (tactic, H, norm dtype, seam, form), compiled (or loaded) on first use (the broadcast
    entry's ``tactic``: ``tac.fma_broadcast_tactic``'s)."""
    norm = None if problem.norm_weight is None else problem.norm_weight.dtype
    key = (tactic, problem.hidden, norm)
    if problem.delayed:  # mhc_fused_hc's keys (and persisted file names) stay as they were
        key += (delayed_mode(problem),)
    if problem.form != "regular":
        key += (problem.form,)
    return _compiled.get(key, lambda: compile_fma(tactic, problem, out))


def compile_fma(tactic: FmaTactic, problem, out, kernel_class=None):
    """Compile paths E/F for ``tactic`` against fake tensors shaped like ``problem`` and ``out``; ``kernel_class``:
    ``FmaFusedHc`` or a subclass (``bench/probes/probe_fma_phases.py``'s variants)."""
    import torch

    no_post = problem.form == "no_post"
    kernel = (kernel_class or FmaFusedHc)(tactic, problem.hidden, norm_dtype_of(problem.norm_weight),
                                          delayed_mode(problem), problem.form)
    m = cute.sym_int()
    token_tensors = fake_tensors(problem.x, problem.residual, problem.post_mix, problem.comb_mix, tokens=m)
    # without a post the big fuse collapses residual_prev, passed where residual_cur goes (``KernelLaunch``)
    outputs = fake_tensors(problem.residual if no_post else out[0], *out[1:4], tokens=m)
    # the broadcast entry reads the summed weight [24, H] (``weights.broadcast_weight``)
    fn = torch.empty(N_MIXES, problem.hidden) if problem.broadcast else problem.fn
    fn, norm_weight = fake_tensors(fn, problem.norm_weight)
    scale, base = fake_tensors(problem.hc_scale, problem.hc_base, align=4)  # read as scalars
    counters = fake_buffer(Int32) if tactic.path == "all_fma" else None
    return compile_kernel(kernel, *token_tensors, fn, scale, base, norm_weight, *outputs, fake_buffer(Float32),
                          counters, *seam_fakes(problem, out, m), *seam_scalars())


@functools.lru_cache(maxsize=4096)
def _default_tactic(path: str, m: int, hidden: int, sm_count: int) -> FmaTactic:
    return tac.default_fma_tactic(path, m, hidden, sm_count)


def _prepare(path: str, problem, tactic, out):
    tactic = resolve_tactic(path, tactic, problem, _default_tactic)
    weight = None
    if problem.broadcast:
        tactic, weight = tac.fma_broadcast_tactic(tactic, problem.hidden), broadcast_weight
    counters = -(-problem.m // tactic.tokens_per_cta) if tactic.path == "all_fma" else None
    return KernelLaunch(compiled_fma(tactic, problem, out), problem, tactic, counters, weight)


def prepare_half_fma(problem, tactic, out):
    """Path E: projection kernel + standalone big-fuse kernel (two launches in one compiled call); both seams
    (``mhc_fused_hc``, ``mhc_fused_hc_delayed``) in every form."""
    return _prepare("half_fma", problem, tactic, out)


def prepare_all_fma(problem, tactic, out):
    """Path F: one launch; the last CTA of each token block runs the big fuse for it. Both seams in every form."""
    return _prepare("all_fma", problem, tactic, out)


def _compile_spec(spec) -> str:
    """Process-pool worker of ``precompile``: compile (and persist) one (tactic name, H, norm dtype[, seam[, form]])."""
    name, hidden, norm, *seam = spec
    problem = spec_problem(hidden, "fp32", norm, *seam)
    tactic = tac.parse_tactic(name)
    if problem.broadcast:
        tactic = tac.fma_broadcast_tactic(tactic, hidden)
    compiled_fma(tactic, problem, problem.empty_outputs())
    return name


def precompile(specs, processes: int | None = None) -> list[str]:
    """Compile (tactic name, H, norm dtype name or None[, seam: ``delayed_mode``'s "carried" / "identity" or None[,
    form: "regular" / "no_post" / "broadcast"]]) variants in parallel worker processes (the tactic as a seam's: the
    broadcast entry compiles ``tac.fma_broadcast_tactic`` of it, as its launch does)."""
    return compile_in_processes(_compile_spec, specs, processes)
