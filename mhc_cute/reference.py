"""The numerical contract of ``docs/contract.md`` in plain torch.

Every backend is tested against these functions. They run on any device and compute either in float32 (the
``"torch"`` backend) or in float64 (the test reference). Rounding points are explicit:

* step 1 (post) is always evaluated as the SPEC's fp32 FMA chain, bit-exactly, whatever ``compute_dtype`` is,
  because ``residual_cur`` is an output that every backend must reproduce bit-for-bit;
* steps 2-7 run in ``compute_dtype`` on the bf16-rounded ``residual_cur`` (the projection's dot products in float64,
  rounded to ``compute_dtype``, so that no matmul setting of the caller's lowers them);
* ``layer_input`` is rounded to bf16 after the collapse (step 6) and, with a norm weight, again after step 7.

Shapes here are the flattened ones: ``x [M, H]``, ``residual [M, 4, H]``, ``post_mix [M, 4]``,
``comb_mix [M, 4, 4]``, ``fn [24, 4H]``, ``hc_scale [3]``, ``hc_base [24]``, ``norm_weight [H]``, ``pre_mix [M, 4]``.
The entry forms of both seams (SPEC "The op family"): no post (``x``, ``post_mix``, ``comb_mix`` None: the streams
are ``residual`` as it is) and broadcast entry (``residual [M, H]``, no post: the streams are 4 copies of it, the
projection runs over H with ``broadcast_fn(fn)``).

The delayed seam (SPEC "V4.1"): ``fused_hc_delayed``. Its collapse with the carried gates (step 3) is an fp32 FMA
chain like step 1, so its bf16 ``x1`` (``layer_input`` without a norm) is exact whatever ``compute_dtype`` is.

The standalone ops (SPEC "The op family"): ``post`` (``mhc_post``), ``head`` (``mhc_head``) and ``collapse_norm``
(``mhc_collapse``).
"""

from __future__ import annotations

import torch

HC_MULT = 4
N_MIXES = 2 * HC_MULT + HC_MULT * HC_MULT  # 24: pre(4), post(4), comb(16)


ROW_CHUNK_ELEMENTS = 1 << 24  # stream elements ([rows, 4, H]) per chunk of the torch backend (``row_chunks``)


