"""Device helpers shared by every CuTe kernel path: reductions, gates, the 4x4 Sinkhorn, bf16 vectors.

All are ``@cute.jit`` functions, inlined into the calling kernel.
"""

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import BFloat16, Float32, Int32  # noqa: E402

WARP = 32
VEC_BF16 = 8  # bf16 elements in one 16-byte access


def row_major(*shape):
    """A compact row-major layout (CuTe's default is column-major): the last mode is contiguous. The first extent
    may be dynamic (a token count)."""
    strides, step = [1], 1
    for extent in reversed(shape[1:]):
        step *= extent
        strides.append(step)
    return cute.make_layout(shape, stride=tuple(reversed(strides)))


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
def block_sum(val: Float32, scratch: cute.Tensor, n_warps: cutlass.Constexpr[int]) -> Float32:
    """Sum over all threads of the CTA; every thread gets the result.

    ``scratch``: ``n_warps`` fp32 in shared memory. Two barriers: the scratch is free again on return.
    """
    val = warp_sum(val)
    lane, warp = cute.arch.lane_idx(), cute.arch.warp_idx()
    if lane == 0:
        scratch[warp] = val
    cute.arch.sync_threads()
    total = Float32(0.0)
    for w in cutlass.range_constexpr(n_warps):  # the same order in every thread
        total = total + scratch[w]
    cute.arch.sync_threads()
    return total


@cute.jit
def sigmoid(x: Float32) -> Float32:
    """Accurate to about an ulp (full-precision exp and division): the gates feed the collapse directly."""
    return Float32(1.0) / (Float32(1.0) + cute.math.exp(-x))


@cute.jit
def sinkhorn_4x4(c: cute.Tensor, eps: Float32, repeat: Int32, pair: cutlass.Constexpr[bool] = False):
    """SPEC step 5 in place on ``c``: 16 fp32 registers in row-major order (one thread per token), or with ``pair``
    the 8 of rows 0-1 (even lane) or rows 2-3 (odd lane, ``lane ^ 1``: two lanes per token).

    Row softmax (max-subtracted) + eps, a column step, then ``repeat - 1`` (row, column) steps; each step
    divides by (sum + eps) through one reciprocal per row or column. A column sum is ``(c0 + c1) + (c2 + c3)``
    either way (with ``pair`` each lane sums its half and the halves cross in one shuffle; fp32 addition
    commutes exactly), so both forms give the same bits. The one-lane chain is issue bound
    (``bench/probe_sinkhorn.py``): the pair issues about a third fewer instructions per lane.
    """
    rows = 2 if pair else 4
    for r in cutlass.range_constexpr(rows):
        row_max = cute.arch.fmax(cute.arch.fmax(c[4 * r], c[4 * r + 1]), cute.arch.fmax(c[4 * r + 2], c[4 * r + 3]))
        for k in cutlass.range_constexpr(4):
            c[4 * r + k] = cute.math.exp(c[4 * r + k] - row_max, fastmath=True)
        inv = cute.arch.rcp_approx((c[4 * r] + c[4 * r + 1]) + (c[4 * r + 2] + c[4 * r + 3]))
        for k in cutlass.range_constexpr(4):
            c[4 * r + k] = c[4 * r + k] * inv + eps
    _normalise_columns(c, eps, pair)
    for _ in cutlass.range(repeat - 1, unroll=1):
        _normalise_rows(c, eps, rows)
        _normalise_columns(c, eps, pair)


@cute.jit
def _normalise_rows(c: cute.Tensor, eps: Float32, rows: cutlass.Constexpr[int]):
    for r in cutlass.range_constexpr(rows):
        inv = cute.arch.rcp_approx(((c[4 * r] + c[4 * r + 1]) + (c[4 * r + 2] + c[4 * r + 3])) + eps)
        for k in cutlass.range_constexpr(4):
            c[4 * r + k] = c[4 * r + k] * inv


@cute.jit
def _normalise_columns(c: cute.Tensor, eps: Float32, pair: cutlass.Constexpr[bool]):
    for k in cutlass.range_constexpr(4):
        if cutlass.const_expr(pair):
            half = c[k] + c[4 + k]
            total = half + cute.arch.shuffle_sync_bfly(half, offset=1)
        else:
            total = (c[k] + c[4 + k]) + (c[8 + k] + c[12 + k])
        inv = cute.arch.rcp_approx(total + eps)
        for r in cutlass.range_constexpr(2 if pair else 4):
            c[4 * r + k] = c[4 * r + k] * inv


@cute.jit
def sum_squares(v) -> Float32:
    """``v[0]^2 + ... + v[n-1]^2`` of a small fp32 vector: a product, then an FMA chain."""
    sq = v[0] * v[0]
    for e in cutlass.range_constexpr(1, v.shape[0]):
        sq = cute.math.fma(v[e], v[e], sq)
    return sq


@cute.jit
def round_tf32(t: cute.Tensor):
    """Round every fp32 element of the register tensor ``t`` to the nearest TF32 value (10 explicit mantissa
    bits, ties to even; as ``mma.split_tf32`` does on the host), in place. The tensor cores read only a TF32
    operand's top 19 bits, so a value passed unrounded would be truncated."""
    bits = cute.recast_tensor(t, Int32)
    for i in cutlass.range_constexpr(cute.size(t)):
        b = bits[i]
        bits[i] = (b + 0xFFF + ((b >> 13) & 1)) & -0x2000


@cute.jit
def load_bf16x8(src: cute.Tensor):
    """Eight contiguous bf16 (one 16-byte load; ``src`` must be 16-byte aligned) as an fp32 vector."""
    frag = cute.make_rmem_tensor((VEC_BF16,), BFloat16)
    cute.autovec_copy(src, frag)
    return frag.load().to(Float32)


@cute.jit
def store_bf16x8(dst: cute.Tensor, vals):
    """Round eight fp32 to bf16 (nearest even) and store them with one 16-byte store; returns the rounded
    values widened back to fp32."""
    frag = cute.make_rmem_tensor((VEC_BF16,), BFloat16)
    frag.store(vals.to(BFloat16))
    cute.autovec_copy(frag, dst)
    return frag.load().to(Float32)


@cute.jit
def load_f32x4(src: cute.Tensor):
    """Four contiguous fp32 (one 16-byte load; ``src`` must be 16-byte aligned)."""
    frag = cute.make_rmem_tensor((4,), Float32)
    cute.autovec_copy(src, frag)
    return frag.load()
