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
from cutlass import BFloat16, Float32, Int32  # noqa: E402

from .. import tactics as tac  # noqa: E402
from ..tactics import HC_MULT, N_MIXES, FmaTactic  # noqa: E402
from ..workspace import get_workspace  # noqa: E402
from . import (  # noqa: E402
    CompiledKernels, compile_in_processes, compile_kernel, fake_buffer, fake_tensors, norm_dtype_of, resolve_tactic,
    scalar_args, spec_problem,
)
from . import device_utils as du  # noqa: E402
from .big_fuse import BigFusePhase, BigFuseScalars, flat_outputs, partials_view, standalone_big_fuse  # noqa: E402,E501

SUMSQ_COL = N_MIXES
QUAD = 4  # fp32 elements in one 16-byte access


class FmaFusedHc:
    """Paths E/F for one tactic, hidden size and norm flag (all compile-time)."""

    def __init__(self, tactic: FmaTactic, hidden: int, norm_dtype):
        tactic.check(hidden)
        self.tactic = tactic
        self.hidden = hidden
        self.tokens = tactic.tokens_per_cta
        self.threads = tactic.threads
        self.warps = tactic.threads // du.WARP
        self.tile_n = tactic.tile_n
        self.group_threads = tactic.threads * tactic.tile_n // N_MIXES  # one K vector each, = chunk_h
        self.warps_per_group = self.group_threads // du.WARP
        self.chunk_h = tactic.chunk_h
        self.quads = self.chunk_h // QUAD  # K vectors per stream in a chunk
        self.burst = tactic.burst  # chunks per post-map step
        self.load_h = self.chunk_h * tactic.burst  # hidden positions per post-map step
        self.octets = self.load_h // du.VEC_BF16  # post-map tasks per token per step
        self.split_k = tactic.split_k
        self.split_h = hidden // tactic.split_k
        self.n_chunks = self.split_h // self.chunk_h
        self.post_tasks = self.tokens * self.octets
        self.post_rounds = -(-self.post_tasks // self.threads)
        self.red_cols = self.tokens * (self.tile_n + 1)  # per warp: dots, then sums of squares
        self.fused = tactic.path == "all_fma"
        if self.fused:
            self.phase = BigFusePhase(hidden, tactic.split_k, self.tokens, self.threads, norm_dtype)
        else:
            self.big_fuse = standalone_big_fuse(hidden, tactic.split_k, norm_dtype, tactic.fuse)

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
        rms_eps: Float32,
        hc_pre_eps: Float32,
        hc_sinkhorn_eps: Float32,
        hc_post_mult_value: Float32,
        sinkhorn_repeat: Int32,
        norm_eps: Float32,
        stream,
    ):
        m, h = x.shape[0], self.hidden
        mX = cute.make_tensor(x.iterator, du.row_major(m, h))
        mRes = cute.make_tensor(residual.iterator, du.row_major(m, HC_MULT * h))
        mPost = cute.make_tensor(post_mix.iterator, du.row_major(m, HC_MULT))
        mComb = cute.make_tensor(comb_mix.iterator, du.row_major(m, HC_MULT * HC_MULT))
        outs = flat_outputs(h, m, residual_cur, post_mix_cur, comb_mix_cur, layer_input)
        mPartials = partials_view(workspace, self.split_k, m)
        scalars = BigFuseScalars(rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value, sinkhorn_repeat, norm_eps)
        self.kernel(mX, mRes, mPost, mComb, fn, hc_scale, hc_base, norm_weight, *outs, mPartials, counters,
                    scalars).launch(grid=[cute.ceil_div(m, self.tokens), self.split_k, 1],
                                    block=[self.threads, 1, 1], stream=stream)
        if cutlass.const_expr(not self.fused):
            self.big_fuse.launch(mPartials, hc_scale, hc_base, norm_weight, *outs, scalars, stream)

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
        scalars: BigFuseScalars,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        block, split, _ = cute.arch.block_idx()
        if cutlass.const_expr(not self.fused):
            cute.arch.griddepcontrol_launch_dependents()  # the big-fuse CTAs start early and wait for this grid
        smem = cutlass.memory.SmemAllocator()
        sAct = smem.allocate_tensor(Float32, du.row_major(self.tokens, HC_MULT, self.load_h), 16)
        sRed = smem.allocate_tensor(Float32, du.row_major(self.warps, self.red_cols), 16)
        if cutlass.const_expr(self.fused):
            storage = self.phase.allocate(smem)
            sArrival = smem.allocate_tensor(Int32, cute.make_layout(1), 4)

        m0 = block * self.tokens
        group = tidx // self.group_threads  # warp-uniform
        kvec = tidx % self.group_threads
        stream_j, quad = kvec // self.quads, kvec % self.quads
        coefs = self.load_post_coefficients(m0, mPost, mComb)

        acc = cute.make_rmem_tensor((self.tokens, self.tile_n), Float32)
        acc.fill(0.0)
        sumsq = cute.make_rmem_tensor((self.tokens,), Float32)
        sumsq.fill(0.0)
        # quad index of this thread's K vector in a weight row, at chunk 0 of this split
        fn_quad0 = stream_j * (self.hidden // QUAD) + split * (self.split_h // QUAD) + quad
        weights = cute.make_rmem_tensor((self.tile_n, QUAD), Float32)
        self.load_weights(weights, mFn, group, fn_quad0)
        for c in cutlass.range(self.n_chunks, unroll=1):
            if cutlass.const_expr(self.tactic.stages == 2):
                next_weights = cute.make_rmem_tensor((self.tile_n, QUAD), Float32)
                if c + 1 < self.n_chunks:
                    self.load_weights(next_weights, mFn, group, fn_quad0 + (c + 1) * self.quads)
            elif c > 0:
                self.load_weights(weights, mFn, group, fn_quad0 + c * self.quads)
            sub = c % self.burst
            if sub == 0:
                if c > 0:
                    cute.arch.sync_threads()  # the previous step's projections are done with sAct
                self.post_map(m0, split * self.split_h + c * self.chunk_h, coefs, mX, mRes, mResCur, sAct)
                cute.arch.sync_threads()
            for t in cutlass.range_constexpr(self.tokens):
                a = cute.local_tile(sAct[t, stream_j, None], (QUAD,), (sub * self.quads + quad,)).load()
                # a 4-term dot first, then one rounding into the long accumulator (halves its rounding error)
                for i in cutlass.range_constexpr(self.tile_n):
                    dot = a[0] * weights[i, 0]
                    for e in cutlass.range_constexpr(1, QUAD):
                        dot = cute.math.fma(a[e], weights[i, e], dot)
                    acc[t, i] = acc[t, i] + dot
                if group == 0:
                    sq = a[0] * a[0]
                    for e in cutlass.range_constexpr(1, QUAD):
                        sq = cute.math.fma(a[e], a[e], sq)
                    sumsq[t] = sumsq[t] + sq
            if cutlass.const_expr(self.tactic.stages == 2):
                weights.store(next_weights.load())
        self.write_partials(m0, split, acc, sumsq, sRed, mPartials)

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
                           scalars)
                if tidx == 0:
                    mCounters[block] = Int32(0)  # every CTA of the block has arrived: ready for the next call

    @cute.jit
    def load_post_coefficients(self, m0: Int32, mPost: cute.Tensor, mComb: cute.Tensor):
        """post[j] and comb[k][j] of the token of each post-map task this thread runs (20 fp32 per task)."""
        tidx, _, _ = cute.arch.thread_idx()
        m_last = mPost.shape[0] - 1
        n_coef = HC_MULT + HC_MULT * HC_MULT
        coefs = cute.make_rmem_tensor((self.post_rounds, n_coef), Float32)
        for r in cutlass.range_constexpr(self.post_rounds):
            task = tidx + r * self.threads
            m = cutlass.min(m0 + task // self.octets, m_last)  # clamped: the tail tasks' values are unused
            for j in cutlass.range_constexpr(HC_MULT):
                coefs[r, j] = mPost[m, j]
            for i in cutlass.range_constexpr(HC_MULT * HC_MULT):
                coefs[r, HC_MULT + i] = mComb[m, i]
        return coefs

    @cute.jit
    def load_weights(self, weights: cute.Tensor, mFn: cute.Tensor, group: Int32, fn_quad: Int32):
        for i in cutlass.range_constexpr(self.tile_n):
            row = mFn[group * self.tile_n + i, None]
            weights[i, None].store(du.load_f32x4(cute.local_tile(row, (QUAD,), (fn_quad,))))

    @cute.jit
    def post_map(self, m0: Int32, h0: Int32, coefs: cute.Tensor, mX, mRes, mResCur, sAct: cute.Tensor):
        """SPEC step 1 for the ``burst`` chunks at h0: residual_cur to global memory, fp32 values to ``sAct``.

        Every task's loads are issued first, unconditionally (token and task clamped to valid ones), and a warp
        barrier follows them: otherwise ptxas issued two of the four residual loads only after computing with
        the first two, which cost a second memory round trip on the critical path at small M (seen in the SASS).
        """
        tidx, _, _ = cute.arch.thread_idx()
        m_total = mX.shape[0]
        octets_h = self.hidden // du.VEC_BF16
        raw = cute.make_rmem_tensor(du.row_major(self.post_rounds, 1 + HC_MULT, du.VEC_BF16), BFloat16)
        for r in cutlass.range_constexpr(self.post_rounds):
            task = cutlass.min(tidx + r * self.threads, self.post_tasks - 1)
            m = cutlass.min(m0 + task // self.octets, m_total - 1)
            vec = h0 // du.VEC_BF16 + task % self.octets  # index of this 8-vector within a stream row
            cute.autovec_copy(cute.local_tile(mX[m, None], (du.VEC_BF16,), (vec,)), raw[r, 0, None])
            for k in cutlass.range_constexpr(HC_MULT):
                src = cute.local_tile(mRes[m, None], (du.VEC_BF16,), (k * octets_h + vec,))
                cute.autovec_copy(src, raw[r, 1 + k, None])
        cute.arch.sync_warp()
        for r in cutlass.range_constexpr(self.post_rounds):
            task = tidx + r * self.threads
            if task < self.post_tasks:
                t, o = task // self.octets, task % self.octets
                m = m0 + t
                if m < m_total:
                    vec = h0 // du.VEC_BF16 + o
                    row_out = mResCur[m, None]
                    xv = raw[r, 0, None].load().to(Float32)
                    res = [raw[r, 1 + k, None].load().to(Float32) for k in range(HC_MULT)]
                    for j in cutlass.range_constexpr(HC_MULT):
                        out = cute.make_rmem_tensor((du.VEC_BF16,), Float32)
                        for e in cutlass.range_constexpr(du.VEC_BF16):
                            chain = xv[e] * coefs[r, j]  # a plain fp32 product first, then the FMA chain
                            for k in cutlass.range_constexpr(HC_MULT):
                                chain = cute.math.fma(coefs[r, HC_MULT + HC_MULT * k + j], res[k][e], chain)
                            out[e] = chain
                        rounded = du.store_bf16x8(cute.local_tile(row_out, (du.VEC_BF16,), (j * octets_h + vec,)),
                                                  out.load())
                        cute.local_tile(sAct[t, j, None], (du.VEC_BF16,), (o,)).store(rounded)
                else:
                    for j in cutlass.range_constexpr(HC_MULT):
                        cute.local_tile(sAct[t, j, None], (du.VEC_BF16,), (o,)).fill(0.0)

    @cute.jit
    def write_partials(self, m0: Int32, split: Int32, acc: cute.Tensor, sumsq: cute.Tensor,
                       sRed: cute.Tensor, mPartials: cute.Tensor):
        """Sum the register tiles over the threads of each column group, in a fixed order, into the partial rows."""
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.warp_idx()
        # one warp reduction for all red_cols values (the sums of squares are zero outside group 0, unread)
        vals = [acc[t, i] for t in range(self.tokens) for i in range(self.tile_n)]
        sums, first, owner = du.warp_reduce_scatter(vals + [sumsq[t] for t in range(self.tokens)])
        if owner:
            for k in cutlass.range_constexpr(len(sums)):
                if first + k < self.red_cols:
                    sRed[warp, first + k] = sums[k]
        cute.arch.sync_threads()
        m_total = mPartials.shape[1]
        row_cols = N_MIXES + 1
        for base in cutlass.range_constexpr(0, self.tokens * row_cols, self.threads):
            idx = base + tidx
            if idx < self.tokens * row_cols:
                t, col = idx // row_cols, idx % row_cols
                if m0 + t < m_total:
                    total = Float32(0.0)
                    if col < N_MIXES:
                        g, i = col // self.tile_n, col % self.tile_n
                        for u in cutlass.range_constexpr(self.warps_per_group):
                            total = total + sRed[g * self.warps_per_group + u, t * self.tile_n + i]
                    else:
                        for u in cutlass.range_constexpr(self.warps_per_group):
                            total = total + sRed[u, self.tokens * self.tile_n + t]
                    mPartials[split, m0 + t, col] = total


_compiled = CompiledKernels("mhc_fma")


def compiled_fma(tactic: FmaTactic, problem, out):
    """The compiled kernel for (tactic, H, norm dtype), compiled (or loaded) on first use."""
    norm = None if problem.norm_weight is None else problem.norm_weight.dtype
    return _compiled.get((tactic, problem.hidden, norm), lambda: compile_fma(tactic, problem, out))


def compile_fma(tactic: FmaTactic, problem, out, kernel_class=None):
    """Compile paths E/F for ``tactic`` against fake tensors shaped like ``problem`` and ``out``; ``kernel_class``:
    ``FmaFusedHc`` or a subclass (``bench/probe_fma_phases.py``'s variants)."""
    kernel = (kernel_class or FmaFusedHc)(tactic, problem.hidden, norm_dtype_of(problem.norm_weight))
    m = cute.sym_int()
    token_tensors = fake_tensors(problem.x, problem.residual, problem.post_mix, problem.comb_mix, tokens=m)
    outputs = fake_tensors(*out, tokens=m)
    fn, norm_weight = fake_tensors(problem.fn, problem.norm_weight)
    scale, base = fake_tensors(problem.hc_scale, problem.hc_base, align=4)  # read as scalars
    counters = fake_buffer(Int32) if tactic.path == "all_fma" else None
    return compile_kernel(kernel, *token_tensors, fn, scale, base, norm_weight, *outputs, fake_buffer(Float32),
                          counters)


@functools.lru_cache(maxsize=4096)
def _default_tactic(path: str, m: int, hidden: int, sm_count: int) -> FmaTactic:
    return tac.default_fma_tactic(path, m, hidden, sm_count)


def _run(path: str, problem, tactic, out) -> None:
    tactic = resolve_tactic(path, tactic, problem, FmaTactic, tac.parse_tactic, _default_tactic)
    fn = compiled_fma(tactic, problem, out)
    ws = get_workspace(problem.x.device)
    partials = ws.partials(tactic.split_k * problem.m * tac.PARTIAL_COLS)
    counters = ws.counters(-(-problem.m // tactic.tokens_per_cta)) if tactic.path == "all_fma" else None
    fn(problem.x, problem.residual, problem.post_mix, problem.comb_mix, problem.fn, problem.hc_scale,
       problem.hc_base, problem.norm_weight, *out, partials, counters, *scalar_args(problem.scalars))


def run_half_fma(problem, tactic, out) -> None:
    """Path E: projection kernel + standalone big-fuse kernel (two launches in one compiled call)."""
    _run("half_fma", problem, tactic, out)


def run_all_fma(problem, tactic, out) -> None:
    """Path F: one launch; the last CTA of each token block runs the big fuse for it."""
    _run("all_fma", problem, tactic, out)


def _compile_spec(spec) -> str:
    """Process-pool worker of ``precompile``: compile (and persist) one (tactic name, H, norm dtype)."""
    name, hidden, norm = spec
    problem = spec_problem(hidden, "fp32", norm)
    compiled_fma(tac.parse_tactic(name), problem, problem.empty_outputs())
    return name


def precompile(specs, processes: int | None = None) -> list[str]:
    """Compile (tactic name, H, norm dtype name or None) variants in parallel worker processes."""
    return compile_in_processes(_compile_spec, specs, processes)
