"""The "big fuse": everything after the projection, for a block of tokens (SPEC steps 2-7).

From the split-K partials ``[split_k, M, 32]`` (columns 0..23: unscaled dots over the split's K indices,
column 24: sum of squares) and the bf16 ``residual_cur`` it computes, per token: rstd, the 24 mixes, the
gates (``post_mix_cur``), the 4x4 Sinkhorn (``comb_mix_cur``), the collapse into ``layer_input`` and the
optional fused RMSNorm.

Two ways in:

* ``BigFusePhase``: the phase as device code for one block of tokens, run by all threads of a CTA. The
  one-launch paths (F here, D in ``mma.py``) call it from the CTA that finishes a token block last.
  Use: ``phase = BigFusePhase(hidden, split_k, tokens, threads, norm)``; in the kernel, before any other
  code that depends on it, ``storage = phase.allocate(smem_allocator)``; later
  ``phase(storage, m0, partials, scale, base, norm_weight, residual_cur, post_out, comb_out, layer_input,
  scalars)`` with the flattened tensors of ``flat_outputs`` and ``BigFuseScalars`` (``prefetch`` then ``run``:
  a kernel may load the op's own inputs earlier, e.g. before waiting for its producer grid).
* ``BigFuseKernel`` (standalone, one CTA per token block; ``standalone_big_fuse`` shapes it), launched by the
  two-launch paths (E in ``fma.py``, B in ``mma.py``) from their compiled call.

Partials are summed in a fixed order (split s round-robin over warps, then warps in order): deterministic.

The delayed seam (``delayed``, compile-time): kernel 1 already wrote the collapse with the carried gates (x1) to
``layer_input`` and, with the norm, x1's sums of squares to partial column 25; the phase writes the gates (the pre
gates too: ``pre_mix_cur``) and the Sinkhorn, and normalises ``layer_input`` in place (``norm_in_place``).
"""

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from typing import NamedTuple  # noqa: E402

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import BFloat16, Float32, Int32  # noqa: E402

from ..tactics import HC_MULT, N_MIXES, PARTIAL_COLS, SUMSQ_COL  # noqa: E402
from . import device_utils as du  # noqa: E402

X1_SUMSQ_COL = SUMSQ_COL + 1  # the delayed seam with the norm: the sum of squares of the bf16 collapse x1
SCALE_AT = N_MIXES  # hc_scale's place in the constants (after hc_base)
SOFTMAX_LANES = HC_MULT * HC_MULT  # lanes per token of the Sinkhorn warp's lane-parallel softmax
COLLAPSE_BARRIER = 1  # named barrier of the collapse warps when the Sinkhorn has a warp of its own
DELAYED_BLOCK_TOKENS = 16  # tokens per CTA of the delayed seam's standalone big fuse without the norm (shape "bw")
# tokens whose partial rows a warp loads together before summing any (one memory round trip for all of them: one
# per token serialised path D's and path F's tiles), at most 32 loads a lane
TOKEN_LOADS = 16
MIXES_READY = 2  # named barrier: the collapse warps' summed rows are in shared memory (the Sinkhorn warp waits)


class BigFuseScalars(NamedTuple):
    rms_eps: Float32
    hc_pre_eps: Float32
    hc_sinkhorn_eps: Float32
    hc_post_mult_value: Float32
    sinkhorn_repeat: Int32
    norm_eps: Float32


class BigFuseStorage(NamedTuple):
    partial_sums: cute.Tensor  # [warps, tokens, 32] per-warp sums of the partials
    mixes: cute.Tensor  # [tokens, 32] summed partial rows
    scratch: cute.Tensor  # [warps] norm reductions
    constants: cute.Tensor  # [32]: hc_base[0..23], then hc_scale[0..2]