def row_chunks(m: int, hidden: int, elements: int | None = None) -> list[slice]:
    """The row slices the ``"torch"`` backend runs a call of ``m`` tokens in (every op is per token, so the rows of
    a chunk come out as in one call): at most ``elements`` (default ``ROW_CHUNK_ELEMENTS``) stream elements each, so
    that its float64 temporaries (the FMA emulation's, the projection's) take about 128 MiB each whatever M, not
    12 GiB each at M = 10^5, H = 4096. The float64 checks of ``accuracy`` walk the rows the same way."""
    rows = max(1, (ROW_CHUNK_ELEMENTS if elements is None else elements) // (HC_MULT * hidden))
    return [slice(b, b + rows) for b in range(0, m, rows)]


def fma_f32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 ``a * b + c`` (one rounding), as the GPU's FFMA computes it.

    torch has no fused multiply-add, so it is emulated: the product of two fp32 values is exact in float64, the
    sum is formed in float64 with its exact error (TwoSum), and the float64 result is made round-to-odd before
    the final rounding to fp32. Round-to-odd at 53 bits followed by round-to-nearest at 24 bits equals a single
    round-to-nearest (Boldo and Melquiond), so there is no double-rounding error.
    """
    p = a.double() * b.double()
    c64 = c.double()
    s = p + c64
    bv = s - p
    err = (p - (s - bv)) + (c64 - bv)
    even = (s.view(torch.int64) & 1) == 0
    toward = torch.where(err > 0, torch.full_like(s, float("inf")), torch.full_like(s, float("-inf")))
    s = torch.where((err != 0) & even, torch.nextafter(s, toward), s)
    return s.float()


def post(x: torch.Tensor, residual: torch.Tensor, post_mix: torch.Tensor, comb_mix: torch.Tensor) -> torch.Tensor:
    """SPEC step 1: ``residual_cur[j][h] = bf16(fma-chain(post[j] * x[h], comb[k][j] * res[k][h], k = 0..3))``."""
    xf = x.float()[:, None, :]
    acc = post_mix.float()[:, :, None] * xf  # [M, 4 (j), H], one fp32 rounding
    for k in range(HC_MULT):
        # row k of comb is the *source* stream: comb[k][j] weights res[k] into stream j
        acc = fma_f32(comb_mix.float()[:, k, :, None], residual[:, k, None, :].float(), acc)
    return acc.to(torch.bfloat16)


def broadcast_fn(fn: torch.Tensor) -> torch.Tensor:
    """``fn_b [24, H]``: ``fn [24, 4H]`` summed over the 4 streams in fp32, in order j = 0..3 (the weight of the
    broadcast entry, whose 4 streams are equal)."""
    f = fn.float().reshape(fn.shape[0], HC_MULT, -1)
    return ((f[:, 0] + f[:, 1]) + f[:, 2]) + f[:, 3]


def streams(x, residual, post_mix, comb_mix) -> torch.Tensor:
    """``residual_cur [M, 4, H]`` of any seam form: step 1 (post), else ``residual`` itself (no post), else
    4 copies of the embedding ``residual [M, H]`` (broadcast entry)."""
    if x is not None:
        return post(x, residual, post_mix, comb_mix)
    if residual.dim() == 2:
        return residual[:, None, :].expand(-1, HC_MULT, -1).contiguous()
    return residual


def rstd(residual_cur, rms_eps, cd):
    """SPEC step 2: ``[M]`` reciprocal RMS of each token's 4H values of the bf16 ``residual_cur``, in ``cd``."""
    m, n, h = residual_cur.shape
    xf = residual_cur.reshape(m, n * h).to(cd)
    return torch.rsqrt((xf * xf).sum(-1) / (n * h) + rms_eps)  # divisor 4H, not H


def mixes(residual_cur, fn, hc_scale, hc_base, rms_eps, cd):
    """SPEC steps 2-3: the 24 mixes ``[M, 24]`` in ``cd`` from the bf16 ``residual_cur``."""
    m, n, h = residual_cur.shape
    xf = residual_cur.reshape(m, n * h).to(cd)
    # the dots in float64 whatever cd: a caller's autocast or TF32 matmul setting would lower an fp32 matmul
    dots = (xf.double() @ fn.double().t()).to(cd)
    scale = torch.cat([hc_scale[0:1].expand(4), hc_scale[1:2].expand(4), hc_scale[2:3].expand(16)]).to(cd)
    return dots * rstd(residual_cur, rms_eps, cd)[:, None] * scale + hc_base.to(cd)


def sinkhorn(c: torch.Tensor, eps: float, repeat: int) -> torch.Tensor:
    """SPEC step 5 on ``c [M, 4, 4]``: row softmax + eps, column step, then (row, column) ``repeat - 1`` times."""
    c = torch.softmax(c, dim=-1) + eps
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(repeat - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    return c


def gates(residual_cur, fn, hc_scale, hc_base, *, rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value,
          sinkhorn_repeat, broadcast=False, compute_dtype=torch.float32):
    """SPEC steps 2-5 on the bf16 ``residual_cur [M, 4, H]``: ``(pre [M, 4], post [M, 4], comb [M, 4, 4])`` in
    ``compute_dtype``. ``broadcast``: the 4 streams are equal, the projection and the RMS run over stream 0
    (H values) with ``broadcast_fn(fn)``."""
    cd = compute_dtype
    if broadcast:
        residual_cur, fn = residual_cur[:, :1], broadcast_fn(fn)
    mix = mixes(residual_cur, fn, hc_scale, hc_base, rms_eps, cd)
    pre_gate = torch.sigmoid(mix[:, 0:4]) + hc_pre_eps
    post_mix = torch.sigmoid(mix[:, 4:8]) * hc_post_mult_value
    comb_mix = sinkhorn(mix[:, 8:24].reshape(-1, 4, 4), hc_sinkhorn_eps, sinkhorn_repeat)
    return pre_gate, post_mix, comb_mix


def pre(
    residual_cur: torch.Tensor,
    fn: torch.Tensor,
    hc_scale: torch.Tensor,
    hc_base: torch.Tensor,
    *,
    rms_eps: float = 1e-6,
    hc_pre_eps: float = 1e-6,
    hc_sinkhorn_eps: float = 1e-6,
    hc_post_mult_value: float = 2.0,
    sinkhorn_repeat: int = 20,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    broadcast: bool = False,
    compute_dtype: torch.dtype = torch.float32,
):
    """SPEC steps 2-7 on the bf16 ``residual_cur [M, 4, H]``.

    Returns ``(post_mix_cur [M, 4, 1], comb_mix_cur [M, 4, 4], layer_input [M, H] bf16)``; the mixes are in
    ``compute_dtype``.
    """
    cd = compute_dtype
    pre_gate, post_mix, comb_mix = gates(
        residual_cur, fn, hc_scale, hc_base, rms_eps=rms_eps, hc_pre_eps=hc_pre_eps, hc_sinkhorn_eps=hc_sinkhorn_eps,
        hc_post_mult_value=hc_post_mult_value, sinkhorn_repeat=sinkhorn_repeat, broadcast=broadcast, compute_dtype=cd)
    layer_input = collapse(residual_cur, pre_gate, cd)
    if norm_weight is not None:
        layer_input = rms_norm(layer_input, norm_weight, norm_eps, cd)
    return post_mix[:, :, None], comb_mix, layer_input


def collapse_carried(residual_cur: torch.Tensor, pre_mix: torch.Tensor | None) -> torch.Tensor:
    """The delayed seam's step 3, bit-exactly: ``x1 = bf16(fma-chain(pre[0] * r0, pre[j] * rj, j = 1..3))`` with the
    carried gates ``pre_mix [M, 4]``; None is the identity ``[1, 0, 0, 0]``: stream 0 exactly."""
    if pre_mix is None:
        return residual_cur[:, 0].clone()
    p = pre_mix.float()
    acc = p[:, 0:1] * residual_cur[:, 0].float()  # one fp32 rounding
    for j in range(1, HC_MULT):
        acc = fma_f32(p[:, j : j + 1], residual_cur[:, j].float(), acc)
    return acc.to(torch.bfloat16)


def collapse(residual_cur: torch.Tensor, gates: torch.Tensor, cd) -> torch.Tensor:
    """SPEC step 6: ``bf16(sum_j gates[j] * residual_cur[j])`` in ``cd``, j in order 0..3; ``gates [M, 4]``."""
    res = residual_cur.to(cd)
    gates = gates.to(cd)
    acc = gates[:, 0:1] * res[:, 0]
    for j in range(1, HC_MULT):  # fixed order j = 0..3
        acc = acc + gates[:, j : j + 1] * res[:, j]
    return acc.to(torch.bfloat16)


def rms_norm(layer_input: torch.Tensor, norm_weight: torch.Tensor, norm_eps: float, cd) -> torch.Tensor:
    """SPEC step 7 (and the delayed seam's step 4) on the bf16 ``layer_input [M, H]``: ``bf16(li * rsqrt(mean(li^2)
    + eps) * w)`` in ``cd``."""
    li = layer_input.to(cd)
    r = torch.rsqrt((li * li).mean(-1, keepdim=True) + norm_eps)
    return (li * r * norm_weight.to(cd)).to(torch.bfloat16)


def fused_hc(
    x: torch.Tensor | None,
    residual: torch.Tensor,
    post_mix: torch.Tensor | None,
    comb_mix: torch.Tensor | None,
    fn: torch.Tensor,
    hc_scale: torch.Tensor,
    hc_base: torch.Tensor,
    *,
    compute_dtype: torch.dtype = torch.float32,
    **scalars,
):
    """The whole boundary op on flattened inputs: ``(residual_cur, post_mix_cur, comb_mix_cur, layer_input)``.
    No post: ``residual_cur`` is ``residual`` itself; broadcast entry: 4 copies of ``residual [M, H]``."""
    residual_cur = streams(x, residual, post_mix, comb_mix)
    return (residual_cur, *pre(residual_cur, fn, hc_scale, hc_base, broadcast=residual.dim() == 2,
                               compute_dtype=compute_dtype, **scalars))


def fused_hc_delayed(
    x: torch.Tensor | None,
    residual: torch.Tensor,
    post_mix: torch.Tensor | None,
    comb_mix: torch.Tensor | None,
    pre_mix: torch.Tensor | None,
    fn: torch.Tensor,
    hc_scale: torch.Tensor,
    hc_base: torch.Tensor,
    *,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-20,
    rms_eps: float = 1e-20,
    compute_dtype: torch.dtype = torch.float32,
    **scalars,
):
    """The delayed seam on flattened inputs (SPEC "V4.1"): ``(residual_cur, post_mix_cur, comb_mix_cur,
    layer_input, pre_mix_cur [M, 4])``; the collapse uses the carried ``pre_mix`` (None: identity), and
    ``pre_mix_cur`` is returned, not used. Entry forms as in ``fused_hc``."""
    residual_cur = streams(x, residual, post_mix, comb_mix)
    pre_cur, post_cur, comb_cur = gates(residual_cur, fn, hc_scale, hc_base, rms_eps=rms_eps,
                                        broadcast=residual.dim() == 2, compute_dtype=compute_dtype, **scalars)
    layer_input = collapse_carried(residual_cur, pre_mix)
    if norm_weight is not None:
        layer_input = rms_norm(layer_input, norm_weight, norm_eps, compute_dtype)
    return residual_cur, post_cur[:, :, None], comb_cur, layer_input, pre_cur


# --- the standalone ops of a forward pass (SPEC, "The op family") ------------------------------------------------

def head_mixes(residual, head_fn, head_scale, head_base, rms_eps: float, cd) -> torch.Tensor:
    """``mhc_head``'s 4 mixes ``[M, 4]`` in ``cd``: SPEC steps 2-3 with ``head_fn [4, 4H]`` as the pre rows of a
    24-row weight and ``head_scale [1]`` for every group."""
    pad = N_MIXES - HC_MULT
    fn = torch.cat([head_fn, head_fn.new_zeros(pad, head_fn.shape[1])])
    base = torch.cat([head_base, head_base.new_zeros(pad)])
    return mixes(residual, fn, head_scale.reshape(1).expand(3), base, rms_eps, cd)[:, :HC_MULT]


def head(residual, head_fn, head_scale, head_base, *, rms_eps: float = 1e-6, hc_eps: float = 1e-6,
         norm_weight=None, norm_eps: float = 1e-6, compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``mhc_head`` (V4's ``hc_head``, optionally with the final RMSNorm) on ``residual [M, 4, H]``: ``[M, H]`` bf16."""
    gates = torch.sigmoid(head_mixes(residual, head_fn, head_scale, head_base, rms_eps, compute_dtype)) + hc_eps
    return collapse_norm(residual, gates, norm_weight=norm_weight, norm_eps=norm_eps, compute_dtype=compute_dtype)


def collapse_norm(residual, pre_mix, *, norm_weight=None, norm_eps: float = 1e-20,
                  compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``mhc_collapse`` (V4.1's final collapse with the carried gates ``pre_mix [M, 4]``, then optionally the final
    RMSNorm, SPEC steps 6-7): ``[M, H]`` bf16."""
    li = collapse(residual, pre_mix, compute_dtype)
    return li if norm_weight is None else rms_norm(li, norm_weight, norm_eps, compute_dtype)
