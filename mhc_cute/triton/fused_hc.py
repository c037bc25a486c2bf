"""The ``"triton"`` backend: ``mhc_fused_hc`` as a main kernel and a reduce kernel (the ROCm gfx950
fusion's design), computing exactly the contract of ``docs/contract.md``.

Main kernel, grid (K splits, token blocks): SPEC step 1 (fp32 FMA chain, one bf16 rounding) for its tokens and
its H range of all 4 streams, the ``residual_cur`` store, and the split's share of steps 2-3 on the rounded
values: 24 fp32-accurate dot products and the sum of squares, written to partials ``[split_k, M, 32]``
(columns 0-23 the dots, column 24 the sum of squares). Small token blocks project with fp32 FMAs; blocks of 16+
tokens on tensor cores with ``fn`` split exactly into three bf16 terms (exact products, fp32 accumulation;
Triton's FFMA ``tl.dot`` is slow enough on Hopper to make the op compute bound). The split is
done once per weight tensor (``split_bf16x3``, cached by ``weights.prepared``), so the kernel loads the terms as
they are fed to the tensor cores. The K loop accumulates with compensation, so the mixes stay within ~1e-7 of
float64.

Reduce kernel, one program per token block: sums the partials over the splits in a fixed order, then RMS,
mixes, gates, Sinkhorn (steps 2-5), the collapse re-reading ``residual_cur`` (step 6) and the optional RMSNorm
(step 7).

The same two kernels run the entry forms and the delayed seam, chosen by compile-time flags: without a post the
main kernel projects ``residual_prev`` as it is (nothing stored); the broadcast entry stores the 4 copies of the
embedding and projects it over H with ``fn`` summed over the streams. The delayed seam's main kernel also writes
``x1`` (the collapse with the carried gates, an fp32 FMA chain over the rounded streams it already holds) to
``layer_input`` and, with the norm, its sum of squares to partials column 25; its reduce kernel writes the gates
(no collapse) and, with the norm, rescales ``layer_input`` in place (re-reading the bf16 ``x1``).

Nothing is accumulated with atomics, so repeated runs are bit-identical for a given tactic.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from ..problem import MhcFusedHcDelayedOutput, MhcFusedHcOutput, Problem
from ..reference import broadcast_fn
from ..weights import bf16_terms, broadcast_weight, prepared
from ..workspace import get_workspace
from ..tactics import PARTIAL_COLS
from .configs import TritonTactic, arch_of, fit, select_tactic

# Under Triton's CPU interpreter: fp32 -> bf16 casts truncate (its explicit RTNE mode rounds ties up), so the
# rounding is done on the bits there; and bf16 dots are not emulated, so their (exact) operands go in as fp32.
_INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def _bf16_rn(x):
    """Round fp32 to the nearest bf16, ties to even; infinities stay, NaN stays NaN."""
    if _INTERPRET:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        bits = tl.where(x == x, bits, 0x7FC0)  # a NaN's payload can carry into the sign bit
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(tl.bfloat16)


@triton.jit
def _token_col(ptr, rows, mask, stride: tl.constexpr, idx: tl.constexpr):
    """``ptr[rows, idx]`` of a row-major ``[M, stride]`` fp32 array, as a ``[BLOCK_M, 1]`` column."""
    return tl.load(ptr + rows * stride + idx, mask=mask, other=0.0)[:, None]


@triton.jit
def _load_inputs(x_ptr, res_ptr, x_row, res_row, h, mask, H):
    """One step's ``x_prev`` tile and the four ``residual_prev`` stream tiles at H positions ``h``, as fp32."""
    xf = tl.load(x_ptr + x_row + h, mask=mask, other=0.0).to(tl.float32)
    r0 = tl.load(res_ptr + res_row + h, mask=mask, other=0.0).to(tl.float32)
    r1 = tl.load(res_ptr + res_row + H + h, mask=mask, other=0.0).to(tl.float32)
    r2 = tl.load(res_ptr + res_row + 2 * H + h, mask=mask, other=0.0).to(tl.float32)
    r3 = tl.load(res_ptr + res_row + 3 * H + h, mask=mask, other=0.0).to(tl.float32)
    return xf, r0, r1, r2, r3


