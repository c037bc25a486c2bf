"""The standalone ops on Triton (``mhc_cute.ops``): ``mhc_post``, ``mhc_collapse``, ``mhc_head``.

Each is one kernel built from the seam kernel's pieces (``fused_hc``): the post-map (``_post_coefficients``,
``_load_inputs``, ``_post_stream``: the same instructions, so the same bits), the collapse and norm
(``_collapse_rows``). ``mhc_post`` tiles (tokens, H) and streams; ``mhc_collapse`` runs one token block per
program over its rows; ``mhc_head`` projects a token block's 4H values on the 4 head columns with fp32 FMAs (an
elementwise accumulator per column, summed once at the end) with the sum of squares, forms the gates and then
collapses re-reading the rows (L1/L2 hot).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..workspace import get_workspace
from .fused_hc import _collapse_rows, _load_inputs, _post_coefficients, _post_stream, _token_col

POST_BLOCK_M = 2
POST_BLOCK_H = 512
ROW_BLOCK_H = 1024  # the H tile of the collapse and the head when the row does not fit one tile
SINGLE_TILE_MAX_H = 8192  # a collapse row up to this size is one tile kept in registers (8 warps)


@triton.jit(do_not_specialize=["M"])
def _post_kernel(x_ptr, res_ptr, post_ptr, comb_ptr, out_ptr, M, H,
                 BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    tok = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    tok_mask = tok < M
    rows = tok.to(tl.int64)  # M * 4H can pass 2**31
    (p0, p1, p2, p3, c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23, c30, c31, c32,
     c33) = _post_coefficients(post_ptr, comb_ptr, rows, tok_mask)
    h = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)[None, :]
    mask = tok_mask[:, None] & (h < H)
    res_row = rows[:, None] * (4 * H)
    xf, r0, r1, r2, r3 = _load_inputs(x_ptr, res_ptr, rows[:, None] * H, res_row, h, mask, H)
    tl.store(out_ptr + res_row + h, _post_stream(xf, r0, r1, r2, r3, p0, c00, c10, c20, c30), mask=mask)
    tl.store(out_ptr + res_row + H + h, _post_stream(xf, r0, r1, r2, r3, p1, c01, c11, c21, c31), mask=mask)
    tl.store(out_ptr + res_row + 2 * H + h, _post_stream(xf, r0, r1, r2, r3, p2, c02, c12, c22, c32), mask=mask)
    tl.store(out_ptr + res_row + 3 * H + h, _post_stream(xf, r0, r1, r2, r3, p3, c03, c13, c23, c33), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _collapse_kernel(res_ptr, pre_ptr, norm_ptr, out_ptr, M, H, norm_eps,
                     BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, SINGLE_TILE: tl.constexpr,
                     HAS_NORM: tl.constexpr):
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_mask = tok < M
    rows = tok.to(tl.int64)
    g0 = _token_col(pre_ptr, rows, tok_mask, 4, 0)
    g1 = _token_col(pre_ptr, rows, tok_mask, 4, 1)
    g2 = _token_col(pre_ptr, rows, tok_mask, 4, 2)
    g3 = _token_col(pre_ptr, rows, tok_mask, 4, 3)
    _collapse_rows(res_ptr, norm_ptr, out_ptr, rows, tok_mask, H, g0, g1, g2, g3, norm_eps, BLOCK_T, BLOCK_H,
                   SINGLE_TILE, HAS_NORM)


@triton.jit
def _head_gate(dot, rstd, scale, base_ptr, c: tl.constexpr, hc_eps):
    """``sigmoid(dot * rstd * head_scale + head_base[c]) + hc_eps`` (``dot``: ``[BLOCK_T, 1]``)."""
    return tl.sigmoid(dot * rstd * scale + tl.load(base_ptr + c)) + hc_eps


@triton.jit(do_not_specialize=["M"])
def _head_partials_kernel(res_ptr, fn_ptr, part_ptr, M, H, CHUNK_H,
                          BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """Program (token block, H chunk): the 4 head columns' dot products and the sum of squares over the chunk's
    ``4 x CHUNK_H`` values of each token (elementwise fp32 accumulators, summed once), written to
    ``partials [chunks, M, 5]``; the chunks split H so that a few tokens still spread over the SMs."""
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_mask = tok < M
    rows = tok.to(tl.int64)
    res_row = rows[:, None] * (4 * H)
    offs_h = tl.arange(0, BLOCK_H)[None, :]
    d0 = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    d1 = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    d2 = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    d3 = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    sq = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    K = 4 * H
    chunk = tl.program_id(1)
    lo = chunk * CHUNK_H
    for h0 in range(lo, tl.minimum(lo + CHUNK_H, H), BLOCK_H):
        h = h0 + offs_h
        w_mask = (h < H) & (h < lo + CHUNK_H)
        mask = tok_mask[:, None] & w_mask
        for j in tl.static_range(4):
            r = tl.load(res_ptr + res_row + j * H + h, mask=mask, other=0.0).to(tl.float32)
            sq += r * r
            d0 += r * tl.load(fn_ptr + j * H + h, mask=w_mask, other=0.0)
            d1 += r * tl.load(fn_ptr + K + j * H + h, mask=w_mask, other=0.0)
            d2 += r * tl.load(fn_ptr + 2 * K + j * H + h, mask=w_mask, other=0.0)
            d3 += r * tl.load(fn_ptr + 3 * K + j * H + h, mask=w_mask, other=0.0)
    out = part_ptr + (chunk.to(tl.int64) * M + rows) * 5
    tl.store(out, tl.sum(d0, axis=1), mask=tok_mask)
    tl.store(out + 1, tl.sum(d1, axis=1), mask=tok_mask)
    tl.store(out + 2, tl.sum(d2, axis=1), mask=tok_mask)
    tl.store(out + 3, tl.sum(d3, axis=1), mask=tok_mask)
    tl.store(out + 4, tl.sum(sq, axis=1), mask=tok_mask)


@triton.jit(do_not_specialize=["M"])
def _head_collapse_kernel(res_ptr, part_ptr, scale_ptr, base_ptr, norm_ptr, out_ptr, M, H, CHUNKS, rms_eps, hc_eps,
                          norm_eps, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, SINGLE_TILE: tl.constexpr,
                          HAS_NORM: tl.constexpr):
    """Program (token block): the partials summed over the chunks in order, the gates, then the collapse (and norm)
    of the token block's rows."""
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_mask = tok < M
    rows = tok.to(tl.int64)
    s0 = tl.zeros([BLOCK_T], dtype=tl.float32)
    s1 = tl.zeros([BLOCK_T], dtype=tl.float32)
    s2 = tl.zeros([BLOCK_T], dtype=tl.float32)
    s3 = tl.zeros([BLOCK_T], dtype=tl.float32)
    sq = tl.zeros([BLOCK_T], dtype=tl.float32)
    for c in range(0, CHUNKS):
        p = part_ptr + (c * M + rows) * 5
        s0 += tl.load(p, mask=tok_mask, other=0.0)
        s1 += tl.load(p + 1, mask=tok_mask, other=0.0)
        s2 += tl.load(p + 2, mask=tok_mask, other=0.0)
        s3 += tl.load(p + 3, mask=tok_mask, other=0.0)
        sq += tl.load(p + 4, mask=tok_mask, other=0.0)
    # SPEC step 2's divisor 4H; IEEE sqrt and division, as the seam's reduce kernel
    rstd = tl.math.div_rn(1.0, tl.math.sqrt_rn(sq[:, None] / (4 * H) + rms_eps))
    scale = tl.load(scale_ptr)
    g0 = _head_gate(s0[:, None], rstd, scale, base_ptr, 0, hc_eps)
    g1 = _head_gate(s1[:, None], rstd, scale, base_ptr, 1, hc_eps)
    g2 = _head_gate(s2[:, None], rstd, scale, base_ptr, 2, hc_eps)
    g3 = _head_gate(s3[:, None], rstd, scale, base_ptr, 3, hc_eps)
    _collapse_rows(res_ptr, norm_ptr, out_ptr, rows, tok_mask, H, g0, g1, g2, g3, norm_eps, BLOCK_T, BLOCK_H,
                   SINGLE_TILE, HAS_NORM)