class BigFusePhase:
    """SPEC steps 2-7 for ``tokens`` consecutive tokens by one CTA of ``threads`` threads.

    Order: sum the partials (all threads); collapse and norm, the warps split into ``groups`` token groups
    that work on different tokens at once (each thread derives the pre gates of its token from the summed
    row, so no barrier is needed before the collapse). The collapse is latency bound at small M: each thread
    issues the loads of ``batch`` 8-vectors (all 4 streams) before it uses any (the first batch together with
    the partials), and the one long serial chain, the Sinkhorn (one thread per token), runs beside the collapse
    (in a warp of its own with ``sinkhorn_warp``, else in the first warp); the post gates are spread over the
    collapse threads (``post_gates``). The op's own inputs (hc_base, hc_scale, the norm weight) are loaded first,
    before the partials (the standalone kernel loads them before it waits for its producer grid), off the critical
    path at small M (``docs/experiments.md``).
    """

    def __init__(self, hidden: int, split_k: int, tokens: int, threads: int, norm_dtype, batch: int = 4,
                 sinkhorn_last: bool = False, sinkhorn_warp: bool = False, pair_sinkhorn: bool = False,
                 delayed: bool = False):
        assert hidden % du.VEC_BF16 == 0 and threads % du.WARP == 0 and tokens <= threads
        self.hidden = hidden
        self.split_k = split_k
        self.tokens = tokens
        self.threads = threads
        self.warps = threads // du.WARP
        self.norm_dtype = norm_dtype  # None, BFloat16 or Float32 (compile-time)
        # the delayed seam (``finish``): no collapse (kernel 1 wrote x1 to layer_input, and with the norm its sum of
        # squares to partial column ``X1_SUMSQ_COL``); the pre gates are an output, and the norm runs in place
        self.delayed = delayed
        # ``sinkhorn_warp``: the last warp runs the Sinkhorn and no collapse, so that no collapse work waits behind
        # that chain (else the first warp's collapse starts after it), and the post gates leave it for the collapse
        self.sinkhorn_warp = sinkhorn_warp
        # ``pair_sinkhorn`` (blocks of up to 16 tokens): two lanes per token run the Sinkhorn, whose one-lane chain
        # is issue bound, in one warp (``sinkhorn``)
        assert not pair_sinkhorn or tokens <= du.WARP // 2
        self.pair_sinkhorn = pair_sinkhorn
        self.collapse_warps = collapse_warps = self.warps - (1 if sinkhorn_warp else 0)
        self.groups = max(g for g in range(1, min(tokens, collapse_warps) + 1) if collapse_warps % g == 0)
        token_loads = max(1, min(TOKEN_LOADS, 32 // -(-split_k // self.collapse_warps)))
        # the blocks of tokens whose partial rows are loaded together (a list: a static loop over up to 64 blocks
        # would make the DSL warn of its length)
        self.token_chunks = [range(t0, min(t0 + token_loads, tokens)) for t0 in range(0, tokens, token_loads)]
        self.group_warps = collapse_warps // self.groups
        self.group_threads = self.group_warps * du.WARP
        self.rounds = -(-tokens // self.groups)
        self.octets = hidden // du.VEC_BF16
        self.slots = -(-self.octets // self.group_threads)  # 8-vectors of a token per thread
        self.batch = batch  # 8-vectors per thread whose loads are in flight together (16 registers each)
        self.batches = -(-self.slots // batch)
        # with more than two batches per thread, the Sinkhorn runs inside the first batch (overlapped with its
        # loads) unless ``sinkhorn_last`` (after the collapse, for kernels short of registers)
        self.sinkhorn_last = sinkhorn_last and self.batches > 2
        assert not sinkhorn_warp or (self.batches <= 2 and tokens <= du.WARP)
        self.collapse_threads = collapse_warps * du.WARP
        # with the norm, the rounded collapse is kept in registers for the second pass when it fits, else it
        # is stored (bf16, exact) and read back by the same thread
        slots_static = self.slots <= 8 and self.batches <= 2  # (compile-time slot indices)
        self.keep_rounded = slots_static and not delayed
        # then the thread's norm-weight vectors (the same for every token) also stay in registers, loaded first
        self.prefetch_norm = norm_dtype is not None and slots_static

    def allocate(self, smem) -> BigFuseStorage:
        """The phase's shared memory (``tactics.big_fuse_smem_bytes`` bytes: the tactics' resource model)."""
        return BigFuseStorage(
            smem.allocate_tensor(Float32, du.row_major(self.warps, self.tokens, PARTIAL_COLS), 16),
            smem.allocate_tensor(Float32, du.row_major(self.tokens, PARTIAL_COLS), 16),
            smem.allocate_tensor(Float32, du.row_major(self.warps), 16),
            smem.allocate_tensor(Float32, du.row_major(32), 16),
        )

    @cute.jit
    def load_constants(self, storage: BigFuseStorage, mScale: cute.Tensor, mBase: cute.Tensor):
        """hc_base and hc_scale into shared memory, one element per thread. They are inputs of the op, never
        written by a producer grid, so a kernel may load them before ``griddepcontrol_wait``: the gates then
        read shared memory instead of paying a global round trip after the partials are summed. Visible
        after the next barrier (``run`` starts with one before any use)."""
        tidx, _, _ = cute.arch.thread_idx()
        if tidx < N_MIXES:
            storage.constants[tidx] = mBase[tidx]
        elif tidx < SCALE_AT + 3:
            storage.constants[tidx] = mScale[tidx - SCALE_AT]

    @cute.jit
    def __call__(
        self,
        storage: BigFuseStorage,
        m0: Int32,
        mPartials: cute.Tensor,
        mScale: cute.Tensor,
        mBase: cute.Tensor,
        mNormW,
        mResCur: cute.Tensor,
        mPostOut: cute.Tensor,
        mCombOut: cute.Tensor,
        mLayerIn: cute.Tensor,
        scalars: BigFuseScalars,
        mPreOut=None,
    ):
        norm_w = self.prefetch(storage, mScale, mBase, mNormW)
        self.run(storage, m0, mPartials, mNormW, mResCur, mPostOut, mCombOut, mLayerIn, scalars, norm_w, mPreOut)

    @cute.jit
    def prefetch(self, storage: BigFuseStorage, mScale: cute.Tensor, mBase: cute.Tensor, mNormW):
        """The phase's loads of the op's own inputs (``load_constants``, and ``load_norm_weights`` when
        ``prefetch_norm``, whose result it returns for ``run``; else None). None depends on a producer grid."""
        self.load_constants(storage, mScale, mBase)
        return self.load_norm_weights(mNormW) if cutlass.const_expr(self.prefetch_norm) else None

    @cute.jit
    def run(
        self,
        storage: BigFuseStorage,
        m0: Int32,
        mPartials: cute.Tensor,
        mNormW,
        mResCur: cute.Tensor,
        mPostOut: cute.Tensor,
        mCombOut: cute.Tensor,
        mLayerIn: cute.Tensor,
        scalars: BigFuseScalars,
        norm_w=None,
        mPreOut=None,
    ):
        """The phase after ``prefetch`` (its first barrier publishes the constants); ``norm_w``: what ``prefetch``
        returned; ``mPreOut``: the delayed seam's ``pre_mix_cur`` [M, 4].

        Each barrier instruction is reached by exactly the threads it counts. With ``sinkhorn_warp`` the collapse
        warps sum the partials among themselves (``collapse_barrier``) and then signal ``MIXES_READY``, which the last
        warp waits for before its Sinkhorn: that warp issues none of the collapse's loads (its code would wait for them
        to land before reusing their registers) and the collapse never waits for it."""
        if cutlass.const_expr(self.sinkhorn_warp):
            # the Sinkhorn chain ends the call's tail on the H200 (`bench/probes/probe_big_fuse_tail.py`)
            if cute.arch.warp_idx() == self.warps - 1:
                du.named_barrier_wait(MIXES_READY, self.threads)
                self.sinkhorn(storage, m0, mCombOut, scalars)
            else:
                self.sum_and_collapse(storage, m0, mPartials, mNormW, mResCur, mPostOut, mCombOut, mLayerIn, scalars,
                                      norm_w, mPreOut)
        else:
            self.sum_and_collapse(storage, m0, mPartials, mNormW, mResCur, mPostOut, mCombOut, mLayerIn, scalars,
                                  norm_w, mPreOut)

    @cute.jit
    def sum_and_collapse(self, storage: BigFuseStorage, m0: Int32, mPartials: cute.Tensor, mNormW,
                         mResCur: cute.Tensor, mPostOut: cute.Tensor, mCombOut: cute.Tensor, mLayerIn: cute.Tensor,
                         scalars: BigFuseScalars, norm_w, mPreOut):
        """``sum_partials`` then ``finish``, by the threads that collapse."""
        first = None
        if cutlass.const_expr(self.batches <= 2 and not self.delayed):
            # residual_cur does not depend on the partials: the first batch of the collapse loads while the
            # partials are summed (two memory round trips overlap)
            gtid, _, row = self.round_token(0, m0, mLayerIn.shape[0])
            first = self.load_batch(0, gtid, du.token_row(mResCur, m0 + row))
        self.sum_partials(storage, m0, mPartials)
        if cutlass.const_expr(self.sinkhorn_warp):
            du.named_barrier_arrive(MIXES_READY, self.threads)
        self.finish(storage, m0, mNormW, mResCur, mPostOut, mCombOut, mLayerIn, scalars, first, norm_w, mPreOut)

    @cute.jit
    def round_token(self, r, m0: Int32, m_total):
        """This thread's place in the collapse's round ``r``: its index in its token group, whether the group
        has a token this round, and that token's row in the block (clamped to a valid one when it has none)."""
        tidx, _, _ = cute.arch.thread_idx()
        group = cute.arch.warp_idx() // self.group_warps
        n_valid = cutlass.min(m_total - m0, self.tokens)
        t = r * self.groups + group
        return tidx % self.group_threads, t < n_valid, cutlass.min(t, n_valid - 1)

    @cute.jit
    def sum_partials(self, storage: BigFuseStorage, m0: Int32, mPartials: cute.Tensor):
        """mixes[t][c] = sum over s of partials[s, m0 + t, c], s round-robin over the collapse warps, then those warps in
        order (by the collapse threads)."""
        tidx, _, _ = cute.arch.thread_idx()
        lane, warp = cute.arch.lane_idx(), cute.arch.warp_idx()
        m_total = mPartials.shape[1]
        # the columns past the last one kernel 1 writes are never read from memory (initcheck: uninitialised);
        # those lanes repeat it, and their sums are never used
        last_col = X1_SUMSQ_COL if self.delayed and self.norm_dtype is not None else SUMSQ_COL
        col = cutlass.min(lane, last_col)
        rounds = -(-self.split_k // self.collapse_warps)
        exact = self.split_k % self.collapse_warps == 0
        splits = [warp + r * self.collapse_warps for r in range(rounds)]
        for chunk in self.token_chunks:
            # clamped indices keep every load in bounds and unconditional; the out-of-range terms are replaced
            # by an exact zero. Issued last split first, summed first split first: the sum's first add needs the
            # last load issued, so ptxas cannot start the sum between the loads (in the delayed seam with the norm it
            # did, and issued the rest a memory round trip or two later: SASS, docs/experiments.md 2026-12-05)
            vals = {}
            for t in chunk:
                m = cutlass.min(m0 + t, m_total - 1)
                row = [mPartials[s if exact else cutlass.min(s, self.split_k - 1), m, col] for s in reversed(splits)]
                row.reverse()
                vals[t] = row
            # a warp barrier before any of them is used: the compiler keeps every load above it (these and the
            # caller's first collapse batch) in flight together; else ptxas may start the sum first and issue
            # the collapse batch a memory round trip later (seen in the SASS with uneven splits)
            cute.arch.sync_warp()
            for t in chunk:
                acc = Float32(0.0)
                for r in cutlass.range_constexpr(rounds):
                    if cutlass.const_expr(exact):
                        acc = acc + vals[t][r]
                    else:
                        acc = acc + (vals[t][r] if splits[r] < self.split_k else Float32(0.0))
                storage.partial_sums[warp, t, lane] = acc
        self.collapse_barrier()
        for base in cutlass.range_constexpr(0, self.tokens * PARTIAL_COLS, self.collapse_threads):
            i = base + tidx
            if i < self.tokens * PARTIAL_COLS:
                t, c = i // PARTIAL_COLS, i % PARTIAL_COLS
                total = Float32(0.0)
                for w in cutlass.range_constexpr(self.collapse_warps):
                    total = total + storage.partial_sums[w, t, c]
                storage.mixes[t, c] = total
        self.collapse_barrier()

    @cute.jit
    def rstd(self, storage: BigFuseStorage, t, rms_eps: Float32) -> Float32:
        """rsqrt(sum(xf^2) / 4H + eps) within a few ulp, without branches (it starts the Sinkhorn warp's chain)."""
        mean_sq = storage.mixes[t, SUMSQ_COL] * Float32(1.0 / (HC_MULT * self.hidden))
        return du.rsqrt(mean_sq + rms_eps)

    @cute.jit
    def finish(self, storage: BigFuseStorage, m0: Int32, mNormW, mResCur: cute.Tensor, mPostOut: cute.Tensor,
               mCombOut: cute.Tensor, mLayerIn: cute.Tensor, scalars: BigFuseScalars, first, norm_w, mPreOut):
        """The work after the partials are summed, by the threads that collapse: ``collapse`` (the V4 seam), or
        ``norm_in_place`` (the delayed seam)."""
        if cutlass.const_expr(self.delayed):
            self.norm_in_place(storage, m0, mNormW, mPostOut, mCombOut, mLayerIn, mPreOut, scalars, norm_w)
        else:
            self.collapse(storage, m0, mNormW, mResCur, mPostOut, mCombOut, mLayerIn, scalars, first, norm_w)

    @cute.jit
    def norm_in_place(self, storage: BigFuseStorage, m0: Int32, mNormW, mPostOut: cute.Tensor, mCombOut: cute.Tensor,
                      mLayerIn: cute.Tensor, mPreOut: cute.Tensor, scalars: BigFuseScalars, norm_w):
        """The delayed seam's phase (SPEC "V4.1: the delayed seam"): the post and pre gates (``post_gates``), the
        Sinkhorn (unless its warp runs it), and with the norm ``layer_input = bf16(x1 * r * w)`` in place, x1 being
        kernel 1's collapse already in ``layer_input`` and r from its sum of squares (``X1_SUMSQ_COL``): no row
        reduction here, and each element is read and written by the same thread (``normalise_batch``)."""
        self.post_gates(storage, m0, mPostOut, scalars, mPreOut)
        if cutlass.const_expr(self.norm_dtype is not None):
            for r in cutlass.range_constexpr(self.rounds):
                gtid, valid, tc = self.round_token(r, m0, mLayerIn.shape[0])
                if valid:
                    self.normalise_row(gtid, storage.mixes[tc, X1_SUMSQ_COL], scalars.norm_eps, mNormW,
                                       du.token_row(mLayerIn, m0 + tc), None, norm_w)
        if cutlass.const_expr(not self.sinkhorn_warp):
            self.sinkhorn(storage, m0, mCombOut, scalars)

    @cute.jit
    def collapse(
        self,
        storage: BigFuseStorage,
        m0: Int32,
        mNormW,
        mResCur: cute.Tensor,
        mPostOut: cute.Tensor,
        mCombOut: cute.Tensor,
        mLayerIn: cute.Tensor,
        scalars: BigFuseScalars,
        first,
        norm_w,
    ):
        """layer_input = bf16(sum_j pre[j] * residual_cur[j]) (j in order), then the optional RMSNorm over the
        rounded values, by the threads that collapse (all, or all but the ``sinkhorn_warp``). Token group g handles
        tokens g, g + groups, ...; the post gates and the Sinkhorn run while the first batch of the first round is
        loading (``first``: that batch, when already loaded), or after the collapse (``sinkhorn_last``), unless
        the Sinkhorn has a warp of its own (``run``): then the post gates run while round 0's last batch loads."""
        group = cute.arch.warp_idx() // self.group_warps
        for r in cutlass.range_constexpr(self.rounds):
            gtid, valid, tc = self.round_token(r, m0, mLayerIn.shape[0])
            sumsq = Float32(0.0)
            rounded = cute.make_rmem_tensor((self.slots if self.keep_rounded else 1, du.VEC_BF16), Float32)
            rstd = self.rstd(storage, tc, scalars.rms_eps)
            pre = [self.pre_gate(storage, tc, j, rstd, scalars) for j in range(HC_MULT)]
            row_res, row_out = du.token_row(mResCur, m0 + tc), du.token_row(mLayerIn, m0 + tc)
            if cutlass.const_expr(self.batches <= 2):
                for b in cutlass.range_constexpr(self.batches):
                    if cutlass.const_expr(r == 0 and b == 0 and first is not None):
                        res = first
                    else:
                        res = self.load_batch(b, gtid, row_res)
                    if cutlass.const_expr(r == 0 and b == self.batches - 1 and self.sinkhorn_warp):
                        self.post_gates(storage, m0, mPostOut, scalars)
                    if cutlass.const_expr(r == 0 and b == 0 and not self.sinkhorn_warp):
                        self.post_gates(storage, m0, mPostOut, scalars)
                        self.sinkhorn(storage, m0, mCombOut, scalars)
                    sumsq = self.collapse_batch(b, gtid, valid, res, pre, row_out, rounded, sumsq)
            else:
                # a token-less group still runs the first batch's Sinkhorn hook
                n_batches = Int32(1 if r == 0 and not self.sinkhorn_last else 0)
                if valid:
                    n_batches = Int32(self.batches)
                for b in cutlass.range(n_batches, unroll=1):
                    res = self.load_batch(b, gtid, row_res)
                    if cutlass.const_expr(r == 0 and not self.sinkhorn_last):
                        if b == 0:
                            self.post_gates(storage, m0, mPostOut, scalars)
                            self.sinkhorn(storage, m0, mCombOut, scalars)
                    sumsq = self.collapse_batch(b, gtid, valid, res, pre, row_out, rounded, sumsq)
            if cutlass.const_expr(self.norm_dtype is not None):
                total = self.group_sum(sumsq, storage.scratch, group)
                if valid:
                    self.normalise_row(gtid, total, scalars.norm_eps, mNormW, row_out, rounded, norm_w)

        if cutlass.const_expr(self.sinkhorn_last):
            self.post_gates(storage, m0, mPostOut, scalars)
            self.sinkhorn(storage, m0, mCombOut, scalars)

    @cute.jit
    def load_batch(self, b, gtid, row_res):
        """The 4 stream vectors of this thread's 8-vectors ``batch * b ...`` of a token, all loads in flight.

        The loads are unconditional (the vector index clamped; ``row_res`` is always a valid row, see
        ``round_token``): a guarded load sits in a branch of its own, where the compiler also puts its bf16
        widening, which then waits for it, so that each guarded vector cost one memory round trip in turn."""
        res = cute.make_rmem_tensor(du.row_major(self.batch, HC_MULT, du.VEC_BF16), BFloat16)
        for i in cutlass.range_constexpr(self.batch):
            o = cutlass.min(gtid + (b * self.batch + i) * self.group_threads, self.octets - 1)
            for j in cutlass.range_constexpr(HC_MULT):
                src = cute.local_tile(row_res, (du.VEC_BF16,), (j * self.octets + o,))
                cute.autovec_copy(src, res[i, j, None])
        return res

    @cute.jit
    def collapse_batch(self, b, gtid, valid, res, pre, row_out, rounded, sumsq: Float32) -> Float32:
        """The collapse of one loaded batch; returns ``sumsq`` plus its rounded squares (norm)."""
        for i in cutlass.range_constexpr(self.batch):
            u = b * self.batch + i
            o = gtid + u * self.group_threads
            if valid & (o < self.octets):
                li = du.widen_bf16x8(res[i, 0, None]) * pre[0]
                for j in cutlass.range_constexpr(1, HC_MULT):
                    li = li + du.widen_bf16x8(res[i, j, None]) * pre[j]
                if cutlass.const_expr(self.norm_dtype is None or not self.keep_rounded):
                    li = du.store_bf16x8(cute.local_tile(row_out, (du.VEC_BF16,), (o,)), li)
                else:  # keep_rounded: slots <= 8, so b (and u) are compile-time here
                    li = li.to(BFloat16).to(Float32)
                    if cutlass.const_expr(u < self.slots):
                        rounded[u, None].store(li)
                if cutlass.const_expr(self.norm_dtype is not None):
                    for e in cutlass.range_constexpr(du.VEC_BF16):
                        sumsq = sumsq + li[e] * li[e]
        return sumsq

    @cute.jit
    def load_norm_weights(self, mNormW: cute.Tensor):
        """This thread's 8-vectors of the norm weight (``prefetch_norm``). An input of the op like the
        constants: a kernel may load them before ``griddepcontrol_wait``, taking their round trip off the norm's
        second pass."""
        tidx, _, _ = cute.arch.thread_idx()
        gtid = tidx % self.group_threads
        w = cute.make_rmem_tensor(du.row_major(self.slots, du.VEC_BF16), self.norm_dtype)
        for u in cutlass.range_constexpr(self.slots):
            o = gtid + u * self.group_threads
            if o < self.octets:
                cute.autovec_copy(cute.local_tile(mNormW, (du.VEC_BF16,), (o,)), w[u, None])
        return w

    @cute.jit
    def normalise_row(self, gtid, sum_sq: Float32, norm_eps: Float32, mNormW: cute.Tensor, row_out, rounded, norm_w):
        """The norm's second pass over this thread's part of a row whose sum of squares is ``sum_sq``: r =
        rsqrt(mean + eps), then ``normalise_batch`` on every batch (unrolled up to two; ``norm_w`` as there)."""
        r_norm = du.rsqrt(sum_sq * Float32(1.0 / self.hidden) + norm_eps)
        if cutlass.const_expr(self.batches <= 2):
            for b in cutlass.range_constexpr(self.batches):
                self.normalise_batch(b, gtid, r_norm, mNormW, row_out, rounded, norm_w)
        else:
            for b in cutlass.range(self.batches, unroll=1):
                self.normalise_batch(b, gtid, r_norm, mNormW, row_out, rounded, None)

    @cute.jit
    def normalise_batch(self, b, gtid, r_norm: Float32, mNormW: cute.Tensor, row_out, rounded, norm_w):
        """Second pass of the norm for one batch of 8-vectors: bf16(li * r * w), every load before any store
        (``norm_w``: the prefetched weights, else loaded here)."""
        li = cute.make_rmem_tensor(du.row_major(self.batch, du.VEC_BF16), Float32)
        w = cute.make_rmem_tensor(du.row_major(self.batch, du.VEC_BF16), Float32)
        for i in cutlass.range_constexpr(self.batch):
            u = b * self.batch + i
            o = gtid + u * self.group_threads
            if o < self.octets:
                if cutlass.const_expr(self.keep_rounded):  # slots <= 8: b and u are compile-time
                    if cutlass.const_expr(u < self.slots):
                        li[i, None].store(rounded[u, None].load())
                else:  # this thread's own unnormalised store (exact: already rounded), or kernel 1's x1 (delayed)
                    li[i, None].store(du.load_bf16x8(cute.local_tile(row_out, (du.VEC_BF16,), (o,))))
                src = cute.local_tile(mNormW, (du.VEC_BF16,), (o,))
                if cutlass.const_expr(norm_w is not None):  # prefetched: slots <= 8 and batches <= 2, u compile-time
                    if cutlass.const_expr(u < self.slots):
                        w[i, None].store(norm_w[u, None].load().to(Float32))
                elif cutlass.const_expr(self.norm_dtype is BFloat16):
                    w[i, None].store(du.load_bf16x8(src))
                else:
                    cute.autovec_copy(src, w[i, None])
        for i in cutlass.range_constexpr(self.batch):
            o = gtid + (b * self.batch + i) * self.group_threads
            if o < self.octets:
                du.store_bf16x8(cute.local_tile(row_out, (du.VEC_BF16,), (o,)),
                                li[i, None].load() * r_norm * w[i, None].load())

    @cute.jit
    def group_sum(self, val: Float32, scratch: cute.Tensor, group) -> Float32:
        """Sum over the threads of this token group (fixed order); every thread that collapses must call it."""
        val = du.warp_sum(val)
        # warp_idx is a shuffle over the whole warp: under the lane test only lane 0 would reach it (a hang)
        warp = cute.arch.warp_idx()
        if cute.arch.lane_idx() == 0:
            scratch[warp] = val
        self.collapse_barrier()
        total = Float32(0.0)
        for w in cutlass.range_constexpr(self.group_warps):
            total = total + scratch[group * self.group_warps + w]
        self.collapse_barrier()
        return total

    @cute.jit
    def collapse_barrier(self):
        """A barrier of the threads that collapse: the CTA, or all warps but the ``sinkhorn_warp`` (named barrier 1),
        which meanwhile runs the Sinkhorn and never reaches it."""
        if cutlass.const_expr(self.sinkhorn_warp):
            cute.arch.barrier(barrier_id=COLLAPSE_BARRIER, number_of_threads=self.collapse_threads)
        else:
            cute.arch.sync_threads()

    @cute.jit
    def mix(self, storage: BigFuseStorage, t, c: int, rstd: Float32, group: int) -> Float32:
        """SPEC step 3 for column ``c`` of token ``t``: ``dot * rstd * hc_scale[group] + hc_base[c]``."""
        return storage.mixes[t, c] * rstd * storage.constants[SCALE_AT + group] + storage.constants[c]

    @cute.jit
    def pre_gate(self, storage: BigFuseStorage, t, j, rstd: Float32, scalars: BigFuseScalars) -> Float32:
        """SPEC step 4's pre gate ``j`` of token ``t``."""
        return du.sigmoid(self.mix(storage, t, j, rstd, 0)) + scalars.hc_pre_eps

    @cute.jit
    def post_gate(self, storage: BigFuseStorage, t, j, rstd: Float32, scalars: BigFuseScalars) -> Float32:
        """SPEC step 4's post gate ``j`` of token ``t``."""
        return du.sigmoid(self.mix(storage, t, HC_MULT + j, rstd, 1)) * scalars.hc_post_mult_value

    @cute.jit
    def post_gates(self, storage: BigFuseStorage, m0: Int32, mPostOut: cute.Tensor, scalars: BigFuseScalars,
                   mPreOut=None):
        """The block's post gates (and, given ``mPreOut``, the pre gates: the delayed seam's ``pre_mix_cur``), one
        gate index per collapse thread (looping when the block has more): called once by every collapse thread,
        while a batch of the collapse loads, so the gates' chain (rstd, a sigmoid) overlaps those loads and stays
        off the Sinkhorn's, which ends the call."""
        tidx, _, _ = cute.arch.thread_idx()
        for base in cutlass.range_constexpr(0, self.tokens * HC_MULT, self.collapse_threads):
            t, j = (base + tidx) // HC_MULT, (base + tidx) % HC_MULT
            if t < self.tokens and m0 + t < mPostOut.shape[0]:
                rstd = self.rstd(storage, t, scalars.rms_eps)
                mPostOut[m0 + t, j] = self.post_gate(storage, t, j, rstd, scalars)
                if cutlass.const_expr(mPreOut is not None):
                    mPreOut[m0 + t, j] = self.pre_gate(storage, t, j, rstd, scalars)

    @cute.jit
    def sinkhorn(self, storage: BigFuseStorage, m0: Int32, mCombOut: cute.Tensor, scalars: BigFuseScalars):
        """The Sinkhorn of the comb mixes, in the first warps or the ``sinkhorn_warp``: one thread per token, or with
        ``pair_sinkhorn`` two lanes per token, each with two rows (``du.sinkhorn_4x4``'s ``pair``). The pair form runs in the whole
        warp, since its shuffles need every lane; a lane past the block's tokens repeats its last token and stores
        nothing. Kept as two branches: one body with the lanes per token a compile-time value made the one-lane calls
        slower (scalar comb stores, the gates' stores predicated one by one; ``docs/experiments.md``)."""
        tidx, _, _ = cute.arch.thread_idx()
        pos = tidx - ((self.warps - 1) * du.WARP if self.sinkhorn_warp else 0)
        if cutlass.const_expr(self.pair_sinkhorn):
            if pos >= 0 and pos < du.WARP:  # warp-uniform
                n_valid = cutlass.min(mCombOut.shape[0] - m0, self.tokens)
                t, half = pos // 2, pos % 2
                tc = cutlass.min(t, n_valid - 1)
                rstd = self.rstd(storage, tc, scalars.rms_eps)
                n = HC_MULT * HC_MULT // 2
                comb = cute.make_rmem_tensor((n,), Float32)
                for i in cutlass.range_constexpr(n):
                    comb[i] = self.mix(storage, tc, 2 * HC_MULT + n * half + i, rstd, 2)
                du.sinkhorn_4x4(comb, scalars.hc_sinkhorn_eps, scalars.sinkhorn_repeat, pair=True)
                if t < n_valid:
                    for i in cutlass.range_constexpr(n):
                        mCombOut[m0 + t, n * half + i] = comb[i]
        elif cutlass.const_expr(self.sinkhorn_warp and self.tokens * SOFTMAX_LANES <= du.WARP):
            # the warp is the Sinkhorn's alone and its token count leaves 16 lanes per token: they take the comb mixes
            # and the softmax one element each (``du.softmax_rows_by_lane``, the same bits), then every lane of the
            # token gathers the 16 and runs the (one-lane) scaling steps; the token's first lane stores
            n_valid = cutlass.min(mCombOut.shape[0] - m0, self.tokens)
            t, e = pos // SOFTMAX_LANES, pos % SOFTMAX_LANES
            tc = cutlass.min(t, n_valid - 1)
            rstd = self.rstd(storage, tc, scalars.rms_eps)
            k_e = du.softmax_rows_by_lane(self.mix(storage, tc, 2 * HC_MULT + e, rstd, 2), scalars.hc_sinkhorn_eps)
            comb = cute.make_rmem_tensor((HC_MULT * HC_MULT,), Float32)
            for i in cutlass.range_constexpr(HC_MULT * HC_MULT):
                comb[i] = cute.arch.shuffle_sync(k_e, offset=t * SOFTMAX_LANES + i)
            du.sinkhorn_scaling(comb, scalars.hc_sinkhorn_eps, scalars.sinkhorn_repeat)
            if e == 0 and t < n_valid:
                for i in cutlass.range_constexpr(HC_MULT * HC_MULT):
                    mCombOut[m0 + t, i] = comb[i]
        elif pos >= 0 and pos < self.tokens and m0 + pos < mCombOut.shape[0]:
            m, t = m0 + pos, pos
            rstd = self.rstd(storage, t, scalars.rms_eps)
            comb = cute.make_rmem_tensor((HC_MULT * HC_MULT,), Float32)
            for i in cutlass.range_constexpr(HC_MULT * HC_MULT):
                comb[i] = self.mix(storage, t, 2 * HC_MULT + i, rstd, 2)
            du.sinkhorn_4x4(comb, scalars.hc_sinkhorn_eps, scalars.sinkhorn_repeat)
            for i in cutlass.range_constexpr(HC_MULT * HC_MULT):
                mCombOut[m, i] = comb[i]


def flat_outputs(hidden: int, m, residual_cur, post_mix_cur, comb_mix_cur, layer_input):
    """Row-per-token views of the outputs: ``[M, 4H]``, ``[M, 4]``, ``[M, 16]``, ``[M, H]`` (host side of a jit)."""
    return (
        cute.make_tensor(residual_cur.iterator, du.row_major(m, HC_MULT * hidden)),
        cute.make_tensor(post_mix_cur.iterator, du.row_major(m, HC_MULT)),
        cute.make_tensor(comb_mix_cur.iterator, du.row_major(m, HC_MULT * HC_MULT)),
        cute.make_tensor(layer_input.iterator, du.row_major(m, hidden)),
    )


def gate_rows(m, gates):
    """``[M, 4]`` row-per-token view of per-token gates (``pre_mix_prev``, ``pre_mix_cur``); None stays None (host
    side of a jit)."""
    return None if gates is None else cute.make_tensor(gates.iterator, du.row_major(m, HC_MULT))


def partials_view(workspace, split_k: int, m):
    """``[split_k, M, 32]`` fp32 over the start of the flat workspace buffer (host side of a jit)."""
    return cute.make_tensor(workspace.iterator, du.row_major(split_k, m, PARTIAL_COLS))


class BigFuseKernel:
    """Standalone big fuse: one CTA of ``threads`` threads per block of ``tokens`` tokens."""

    def __init__(self, hidden: int, split_k: int, tokens: int, threads: int, norm_dtype, batch: int = 4,
                 sinkhorn_warp: bool = False, pair_sinkhorn: bool = False, delayed: bool = False):
        self.phase = BigFusePhase(hidden, split_k, tokens, threads, norm_dtype, batch, sinkhorn_warp=sinkhorn_warp,
                                  pair_sinkhorn=pair_sinkhorn, delayed=delayed)

    @cute.jit
    def launch(self, mPartials, mScale, mBase, mNormW, mResCur, mPostOut, mCombOut, mLayerIn, scalars, stream,
               mPreOut=None):
        """Launch on flattened tensors (see ``flat_outputs``, ``partials_view``, ``gate_rows``); callable from
        another jit."""
        m = mResCur.shape[0]
        phase = self.phase
        self.kernel(mPartials, mScale, mBase, mNormW, mResCur, mPostOut, mCombOut, mLayerIn, scalars, mPreOut).launch(
            grid=[cute.ceil_div(m, phase.tokens), 1, 1], block=[phase.threads, 1, 1], stream=stream, use_pdl=True
        )

    @cute.kernel
    def kernel(self, mPartials, mScale, mBase, mNormW, mResCur, mPostOut, mCombOut, mLayerIn, scalars: BigFuseScalars,
               mPreOut):
        bidx, _, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        storage = self.phase.allocate(smem)
        phase = self.phase
        norm_w = phase.prefetch(storage, mScale, mBase, mNormW)
        # launched with programmatic dependent launch: wait for the producer grid (and its memory) here
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()  # the next kernel (next call's kernel 1) may start its prologue
        phase.run(storage, bidx * phase.tokens, mPartials, mNormW, mResCur, mPostOut, mCombOut, mLayerIn, scalars,
                  norm_w, mPreOut)


def standalone_big_fuse(hidden: int, split_k: int, norm_dtype, fuse: str, delayed: bool = False) -> BigFuseKernel:
    """The big-fuse kernel of the two-launch paths (E, B) (``delayed``: of the delayed seam, ``BigFusePhase``'s
    ``delayed``): one token per CTA, shaped by ``fuse`` (see
    ``tactics.FUSE_SHAPES``). "lat": enough threads that each thread's 8-vectors of the token fit one batch of
    4 loads in flight, so the collapse costs one memory round trip, and a warp of its own for the Sinkhorn;
    "bw": 128 threads, batches of 2 (fewer registers, so that many CTAs share an SM). A trailing "p" ("latp",
    "bwp"): the same shape with the Sinkhorn two lanes per token (``BigFusePhase``'s ``pair_sinkhorn``)."""
    pair = fuse.endswith("p")
    if delayed and norm_dtype is None and fuse.removesuffix("p") == "bw":
        # the delayed seam without the norm has no row work left: a block of tokens per CTA, their Sinkhorns two
        # lanes each in one warp, their partial rows loaded at once (one token per CTA left every CTA's Sinkhorn
        # chain in series with its loads: ~1.3 waves of them at M = 2048)
        return BigFuseKernel(hidden, split_k, DELAYED_BLOCK_TOKENS, 128, None, 2, pair_sinkhorn=True, delayed=True)
    if fuse.removesuffix("p") == "lat":
        batch = 4
        threads = du.batch_threads(hidden, batch, 1024 - du.WARP) + du.WARP
        return BigFuseKernel(hidden, split_k, 1, threads, norm_dtype, batch, sinkhorn_warp=True, pair_sinkhorn=pair,
                             delayed=delayed)
    return BigFuseKernel(hidden, split_k, 1, 128, norm_dtype, 2, pair_sinkhorn=pair, delayed=delayed)
