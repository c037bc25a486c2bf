"""Device helpers shared by every CuTe kernel path: reductions, gates, the 4x4 Sinkhorn, bf16 vectors.

All are ``@cute.jit`` functions, inlined into the calling kernel.
"""

import os
from typing import NamedTuple

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import BFloat16, Float32, Int32, Int64  # noqa: E402
from cutlass._mlir.dialects import nvvm  # noqa: E402
from cutlass.cutlass_dsl import dsl_user_op  # noqa: E402

WARP = 32
VEC_BF16 = 8  # bf16 elements in one 16-byte access
VEC_F32 = 4  # fp32 elements in one 16-byte access


def batch_threads(hidden: int, batch: int, limit: int) -> int:
    """Threads (whole warps, at least 64, at most ``limit``) that hold a row of ``hidden`` bf16 values as one batch
    of ``batch`` 8-vectors each: the row loads in one memory round trip."""
    per_batch = -(-(hidden // VEC_BF16) // batch)
    return min(limit, max(64, -(-per_batch // WARP) * WARP))


def row_major(*shape):
    """A compact row-major layout (CuTe's default is column-major): the last mode is contiguous. The first extent
    may be dynamic (a token count)."""
    strides, step = [1], 1
    for extent in reversed(shape[1:]):
        step *= extent
        strides.append(step)
    return cute.make_layout(shape, stride=tuple(reversed(strides)))


def token_row(t: cute.Tensor, m) -> cute.Tensor:
    """Row ``m`` of a row-per-token tensor (``row_major(M, n)``), its offset computed in 64 bits: with a 32-bit
    token index ``m * n`` wraps once it passes 2^31 (``residual_cur`` [M, 4H] from M = 74,899 at H = 7168)."""
    return t[Int64(m), None]


@dsl_user_op
def named_barrier_arrive(barrier_id: int, number_of_threads: int, *, loc=None, ip=None) -> None:
    """Arrive on a named barrier without waiting, where other warps wait on it at another instruction (the
    unaligned ``barrier.cta.arrive``: the aligned form needs every counted thread at the same instruction)."""
    nvvm.barrier_cta_arrive(Int32(barrier_id).ir_value(loc=loc, ip=ip),
                            Int32(number_of_threads).ir_value(loc=loc, ip=ip), aligned=False, loc=loc, ip=ip)


@dsl_user_op
def named_barrier_wait(barrier_id: int, number_of_threads: int, *, loc=None, ip=None) -> None:
    """Wait on a named barrier that other warps arrive on at another instruction (the unaligned
    ``barrier.cta.sync``)."""
    nvvm.barrier_cta_sync(Int32(barrier_id).ir_value(loc=loc, ip=ip),
                          thread_count=Int32(number_of_threads).ir_value(loc=loc, ip=ip), aligned=False, loc=loc, ip=ip)


@cute.jit
def warp_sum(val: Float32, lanes: cutlass.Constexpr[int] = WARP) -> Float32:
    """Butterfly sum over each group of ``lanes`` consecutive lanes (a power of two; the whole warp by default, 4 for
    an MMA fragment's quad); every lane of the group gets the result (fixed order: deterministic)."""
    for i in cutlass.range_constexpr(lanes.bit_length() - 1):
        val = val + cute.arch.shuffle_sync_bfly(val, offset=1 << i)
    return val


def warp_reduce_scatter(vals: list):
    """Sum each of ``vals`` (a list of per-lane fp32 values, the same length in every lane) over the 32 lanes of
    the warp, each sum ending in one place. Returns ``(sums, first, owner)``: this lane holds the totals of
    ``vals[first + k]`` as ``sums[k]``, and the lanes where ``owner`` is true hold distinct ones (those with
    ``first + k >= len(vals)`` are padding). For n values it takes about n shuffles where one ``warp_sum`` each
    takes 5 n: at each butterfly step a lane keeps half of its values and sends the other half to its partner.
    Fixed order: deterministic. Plain Python: call it from device code (it emits the ops when traced).
    """
    lane = cute.arch.lane_idx()
    size = 1 << max(0, (len(vals) - 1).bit_length())
    vals = list(vals) + [Float32(0.0)] * (size - len(vals))
    first = Int32(0)
    butterfly = 0  # lane bits of the steps left with one value: those lanes end up with equal sums
    for step in range(5):
        offset = 16 >> step
        if len(vals) > 1:
            half = len(vals) // 2
            upper = (lane & offset) != 0  # keeps the upper half, sends the lower one
            send = [Float32(cutlass.select_(upper, lo, hi)) for lo, hi in zip(vals[:half], vals[half:])]
            keep = [Float32(cutlass.select_(upper, hi, lo)) for lo, hi in zip(vals[:half], vals[half:])]
            vals = [k + cute.arch.shuffle_sync_bfly(v, offset=offset) for k, v in zip(keep, send)]
            first = first + Int32(cutlass.select_(upper, Int32(half), Int32(0)))
        else:
            vals = [vals[0] + cute.arch.shuffle_sync_bfly(vals[0], offset=offset)]
            butterfly |= offset
    return vals, first, (lane & butterfly) == 0


@cute.jit
def sigmoid(x: Float32) -> Float32:
    """1 / (1 + exp(-x)), accurate to about an ulp (full-precision exp): the gates feed the collapse directly.

    The division is its fast path written out (``rcp.approx`` refined by one FMA step, the instructions and bits
    of IEEE division for every denominator below 2^126) without the slow-path branch around it, across which the
    compiler does not interleave: a token's four gates then overlap instead of running one after another. Results
    below 2^-126 (x < -87.3) flush to zero; a NaN stays NaN."""
    d = Float32(1.0) + cute.math.exp(-x)
    r = cute.arch.rcp_approx(d)
    refined = cute.math.fma(r, -cute.math.fma(d, r, Float32(-1.0)), r)
    return Float32(cutlass.select_(d == Float32(float("inf")), Float32(0.0), refined))


@cute.jit
def rsqrt(v: Float32) -> Float32:
    """1/sqrt(v) for a positive normal ``v``: ``rsqrt.approx`` refined by one Newton step (within about an ulp), in
    straight-line code where a correctly rounded sqrt and division each branch to a slow path."""
    y = cute.math.rsqrt(v, fastmath=True)
    return cute.math.fma(y * Float32(0.5), cute.math.fma(-v, y * y, Float32(1.0)), y)


@cute.jit
def sinkhorn_4x4(c: cute.Tensor, eps: Float32, repeat: Int32, pair: cutlass.Constexpr[bool] = False):
    """SPEC step 5 in place on ``c``: 16 fp32 registers in row-major order (one thread per token), or with ``pair``
    the 8 of rows 0-1 (even lane) or rows 2-3 (odd lane, ``lane ^ 1``: two lanes per token).

    Row softmax (max-subtracted) + eps gives K; a column step and ``repeat - 1`` (row, column) steps follow, each
    dividing every row (column) by its sum + eps. Those are diagonal scalings, so the matrix stays
    ``diag(r) K diag(s)``, and the steps run on the scaling vectors instead of the 16 elements: with u = 1/r and
    v = 1/s, a row step is ``u_i <- (K s)_i + eps u_i`` (row i sums to ``r_i (K s)_i``), a column step
    ``v_j <- (K^T r)_j + eps v_j``, each followed by 4 reciprocals; ``c = K_ij r_i s_j`` at the end. The chain is
    issue bound, and this issues about half the instructions of scaling the elements (``docs/experiments.md``).
    With ``pair`` a lane computes u, r of its two rows and its half of each column dot, the halves crossing in one
    shuffle; the one-lane dot is ``(rows 0-1) + (rows 2-3)`` with the same roundings (fp32 addition commutes
    exactly), so both forms give the same bits.
    """
    rows = 2 if pair else 4
    softmax_rows(c, eps, rows)
    sinkhorn_scaling(c, eps, repeat, pair)


@cute.jit
def softmax_rows(c: cute.Tensor, eps: Float32, rows: cutlass.Constexpr[int]):
    """``sinkhorn_4x4``'s first step on ``rows`` rows of 4 in ``c``: row softmax (max-subtracted) + eps."""
    for i in cutlass.range_constexpr(rows):
        row_max = cute.arch.fmax(cute.arch.fmax(c[4 * i], c[4 * i + 1]), cute.arch.fmax(c[4 * i + 2], c[4 * i + 3]))
        for k in cutlass.range_constexpr(4):
            c[4 * i + k] = cute.math.exp(c[4 * i + k] - row_max, fastmath=True)
        inv = cute.arch.rcp_approx((c[4 * i] + c[4 * i + 1]) + (c[4 * i + 2] + c[4 * i + 3]))
        for k in cutlass.range_constexpr(4):
            c[4 * i + k] = c[4 * i + k] * inv + eps


@cute.jit
def softmax_rows_by_lane(x: Float32, eps: Float32) -> Float32:
    """``softmax_rows`` with one element per lane (lanes 4 i .. 4 i + 3 of an aligned group of 16: row i), the row's
    max and sum crossing in two butterfly shuffles each: the same roundings (max is exact, and ``warp_sum`` pairs
    the sum as ``(c0 + c1) + (c2 + c3)``), so the same bits. 16 lanes take the 16 exponentials and 4 reciprocals that one lane
    would issue one after another."""
    row_max = cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=1))
    row_max = cute.arch.fmax(row_max, cute.arch.shuffle_sync_bfly(row_max, offset=2))
    p = cute.math.exp(x - row_max, fastmath=True)
    return p * cute.arch.rcp_approx(warp_sum(p, lanes=4)) + eps


@cute.jit
def sinkhorn_scaling(c: cute.Tensor, eps: Float32, repeat: Int32, pair: cutlass.Constexpr[bool] = False):
    """``sinkhorn_4x4`` after the softmax: the column step and ``repeat - 1`` (row, column) steps on the scaling
    vectors, then ``c = K_ij r_i s_j``."""
    rows = 2 if pair else 4
    # u, r: this lane's rows; v, s: all four columns
    scale = _SinkhornScales(cute.make_rmem_tensor((rows,), Float32), cute.make_rmem_tensor((rows,), Float32),
                            cute.make_rmem_tensor((4,), Float32), cute.make_rmem_tensor((4,), Float32))
    scale.u.fill(1.0)
    scale.r.fill(1.0)
    scale.v.fill(1.0)
    _column_step(c, scale, eps, pair)
    for _ in cutlass.range(repeat - 1, unroll=1):
        _row_step(c, scale, eps, rows)
        _column_step(c, scale, eps, pair)
    for i in cutlass.range_constexpr(rows):
        for k in cutlass.range_constexpr(4):
            c[4 * i + k] = (c[4 * i + k] * scale.r[i]) * scale.s[k]


class _SinkhornScales(NamedTuple):
    u: cute.Tensor  # 1 / r
    r: cute.Tensor  # row scales
    v: cute.Tensor  # 1 / s
    s: cute.Tensor  # column scales


@cute.jit
def _row_step(c: cute.Tensor, scale: _SinkhornScales, eps: Float32, rows: cutlass.Constexpr[int]):
    for i in cutlass.range_constexpr(rows):
        left = cute.math.fma(c[4 * i + 1], scale.s[1], cute.math.fma(c[4 * i], scale.s[0], eps * scale.u[i]))
        right = cute.math.fma(c[4 * i + 3], scale.s[3], c[4 * i + 2] * scale.s[2])
        scale.u[i] = left + right
        scale.r[i] = cute.arch.rcp_approx(scale.u[i])


@cute.jit
def _column_step(c: cute.Tensor, scale: _SinkhornScales, eps: Float32, pair: cutlass.Constexpr[bool]):
    for k in cutlass.range_constexpr(4):
        if cutlass.const_expr(pair):
            # rows 0-1 carry the eps term, rows 2-3 none (an fma with a zero addend rounds as the product alone)
            addend = Float32(cutlass.select_(cute.arch.lane_idx() % 2 == 0, eps * scale.v[k], Float32(0.0)))
            half = cute.math.fma(c[4 + k], scale.r[1], cute.math.fma(c[k], scale.r[0], addend))
            total = warp_sum(half, lanes=2)
        else:
            top = cute.math.fma(c[4 + k], scale.r[1], cute.math.fma(c[k], scale.r[0], eps * scale.v[k]))
            total = top + cute.math.fma(c[12 + k], scale.r[3], c[8 + k] * scale.r[2])
        scale.v[k] = total
        scale.s[k] = cute.arch.rcp_approx(total)


def post_element(post_j, x_e, comb_col, res_e) -> Float32:
    """SPEC step 1 for one element of output stream j, unrounded: ``post[j] * x``, then one FMA per source stream
    k = 0..3 in order, ``comb_col[k] = comb[k][j]`` weighing ``res_e[k]``. Every kernel's post-map (the seam paths,
    ``mhc_post``) runs this chain, so ``residual_cur`` has the same bits everywhere. Plain Python: call it from device
    code."""
    acc = post_j * x_e
    for k in range(len(res_e)):
        acc = cute.math.fma(comb_col[k], res_e[k], acc)
    return acc


@cute.jit
def sum_squares(v) -> Float32:
    """``v[0]^2 + ... + v[n-1]^2`` of a small fp32 vector: a product, then an FMA chain."""
    sq = v[0] * v[0]
    for e in cutlass.range_constexpr(1, v.shape[0]):
        sq = cute.math.fma(v[e], v[e], sq)
    return sq


@dsl_user_op
def tf32_rn(x: Float32, *, loc=None, ip=None) -> Int32:
    """The bits of ``x`` rounded to the nearest TF32 value, ties to even (``cvt.rn.tf32.f32``, sm_90): one
    instruction, NaN stays NaN and infinity infinity."""
    return Int32(nvvm.convert_float_to_tf32(Float32(x).ir_value(loc=loc, ip=ip), rnd=nvvm.FPRoundingMode.RN,
                                            loc=loc, ip=ip))


@cute.jit
def round_tf32(t: cute.Tensor):
    """Round every fp32 element of the register tensor ``t`` to the nearest TF32 value (10 explicit mantissa
    bits, ties to even; as ``mma.split_tf32`` does on the host), in place. The tensor cores read only a TF32
    operand's top 19 bits, so a value passed unrounded would be truncated."""
    bits = cute.recast_tensor(t, Int32)
    for i in cutlass.range_constexpr(cute.size(t)):
        bits[i] = tf32_rn(t[i])


@cute.jit
def split_tf32(w: cute.Tensor, hi: cute.Tensor, lo: cute.Tensor):
    """``hi = tf32_rn(w)``, ``lo = tf32_rn(w - hi)`` into the register tensors ``hi`` and ``lo`` (as ``mma.split_tf32``
    does on the host): ``lo`` is 0 where ``hi`` is infinite, so an infinite weight's products stay infinite."""
    hi.store(w.load())
    round_tf32(hi)
    hi_bits = cute.recast_tensor(hi, Int32)
    for i in cutlass.range_constexpr(cute.size(w)):
        lo[i] = Float32(cutlass.select_((hi_bits[i] & 0x7FFFFFFF) == 0x7F800000, Float32(0.0), w[i] - hi[i]))
    round_tf32(lo)


@cute.jit
def widen_bf16x8(frag: cute.Tensor):
    """The eight bf16 of the register tensor ``frag`` as an fp32 vector, exactly: per 32-bit pair the low half shifted
    up and the high half masked, two integer instructions where the conversion takes three."""
    pairs = cute.recast_tensor(frag, Int32)
    wide = cute.make_rmem_tensor((VEC_BF16,), Float32)
    bits = cute.recast_tensor(wide, Int32)
    for i in cutlass.range_constexpr(VEC_BF16 // 2):
        bits[2 * i] = pairs[i] << 16
        bits[2 * i + 1] = pairs[i] & Int32(-65536)  # 0xffff0000
    return wide.load()


@cute.jit
def load_bf16x8(src: cute.Tensor):
    """Eight contiguous bf16 (one 16-byte load; ``src`` must be 16-byte aligned) as an fp32 vector."""
    frag = cute.make_rmem_tensor((VEC_BF16,), BFloat16)
    cute.autovec_copy(src, frag)
    return widen_bf16x8(frag)


@cute.jit
def store_bf16x8(dst: cute.Tensor, vals):
    """Round eight fp32 to bf16 (nearest even) and store them with one 16-byte store; returns the rounded
    values widened back to fp32."""
    frag = cute.make_rmem_tensor((VEC_BF16,), BFloat16)
    frag.store(vals.to(BFloat16))
    cute.autovec_copy(frag, dst)
    return widen_bf16x8(frag)


@cute.jit
def load_f32x4(src: cute.Tensor):
    """Four contiguous fp32 (one 16-byte load; ``src`` must be 16-byte aligned)."""
    frag = cute.make_rmem_tensor((4,), Float32)
    cute.autovec_copy(src, frag)
    return frag.load()


@cute.jit
def collapse_term(j: cutlass.Constexpr[int], gate: Float32, value: Float32, acc):
    """Term ``j`` of the delayed seam's collapse with the carried gates (SPEC "V4.1: the delayed seam", step 3):
    ``gate * value`` for stream 0, then ``fma(gate, value, acc)``, the rounding order every path keeps."""
    return gate * value if cutlass.const_expr(j == 0) else cute.math.fma(gate, value, acc)