@triton.jit
def _post_coefficients(post_ptr, comb_ptr, rows, tok_mask):
    """SPEC step 1's coefficients of these tokens as ``[BLOCK_M, 1]`` columns: ``post[j]`` (4), then ``comb[k][j]``
    row-major (16)."""
    p0 = _token_col(post_ptr, rows, tok_mask, 4, 0)
    p1 = _token_col(post_ptr, rows, tok_mask, 4, 1)
    p2 = _token_col(post_ptr, rows, tok_mask, 4, 2)
    p3 = _token_col(post_ptr, rows, tok_mask, 4, 3)
    # comb[k][j] weighs source stream k into output stream j
    c00 = _token_col(comb_ptr, rows, tok_mask, 16, 0)
    c01 = _token_col(comb_ptr, rows, tok_mask, 16, 1)
    c02 = _token_col(comb_ptr, rows, tok_mask, 16, 2)
    c03 = _token_col(comb_ptr, rows, tok_mask, 16, 3)
    c10 = _token_col(comb_ptr, rows, tok_mask, 16, 4)
    c11 = _token_col(comb_ptr, rows, tok_mask, 16, 5)
    c12 = _token_col(comb_ptr, rows, tok_mask, 16, 6)
    c13 = _token_col(comb_ptr, rows, tok_mask, 16, 7)
    c20 = _token_col(comb_ptr, rows, tok_mask, 16, 8)
    c21 = _token_col(comb_ptr, rows, tok_mask, 16, 9)
    c22 = _token_col(comb_ptr, rows, tok_mask, 16, 10)
    c23 = _token_col(comb_ptr, rows, tok_mask, 16, 11)
    c30 = _token_col(comb_ptr, rows, tok_mask, 16, 12)
    c31 = _token_col(comb_ptr, rows, tok_mask, 16, 13)
    c32 = _token_col(comb_ptr, rows, tok_mask, 16, 14)
    c33 = _token_col(comb_ptr, rows, tok_mask, 16, 15)
    return (p0, p1, p2, p3, c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23, c30, c31, c32, c33)


@triton.jit
def _post_stream(xf, r0, r1, r2, r3, p, c0, c1, c2, c3):
    """SPEC step 1 for one output stream: ``post * x``, then one FMA per source stream k = 0..3, in order."""
    acc = p * xf
    acc = tl.fma(c0, r0, acc)
    acc = tl.fma(c1, r1, acc)
    acc = tl.fma(c2, r2, acc)
    acc = tl.fma(c3, r3, acc)
    return _bf16_rn(acc)