def run_post(x, residual, post_mix, comb_mix, out) -> None:
    m, h = x.shape
    block_h = min(POST_BLOCK_H, triton.next_power_of_2(h))
    _post_kernel[(triton.cdiv(h, block_h), triton.cdiv(m, POST_BLOCK_M))](
        x, residual, post_mix, comb_mix, out, m, h, BLOCK_M=POST_BLOCK_M, BLOCK_H=block_h, num_warps=4)


def _row_tiling(h: int) -> tuple[int, bool, int]:
    """(BLOCK_H, SINGLE_TILE, num_warps) of a one-token program over a row of ``h``."""
    if h <= SINGLE_TILE_MAX_H:
        block_h = triton.next_power_of_2(h)
        return block_h, True, max(1, min(8, block_h // 512))
    return ROW_BLOCK_H, False, 4


def run_collapse(residual, pre_mix, norm_weight, norm_eps, out) -> None:
    m, _, h = residual.shape
    block_h, single, warps = _row_tiling(h)
    _collapse_kernel[(m,)](
        residual, pre_mix, residual if norm_weight is None else norm_weight, out, m, h, norm_eps,
        BLOCK_T=1, BLOCK_H=block_h, SINGLE_TILE=single, HAS_NORM=norm_weight is not None, num_warps=warps)


HEAD_TARGET_PROGRAMS = 256  # partial programs to aim for (about two per SM on a Hopper)
HEAD_MIN_CHUNK_H = 256  # an H chunk below this spends more on partials than it gains in spread
HEAD_BLOCK_T = 8  # tokens per partial program once M alone fills the GPU: the head weight is read once per block


def head_split(m: int, h: int) -> tuple[int, int, int]:
    """(tokens per partial program, chunk of H per program, chunks): few tokens split H over the SMs, many tokens take
    a block each so that the weight's loads serve several tokens."""
    block_t = 1 if m < HEAD_TARGET_PROGRAMS else HEAD_BLOCK_T
    blocks = triton.cdiv(m, block_t)
    chunks = max(1, min(triton.cdiv(h, HEAD_MIN_CHUNK_H), HEAD_TARGET_PROGRAMS // blocks))
    chunk_h = triton.cdiv(triton.cdiv(h, chunks), 64) * 64
    return block_t, chunk_h, triton.cdiv(h, chunk_h)


def run_head(residual, head_fn, head_scale, head_base, norm_weight, rms_eps, hc_eps, norm_eps, out) -> None:
    m, _, h = residual.shape
    block_t, chunk_h, chunks = head_split(m, h)
    part = get_workspace(residual.device).partials(chunks * m * 5)
    block_h = min(triton.next_power_of_2(chunk_h), 1024 // block_t)
    _head_partials_kernel[(triton.cdiv(m, block_t), chunks)](
        residual, head_fn, part, m, h, chunk_h, BLOCK_T=block_t, BLOCK_H=block_h, num_warps=4)
    row_h, single, warps = _row_tiling(h)
    _head_collapse_kernel[(m,)](
        residual, part, head_scale, head_base, residual if norm_weight is None else norm_weight, out,
        m, h, chunks, rms_eps, hc_eps, norm_eps,
        BLOCK_T=1, BLOCK_H=row_h, SINGLE_TILE=single, HAS_NORM=norm_weight is not None, num_warps=warps)