def split_bf16x3(fn: torch.Tensor, streams: int = 4) -> torch.Tensor:
    """``fn`` [24, 4H] fp32 as ``[3, 24, 4H]`` bf16 terms with ``fn = w1 + w2 + w3`` exactly (each term takes the
    next 8 significant bits, round to nearest; bf16 has fp32's exponent range, so this holds for every weight
    between about 2^-100 and bf16's largest finite value), so that ``a * w_i`` is exact in fp32 for bf16 ``a``;
    K reordered from ``j H + h`` to ``4 h + j`` (stream fastest), the order in which ``_interleave_streams`` lays
    out the four streams' tiles (``streams`` 1: the broadcast weight ``[24, H]``, K as it is)."""
    n_mix, k = fn.shape
    w = fn.float().view(n_mix, streams, k // streams).transpose(1, 2).reshape(n_mix, k)
    return torch.stack(bf16_terms(w)).contiguous()


@triton.jit
def _interleave_streams(o0, o1, o2, o3, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    """Four ``[BLOCK_M, BLOCK_H]`` stream tiles as one ``[BLOCK_M, 4 BLOCK_H]`` A operand, column ``4 h + j``."""
    o = tl.join(tl.join(o0, o2), tl.join(o1, o3))  # [..., h, p, q] = stream 2 p + q
    return tl.reshape(o, [BLOCK_M, 4 * BLOCK_H])


@triton.jit
def _dot_fp32_exact(a, w_ptr, w_offs, w_mask, part_stride, acc):
    """``acc + a @ fn_tile`` for bf16 ``a`` on tensor cores, as accurate as an fp32 dot: the tile's three exact
    bf16 terms (``split_bf16x3``, ``part_stride`` apart) make every product exact, and only the fp32
    accumulation rounds, smallest terms first."""
    w3 = tl.load(w_ptr + 2 * part_stride + w_offs, mask=w_mask, other=0.0)
    w2 = tl.load(w_ptr + part_stride + w_offs, mask=w_mask, other=0.0)
    w1 = tl.load(w_ptr + w_offs, mask=w_mask, other=0.0)
    if _INTERPRET:
        a = a.to(tl.float32)
        acc = tl.dot(a, w3.to(tl.float32), acc, input_precision="ieee")
        acc = tl.dot(a, w2.to(tl.float32), acc, input_precision="ieee")
        return tl.dot(a, w1.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, w3, acc)
        acc = tl.dot(a, w2, acc)
        return tl.dot(a, w1, acc)


@triton.jit
def _emit_stream(res_out_ptr, out_offs, mask, out, sq, acc, fn_ptr, fn_offs, fn_mask, USE_DOT: tl.constexpr,
                 STORE: tl.constexpr = True):
    """Store one rounded stream tile (``STORE``: not without a post) and add its row sums of squares (of the
    rounded values) to ``sq``. Small token blocks (not ``USE_DOT``) also project it here, with fp32 FMAs into
    ``[BLOCK_M, BLOCK_H, 32]`` products reduced over H once after the K loop (``fn`` read as a ``[BLOCK_H, 32]``
    tile, columns 24..31 masked to zero), so that only one stream tile is live at a time."""
    if STORE:
        tl.store(res_out_ptr + out_offs, out, mask=mask)
    rf = out.to(tl.float32)
    if not USE_DOT:
        w = tl.load(fn_ptr + fn_offs, mask=fn_mask, other=0.0)
        acc += rf[:, :, None] * w[None, :, :]
    return sq + tl.sum(rf * rf, axis=1), acc


@triton.jit
def _kahan_add(total, comp, value):
    """Compensated ``total + value``: the K loop adds hundreds of steps, and the gates need the mixes to about
    1e-7 relative (plain fp32 accumulation over K = 4H loses ~1e-6). A total that is no longer finite drops the
    compensation (which would be inf - inf, NaN): an infinite sum stays infinite, as IEEE addition has it."""
    y = value - comp
    t = total + y
    return t, tl.where(tl.abs(t) < float("inf"), (t - total) - y, 0.0)


# M and the loop counts are not specialised on (Triton would compile again for M == 1 or M % 16 == 0)
@triton.jit(do_not_specialize=["M", "blocks_per_split"])
def _main_kernel(
    x_ptr, res_ptr, post_ptr, comb_ptr, w_ptr, res_out_ptr, part_ptr, carried_ptr, li_ptr,
    M, H, blocks_per_split,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, USE_DOT: tl.constexpr,
    HAS_POST: tl.constexpr = True, BROADCAST: tl.constexpr = False, DELAYED: tl.constexpr = False,
    IDENTITY: tl.constexpr = False, HAS_NORM: tl.constexpr = False,
):
    # HAS_POST: SPEC step 1, else the streams are residual_prev as it is, or (BROADCAST) 4 copies of the embedding
    # residual_prev [M, H], projected over K = H. DELAYED: also x1, the collapse with the carried gates (IDENTITY:
    # stream 0), stored to layer_input, with its sum of squares in column 25 when the norm follows (HAS_NORM).
    pid_k = tl.program_id(0)
    pid_m = tl.program_id(1)
    tok = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    tok_mask = tok < M
    rows = tok.to(tl.int64)  # M * 4H can pass 2**31
    offs_h = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, 32)

    (p0, p1, p2, p3, c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23, c30, c31, c32,
     c33) = _post_coefficients(post_ptr, comb_ptr, rows, tok_mask)
    q0 = _token_col(carried_ptr, rows, tok_mask, 4, 0)
    q1 = _token_col(carried_ptr, rows, tok_mask, 4, 1)
    q2 = _token_col(carried_ptr, rows, tok_mask, 4, 2)
    q3 = _token_col(carried_ptr, rows, tok_mask, 4, 3)

    if USE_DOT:
        acc = tl.zeros([BLOCK_M, 32], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_H, 32], dtype=tl.float32)
    acc_comp = tl.zeros([BLOCK_M, 32], dtype=tl.float32)
    sq = tl.zeros([BLOCK_M], dtype=tl.float32)
    sq_comp = tl.zeros([BLOCK_M], dtype=tl.float32)
    x1_sq = tl.zeros([BLOCK_M], dtype=tl.float32)
    mask = tok_mask[:, None]
    w_mask = cols[None, :] < 24
    x_row = rows[:, None] * H
    res_row = rows[:, None] * (4 * H)
    if BROADCAST:
        if USE_DOT:
            # split_bf16x3 of the broadcast weight [24, H] as [BLOCK_H, 32] tiles
            part_stride = 24 * H
            w_base = cols[None, :] * H + offs_h[:, None]
        else:
            w_base = cols[None, :] * H + offs_h[:, None]
    elif USE_DOT:
        # the split_bf16x3 terms of fn as [4 BLOCK_H, 32] tiles, K = 4 h + j (K-major for the dot)
        part_stride = 24 * 4 * H
        w_base = cols[None, :] * (4 * H) + tl.arange(0, 4 * BLOCK_H)[:, None]
    else:
        # fn[c, j H + h] as [BLOCK_H, 32] tiles, one per stream
        w_base = cols[None, :] * (4 * H) + offs_h[:, None]

    block_begin = pid_k * blocks_per_split
    block_end = tl.minimum(block_begin + blocks_per_split, H // BLOCK_H)
    for hb in range(block_begin, block_end):
        h = hb * BLOCK_H + offs_h[None, :]
        step_sq = tl.zeros([BLOCK_M], dtype=tl.float32)
        fn_h = w_base + hb * BLOCK_H  # read by the FMA projection only

        if BROADCAST:
            # 4 equal streams: store the copies, project and square the embedding once (K = H)
            o0 = tl.load(res_ptr + x_row + h, mask=mask, other=0.0)
            o1 = o0
            o2 = o0
            o3 = o0
            tl.store(res_out_ptr + res_row + H + h, o0, mask=mask)
            tl.store(res_out_ptr + res_row + 2 * H + h, o0, mask=mask)
            tl.store(res_out_ptr + res_row + 3 * H + h, o0, mask=mask)
            step_sq, acc = _emit_stream(res_out_ptr, res_row + h, mask, o0, step_sq, acc, w_ptr, fn_h, w_mask,
                                        USE_DOT)
        else:
            if HAS_POST:
                xf, r0, r1, r2, r3 = _load_inputs(x_ptr, res_ptr, x_row, res_row, h, mask, H)
                o0 = _post_stream(xf, r0, r1, r2, r3, p0, c00, c10, c20, c30)
                o1 = _post_stream(xf, r0, r1, r2, r3, p1, c01, c11, c21, c31)
                o2 = _post_stream(xf, r0, r1, r2, r3, p2, c02, c12, c22, c32)
                o3 = _post_stream(xf, r0, r1, r2, r3, p3, c03, c13, c23, c33)
            else:
                o0 = tl.load(res_ptr + res_row + h, mask=mask, other=0.0)
                o1 = tl.load(res_ptr + res_row + H + h, mask=mask, other=0.0)
                o2 = tl.load(res_ptr + res_row + 2 * H + h, mask=mask, other=0.0)
                o3 = tl.load(res_ptr + res_row + 3 * H + h, mask=mask, other=0.0)
            step_sq, acc = _emit_stream(res_out_ptr, res_row + h, mask, o0, step_sq, acc, w_ptr, fn_h, w_mask,
                                        USE_DOT, HAS_POST)
            step_sq, acc = _emit_stream(res_out_ptr, res_row + H + h, mask, o1, step_sq, acc, w_ptr, fn_h + H,
                                        w_mask, USE_DOT, HAS_POST)
            step_sq, acc = _emit_stream(res_out_ptr, res_row + 2 * H + h, mask, o2, step_sq, acc, w_ptr,
                                        fn_h + 2 * H, w_mask, USE_DOT, HAS_POST)
            step_sq, acc = _emit_stream(res_out_ptr, res_row + 3 * H + h, mask, o3, step_sq, acc, w_ptr,
                                        fn_h + 3 * H, w_mask, USE_DOT, HAS_POST)
        if DELAYED and not IDENTITY:
            # the carried collapse before the projection, so that the four stream tiles are dead once its operand
            # is built (fewer registers: bench/probes/triton_registers.py; the identity's stream 0 is best stored
            # after it)
            x1_sq = _store_x1(o0, o1, o2, o3, q0, q1, q2, q3, li_ptr + x_row + h, mask, x1_sq, False, HAS_NORM)
        if USE_DOT:
            if BROADCAST:  # the embedding once, K = H
                step = _dot_fp32_exact(o0, w_ptr, fn_h, w_mask, part_stride, tl.zeros([BLOCK_M, 32], dtype=tl.float32))
            else:
                # one projection of the four streams per step (K = 4 BLOCK_H), summed into acc with compensation
                a = _interleave_streams(o0, o1, o2, o3, BLOCK_M, BLOCK_H)
                step = _dot_fp32_exact(a, w_ptr, w_base + hb * (4 * BLOCK_H), w_mask, part_stride,
                                       tl.zeros([BLOCK_M, 32], dtype=tl.float32))
            acc, acc_comp = _kahan_add(acc, acc_comp, step)
        sq, sq_comp = _kahan_add(sq, sq_comp, step_sq)
        if DELAYED and IDENTITY:
            x1_sq = _store_x1(o0, o1, o2, o3, q0, q1, q2, q3, li_ptr + x_row + h, mask, x1_sq, True, HAS_NORM)

    if not USE_DOT:
        acc = tl.sum(acc, axis=1)
    acc = tl.where(cols[None, :] == 24, sq[:, None], acc)
    if DELAYED and HAS_NORM:
        acc = tl.where(cols[None, :] == 25, x1_sq[:, None], acc)
    part_offs = (pid_k * M + rows[:, None]) * 32 + cols[None, :]
    tl.store(part_ptr + part_offs, acc, mask=mask)


@triton.jit
def _store_x1(o0, o1, o2, o3, q0, q1, q2, q3, ptrs, mask, x1_sq, IDENTITY: tl.constexpr, HAS_NORM: tl.constexpr):
    """The delayed seam's collapse of one step (``_collapse_carried``) stored to ``layer_input`` at ``ptrs``; returns
    ``x1_sq`` plus its rows' sums of squares of the rounded values when the norm follows."""
    x1 = _collapse_carried(o0, o1, o2, o3, q0, q1, q2, q3, IDENTITY)
    tl.store(ptrs, x1, mask=mask)
    if HAS_NORM:
        x1f = x1.to(tl.float32)
        x1_sq += tl.sum(x1f * x1f, axis=1)
    return x1_sq


@triton.jit
def _collapse_carried(o0, o1, o2, o3, q0, q1, q2, q3, IDENTITY: tl.constexpr):
    """The delayed seam's step 3 on one tile of the rounded streams: ``bf16(q0 r0)``, then one FMA per stream
    j = 1..3 in order, one rounding (the carried gates ``q``); ``IDENTITY``: stream 0 itself."""
    if IDENTITY:
        return o0
    else:
        acc = q0 * o0.to(tl.float32)
        acc = tl.fma(q1, o1.to(tl.float32), acc)
        acc = tl.fma(q2, o2.to(tl.float32), acc)
        acc = tl.fma(q3, o3.to(tl.float32), acc)
        return _bf16_rn(acc)


@triton.jit
def _split_sum(part_ptr, rows, tok_mask, M, split_k, S_POW2: tl.constexpr, COL0: tl.constexpr, N: tl.constexpr):
    """Partials columns ``COL0 .. COL0 + N - 1`` of these tokens summed over the splits (one tree reduction in a
    fixed order): ``[BLOCK_T, N]``."""
    s = tl.arange(0, S_POW2)[:, None, None]
    offs = (s * M + rows[None, :, None]) * 32 + COL0 + tl.arange(0, N)[None, None, :]
    mask = (s < split_k) & tok_mask[None, :, None]
    return tl.sum(tl.load(part_ptr + offs, mask=mask, other=0.0), axis=0)


@triton.jit
def _mixes(part_ptr, rows, tok_mask, M, split_k, rstd, scale, base_ptr,
           S_POW2: tl.constexpr, COL0: tl.constexpr, N: tl.constexpr):
    """SPEC step 3 for columns ``COL0 ..``: ``dot * rstd * hc_scale[group] + hc_base[c]``, ``[BLOCK_T, N]``."""
    dots = _split_sum(part_ptr, rows, tok_mask, M, split_k, S_POW2, COL0, N)
    return dots * rstd * scale + tl.load(base_ptr + COL0 + tl.arange(0, N))[None, :]


@triton.jit
def _columns4(v):
    """The four columns of a ``[BLOCK_T, 4]`` tile as ``[BLOCK_T]`` vectors."""
    even, odd = tl.split(tl.reshape(v, [v.shape[0], 2, 2]))  # columns (0, 2) and (1, 3)
    c0, c2 = tl.split(even)
    c1, c3 = tl.split(odd)
    return c0, c1, c2, c3


@triton.jit
def _normalize(c, eps, AXIS: tl.constexpr):
    """One Sinkhorn step over the rows (``AXIS`` 2) or the columns (1) of ``[BLOCK_T, 4, 4]``: ``x / (sum + eps)``."""
    return c / tl.expand_dims(tl.sum(c, axis=AXIS) + eps, AXIS)


@triton.jit(do_not_specialize=["M", "split_k", "sinkhorn_repeat"])
def _reduce_kernel(
    part_ptr, scale_ptr, base_ptr, res_cur_ptr, norm_ptr, post_out_ptr, comb_out_ptr, li_ptr, pre_out_ptr,
    M, H, split_k, sinkhorn_repeat,
    rms_eps, pre_eps, sinkhorn_eps, post_mult, norm_eps,
    S_POW2: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
    SINGLE_TILE: tl.constexpr, HAS_NORM: tl.constexpr,
    RMS_STREAMS: tl.constexpr = 4, DELAYED: tl.constexpr = False,
):
    # RMS_STREAMS: 4, or 1 for the broadcast entry (its projection and sum of squares ran over H). DELAYED: store
    # the pre gates (pre_mix_cur) instead of collapsing; the norm rescales the main kernel's x1 in place.
    # The main kernel writes token blocks in increasing order, so the last ones are the likeliest still in L2:
    # visit them first.
    tb = tl.num_programs(0) - 1 - tl.program_id(0)
    tok = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_mask = tok < M
    rows = tok.to(tl.int64)

    # Steps 2-5 on whole tiles (the 4 pre gates, the 4 post gates, the 4x4 comb matrix), not column by column:
    # a program's few tokens are shared by all its threads, and per-column scalar code ran on every thread (the
    # Sinkhorn alone kept the reduce kernel issue bound, at a third of the DRAM bandwidth, at H = 4096).
    # divisor 4H: RMS over all 4 streams; IEEE sqrt and division (the approximate rsqrt costs the gates ~1e-7)
    sumsq = _split_sum(part_ptr, rows, tok_mask, M, split_k, S_POW2, 24, 1)
    rstd = tl.math.div_rn(1.0, tl.math.sqrt_rn(sumsq / (RMS_STREAMS * H) + rms_eps))  # [BLOCK_T, 1]
    pre = tl.sigmoid(_mixes(part_ptr, rows, tok_mask, M, split_k, rstd, tl.load(scale_ptr), base_ptr,
                            S_POW2, 0, 4)) + pre_eps
    if DELAYED:
        tl.store(pre_out_ptr + rows[:, None] * 4 + tl.arange(0, 4)[None, :], pre, mask=tok_mask[:, None])
    g0, g1, g2, g3 = _columns4(pre)
    post = tl.sigmoid(_mixes(part_ptr, rows, tok_mask, M, split_k, rstd, tl.load(scale_ptr + 1), base_ptr,
                             S_POW2, 4, 4)) * post_mult
    col4 = tl.arange(0, 4)[None, :]
    tl.store(post_out_ptr + rows[:, None] * 4 + col4, post, mask=tok_mask[:, None])

    # Sinkhorn (SPEC step 5) on comb[r][c] = mixes[8 + 4r + c]: row softmax + eps, then columns, then
    # sinkhorn_repeat - 1 times rows and columns
    comb = tl.reshape(_mixes(part_ptr, rows, tok_mask, M, split_k, rstd, tl.load(scale_ptr + 2), base_ptr,
                             S_POW2, 8, 16), [BLOCK_T, 4, 4])
    comb = tl.exp(comb - tl.max(comb, axis=2)[:, :, None])
    comb = comb / tl.sum(comb, axis=2)[:, :, None] + sinkhorn_eps
    comb = _normalize(comb, sinkhorn_eps, 1)
    for _ in range(sinkhorn_repeat - 1):
        comb = _normalize(_normalize(comb, sinkhorn_eps, 2), sinkhorn_eps, 1)
    col16 = tl.arange(0, 16)[None, :]
    tl.store(comb_out_ptr + rows[:, None] * 16 + col16, tl.reshape(comb, [BLOCK_T, 16]), mask=tok_mask[:, None])

    if DELAYED:
        if HAS_NORM:
            # the RMSNorm of the main kernel's bf16 x1 (its sum of squares in column 25), in place
            _norm_in_place(li_ptr, norm_ptr, rows[:, None] * H, tok_mask, H, norm_eps,
                           _split_sum(part_ptr, rows, tok_mask, M, split_k, S_POW2, 25, 1), BLOCK_H)
    else:
        _collapse_rows(res_cur_ptr, norm_ptr, li_ptr, rows, tok_mask, H, g0[:, None], g1[:, None], g2[:, None],
                       g3[:, None], norm_eps, BLOCK_T, BLOCK_H, SINGLE_TILE, HAS_NORM)


@triton.jit
def _collapse_rows(res_cur_ptr, norm_ptr, li_ptr, rows, tok_mask, H, g0, g1, g2, g3, norm_eps,
                   BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, SINGLE_TILE: tl.constexpr, HAS_NORM: tl.constexpr):
    """SPEC steps 6-7 for the tokens ``rows`` (gates ``g0..g3``: ``[BLOCK_T, 1]``): the collapse of
    ``residual_cur`` into ``layer_input``, then the optional RMSNorm over the rounded values."""
    offs_h = tl.arange(0, BLOCK_H)[None, :]
    res_row = rows[:, None] * (4 * H)
    li_row = rows[:, None] * H
    if SINGLE_TILE:
        # the whole row fits one tile: keep it in registers for the norm
        mask = tok_mask[:, None] & (offs_h < H)
        li = _collapse_tile(res_cur_ptr, res_row, offs_h, H, mask, g0, g1, g2, g3)
        if HAS_NORM:
            li = _rms_norm(li, tl.sum(li * li, axis=1)[:, None], norm_ptr, offs_h, mask, H, norm_eps)
        tl.store(li_ptr + li_row + offs_h, _bf16_rn(li), mask=mask)
    else:
        li_sq = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            h = h0 + offs_h
            mask = tok_mask[:, None] & (h < H)
            li = _collapse_tile(res_cur_ptr, res_row, h, H, mask, g0, g1, g2, g3)
            li_sq += li * li
            tl.store(li_ptr + li_row + h, _bf16_rn(li), mask=mask)
        if HAS_NORM:
            # second pass over the rounded values just stored (L1/L2 hot); the barrier orders them for the block
            tl.debug_barrier()
            _norm_in_place(li_ptr, norm_ptr, li_row, tok_mask, H, norm_eps, tl.sum(li_sq, axis=1)[:, None], BLOCK_H)


@triton.jit
def _norm_in_place(li_ptr, norm_ptr, li_row, tok_mask, H, norm_eps, sumsq, BLOCK_H: tl.constexpr):
    """SPEC step 7 over the bf16 rows already stored in ``layer_input`` (their sums of squares ``sumsq``,
    ``[BLOCK_T, 1]``), rewritten in place tile by tile."""
    offs_h = tl.arange(0, BLOCK_H)[None, :]
    for h0 in range(0, H, BLOCK_H):
        h = h0 + offs_h
        mask = tok_mask[:, None] & (h < H)
        li = tl.load(li_ptr + li_row + h, mask=mask, other=0.0).to(tl.float32)
        tl.store(li_ptr + li_row + h, _bf16_rn(_rms_norm(li, sumsq, norm_ptr, h, mask, H, norm_eps)), mask=mask)


@triton.jit
def _collapse_tile(res_cur_ptr, res_row, h, H, mask, g0, g1, g2, g3):
    """SPEC step 6 on one tile: ``sum_j pre[j] * residual_cur[j]`` in order j = 0..3, rounded to bf16 (returned
    as the fp32 value of that bf16)."""
    acc = g0 * tl.load(res_cur_ptr + res_row + h, mask=mask, other=0.0).to(tl.float32)
    acc += g1 * tl.load(res_cur_ptr + res_row + H + h, mask=mask, other=0.0).to(tl.float32)
    acc += g2 * tl.load(res_cur_ptr + res_row + 2 * H + h, mask=mask, other=0.0).to(tl.float32)
    acc += g3 * tl.load(res_cur_ptr + res_row + 3 * H + h, mask=mask, other=0.0).to(tl.float32)
    return _bf16_rn(acc).to(tl.float32)


@triton.jit
def _rms_norm(li, sumsq, norm_ptr, h, mask, H, norm_eps):
    """SPEC step 7 on the bf16-rounded collapse: ``li * rsqrt(mean(li^2) + eps) * w``."""
    r = tl.rsqrt(sumsq / H + norm_eps)
    w = tl.load(norm_ptr + h, mask=mask, other=0.0).to(tl.float32)
    return li * r * w


@functools.lru_cache(maxsize=None)
def device_key(device: torch.device) -> tuple[str, int]:
    """(architecture, compute units) of ``device``; the CPU interpreter counts as an unknown 4-CU device."""
    if device.type != "cuda":
        return "interpreter", 4
    props = torch.cuda.get_device_properties(device)
    return arch_of(props), props.multi_processor_count


@functools.lru_cache(maxsize=4096)
def _default_tactic(device: torch.device, m: int, hidden: int) -> TritonTactic:
    arch, cus = device_key(device)
    return select_tactic(arch, cus, m, hidden)


def _weight(problem: Problem, t: TritonTactic) -> torch.Tensor:
    """``fn`` as the main kernel reads it: bf16 terms (tensor-core tactics) or fp32; over H for the broadcast entry."""
    if problem.broadcast:
        if t.uses_dot:
            return prepared(problem.fn, "triton_bf16x3_broadcast", lambda fn: split_bf16x3(broadcast_fn(fn), 1))
        return broadcast_weight(problem.fn)
    return prepared(problem.fn, "triton_bf16x3", split_bf16x3) if t.uses_dot else problem.fn


def _rows(t, b, e):
    return None if t is None else t[b:e]


def prepare(problem: Problem, tactic: TritonTactic | None, out: MhcFusedHcOutput):
    """Backend entry (see ``mhc_cute.backends``), for both seams and every form: a ``launch(inputs, out)`` that runs
    the main kernel, then the reduce kernel (per chunk of tokens when the tactic says so)."""
    m, h = problem.m, problem.hidden
    dev = problem.residual.device
    t = _default_tactic(dev, m, h) if tactic is None else fit(tactic, h)
    chunk = t.chunk_m or m
    n_partials = t.split_k * min(chunk, m) * PARTIAL_COLS
    scalars, precision, delayed = problem.scalars, problem.precision, problem.delayed
    kind = MhcFusedHcDelayedOutput if delayed else MhcFusedHcOutput

    def launch(inputs, out):
        call = Problem(*inputs[:8], scalars, precision, inputs[8], delayed)
        out = kind(*out)  # named fields for _launch (a caller may pass a plain sequence)
        part = get_workspace(dev).partials(n_partials)
        weight = _weight(call, t)
        for b in range(0, m, chunk):
            e = min(b + chunk, m)
            whole = b == 0 and e == m
            rows = call if whole else call._replace(
                x=_rows(call.x, b, e), residual=call.residual[b:e], post_mix=_rows(call.post_mix, b, e),
                comb_mix=_rows(call.comb_mix, b, e), pre_mix=_rows(call.pre_mix, b, e))
            _launch(rows, weight, out if whole else type(out)(*(_rows(o, b, e) for o in out)), part, t)
    return launch


def _launch(problem: Problem, weight, out, part, t: TritonTactic):
    """One main + reduce launch over ``problem``'s tokens; ``weight`` from ``_weight``."""
    m, h = problem.m, problem.hidden
    res = problem.residual  # stands in for the pointers a form does not read
    delayed = problem.delayed
    norm = problem.norm_weight
    blocks_per_split = -(-(h // t.block_h) // t.split_k)
    _main_kernel[(t.split_k, triton.cdiv(m, t.block_m))](
        res if problem.x is None else problem.x, res,
        res if problem.post_mix is None else problem.post_mix, res if problem.comb_mix is None else problem.comb_mix,
        weight, res if out.residual_cur is None else out.residual_cur, part,
        res if problem.pre_mix is None else problem.pre_mix, out.layer_input,
        m, h, blocks_per_split,
        BLOCK_M=t.block_m, BLOCK_H=t.block_h, USE_DOT=t.uses_dot,
        HAS_POST=problem.x is not None, BROADCAST=problem.broadcast, DELAYED=delayed,
        IDENTITY=problem.pre_mix is None, HAS_NORM=norm is not None,
        num_warps=t.num_warps, num_stages=t.num_stages,
    )
    s = problem.scalars
    _reduce_kernel[(triton.cdiv(m, t.reduce_block_t),)](
        part, problem.hc_scale, problem.hc_base, res if out.residual_cur is None else out.residual_cur,
        res if norm is None else norm, out.post_mix_cur, out.comb_mix_cur, out.layer_input,
        out.pre_mix_cur if delayed else out.post_mix_cur,
        m, h, t.split_k, s.sinkhorn_repeat,
        s.rms_eps, s.hc_pre_eps, s.hc_sinkhorn_eps, s.hc_post_mult_value, s.norm_eps,
        S_POW2=triton.next_power_of_2(t.split_k), BLOCK_T=t.reduce_block_t, BLOCK_H=t.reduce_block_h,
        SINGLE_TILE=t.reduce_block_h >= h, HAS_NORM=norm is not None,
        RMS_STREAMS=1 if problem.broadcast else 4, DELAYED=delayed,
        num_warps=t.reduce_warps,
    )
