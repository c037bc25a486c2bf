"""The mHC side of a whole DeepSeek-V4 / V4.1 forward pass, as an engine wires it: the documented example of the op
family (``docs/contract.md``, *The op family*), and what ``mhc-cute bench --model`` times.

A model of L layers has 2L sublayers (attention, then MoE, per layer), in order. Each sublayer ``i`` has its mHC
weights (``SublayerWeights``: ``fn [24, 4H]``, ``hc_scale [3]``, ``hc_base [24]`` and the sublayer's input RMSNorm
weight, folded into the seam before it) and a callable ``sublayers[i](layer_input [..., H] bf16) -> [..., H] bf16``
(attention or MoE in a real model).

V4 (``mhc_forward_v4``): entry seam (broadcast: the 4 streams are 4 copies of the embedding, no post), 2L - 1 seams
``mhc_fused_hc``, the last sublayer's ``mhc_post``, then ``mhc_head`` with the final RMSNorm: the head's input.

V4.1 (``mhc_forward_v41``): every seam is ``mhc_fused_hc_delayed`` (each collapses with the previous seam's pre
gates and returns its own); the entry seam is the broadcast form with identity gates; at an Engram layer the
attention seam is split: ``mhc_post``, the Engram callable on the streams ``[..., 4, H]``, then a seam without post;
the end is ``mhc_post`` and ``mhc_collapse`` with the last carried gates and the final RMSNorm.

``reference_forward_v4`` / ``reference_forward_v41`` run the same wiring on ``mhc_cute.reference`` (float64 by
default): what the tests compare the op loops with.
"""

from __future__ import annotations

import math
from typing import Callable, Mapping, NamedTuple, Sequence

import torch

from . import reference
from .api import mhc_fused_hc, mhc_fused_hc_delayed
from .backends import BACKENDS
from .ops import OP_BACKENDS, mhc_collapse, mhc_head, mhc_post
from .problem import V41_SCALARS, Scalars
from .reference import HC_MULT

Sublayer = Callable[[torch.Tensor], torch.Tensor]
Engram = Callable[[torch.Tensor], torch.Tensor]  # streams [..., 4, H] bf16 -> [..., 4, H] bf16


class SublayerWeights(NamedTuple):
    fn: torch.Tensor  # [24, 4H] fp32
    hc_scale: torch.Tensor  # [3] fp32
    hc_base: torch.Tensor  # [24] fp32
    norm_weight: torch.Tensor | None = None  # [H]: the sublayer's input RMSNorm (attn_norm / ffn_norm)


class HeadWeights(NamedTuple):
    """V4's ``hc_head`` weights and the model's final RMSNorm weight."""

    fn: torch.Tensor  # [4, 4H] fp32
    scale: torch.Tensor  # [1] fp32
    base: torch.Tensor  # [4] fp32
    norm_weight: torch.Tensor | None = None  # [H]


V4_SCALARS = Scalars()  # every seam's scalars: V4's defaults, and V4.1-Flash's


def _check_model(weights: Sequence[SublayerWeights], sublayers: Sequence[Sublayer]) -> None:
    if len(weights) != len(sublayers) or not weights or len(weights) % 2:
        raise ValueError(f"`weights` and `sublayers` must be two lists of 2L items (attention, MoE per layer); got "
                         f"{len(weights)} and {len(sublayers)}")


def _op_backend(op: str, backend: str) -> str:
    """The standalone op's backend for a model run on the seam backend ``backend``: the same name where the op has
    it ("torch", "triton"), else its own choice."""
    return backend if backend in OP_BACKENDS[op] else "auto"


def _entry_backend(backend: str, hidden: int) -> str:
    """The broadcast entry's backend on a model run on ``backend``: ``backend`` where it runs that form at this H
    (paths E/F need H % 256 == 0), else ``"auto"``."""
    fits = backend not in BACKENDS or hidden % BACKENDS[backend].h_multiple_for("broadcast") == 0
    return backend if fits else "auto"


def mhc_forward_v4(embedding: torch.Tensor, weights: Sequence[SublayerWeights], sublayers: Sequence[Sublayer],
                   head: HeadWeights, *, scalars: Scalars = V4_SCALARS, backend: str = "auto") -> torch.Tensor:
    """The mHC ops of a DeepSeek-V4 forward pass around ``sublayers`` (2L of them): ``embedding [..., H]`` bf16 in, the
    head's input ``[..., H]`` bf16 out (``mhc_head`` with ``head.norm_weight`` as the final RMSNorm; ``hc_head``'s
    RMS eps is ``scalars.norm_eps``, as in DeepSeek's reference). ``backend``: the seams' (``mhc_fused_hc``; the entry
    runs on auto where the backend cannot run the broadcast entry at this H)."""
    _check_model(weights, sublayers)
    seam_kw = scalars._asdict()
    w = weights[0]
    seam = mhc_fused_hc(None, embedding, None, None, w.fn, w.hc_scale, w.hc_base, norm_weight=w.norm_weight,
                        backend=_entry_backend(backend, embedding.shape[-1]), **seam_kw)  # broadcast entry
    y = sublayers[0](seam.layer_input)
    for w, sublayer in zip(weights[1:], sublayers[1:]):
        seam = mhc_fused_hc(y, seam.residual_cur, seam.post_mix_cur, seam.comb_mix_cur, w.fn, w.hc_scale, w.hc_base,
                            norm_weight=w.norm_weight, backend=backend, **seam_kw)
        y = sublayer(seam.layer_input)
    residual = mhc_post(y, seam.residual_cur, seam.post_mix_cur, seam.comb_mix_cur,
                        backend=_op_backend("mhc_post", backend))
    return mhc_head(residual, head.fn, head.scale, head.base, rms_eps=scalars.norm_eps, hc_eps=scalars.hc_pre_eps,
                    norm_weight=head.norm_weight, norm_eps=scalars.norm_eps, backend=_op_backend("mhc_head", backend))


def mhc_forward_v41(embedding: torch.Tensor, weights: Sequence[SublayerWeights], sublayers: Sequence[Sublayer],
                    final_norm_weight: torch.Tensor | None, *, engram: Mapping[int, Engram] | None = None,
                    scalars: Scalars = V41_SCALARS, backend: str = "auto") -> torch.Tensor:
    """The mHC ops of a DeepSeek-V4.1 forward pass around ``sublayers`` (2L of them): ``embedding [..., H]`` bf16 in,
    the head's input ``[..., H]`` bf16 out (the final collapse with the carried gates, then ``final_norm_weight``'s
    RMSNorm). ``engram``: {layer index: callable on the streams} (V4.1-Flash: layers 1 and 14), run between the
    standalone post and the attention seam of that layer. ``backend``: the seams' (``mhc_fused_hc_delayed``; the
    entry runs on auto where the backend cannot run the broadcast entry at this H)."""
    _check_model(weights, sublayers)
    engram = engram or {}
    seam_kw = scalars._asdict()
    post_backend = _op_backend("mhc_post", backend)
    broadcast = _entry_backend(backend, embedding.shape[-1])
    w = weights[0]
    if 0 in engram:  # the Engram reads the 4 streams: they exist before the first seam
        residual = engram[0](embedding.unsqueeze(-2).expand(*embedding.shape[:-1], HC_MULT, embedding.shape[-1]))
        seam = mhc_fused_hc_delayed(None, residual, None, None, None, w.fn, w.hc_scale, w.hc_base,
                                    norm_weight=w.norm_weight, backend=backend, **seam_kw)
    else:  # broadcast entry, identity gates
        seam = mhc_fused_hc_delayed(None, embedding, None, None, None, w.fn, w.hc_scale, w.hc_base,
                                    norm_weight=w.norm_weight, backend=broadcast, **seam_kw)
    y = sublayers[0](seam.layer_input)
    for i in range(1, len(weights)):
        w, layer = weights[i], i // 2
        if i % 2 == 0 and layer in engram:  # Engram seam: standalone post, Engram, seam without post
            residual = mhc_post(y, seam.residual_cur, seam.post_mix_cur, seam.comb_mix_cur, backend=post_backend)
            seam = mhc_fused_hc_delayed(None, engram[layer](residual), None, None, seam.pre_mix_cur, w.fn,
                                        w.hc_scale, w.hc_base, norm_weight=w.norm_weight, backend=backend, **seam_kw)
        else:
            seam = mhc_fused_hc_delayed(y, seam.residual_cur, seam.post_mix_cur, seam.comb_mix_cur, seam.pre_mix_cur,
                                        w.fn, w.hc_scale, w.hc_base, norm_weight=w.norm_weight, backend=backend,
                                        **seam_kw)
        y = sublayers[i](seam.layer_input)
    residual = mhc_post(y, seam.residual_cur, seam.post_mix_cur, seam.comb_mix_cur, backend=post_backend)
    return mhc_collapse(residual, seam.pre_mix_cur, norm_weight=final_norm_weight, norm_eps=scalars.norm_eps,
                        backend=_op_backend("mhc_collapse", backend))


# --- the same wiring on the reference -----------------------------------------------------------------------------

class _Flat:
    """A model's leading dims: flattens activations to ``[M, ...]`` for the reference, and back for the callables."""

    def __init__(self, embedding: torch.Tensor):
        self.lead = tuple(embedding.shape[:-1])
        self.hidden = embedding.shape[-1]
        self.m = math.prod(self.lead)

    def call(self, f: Callable, t: torch.Tensor) -> torch.Tensor:
        """``f`` on ``t [M, ...]`` viewed with the leading dims, its result flattened again."""
        out = f(t.reshape(*self.lead, *t.shape[1:]))
        return out.reshape(self.m, *out.shape[len(self.lead):])


def _ref_seam(residual_cur, w: SublayerWeights, s: Scalars, cd):
    """SPEC steps 2-5 on ``residual_cur [M, 4, H]``: ``(pre, post, comb)`` in ``cd``."""
    return reference.gates(residual_cur, w.fn, w.hc_scale, w.hc_base, rms_eps=s.rms_eps, hc_pre_eps=s.hc_pre_eps,
                           hc_sinkhorn_eps=s.hc_sinkhorn_eps, hc_post_mult_value=s.hc_post_mult_value,
                           sinkhorn_repeat=s.sinkhorn_repeat, compute_dtype=cd)


def _ref_input(residual_cur, gates, norm_weight, s: Scalars, cd):
    """SPEC steps 6-7: the sublayer's input ``[M, H]`` bf16."""
    return reference.collapse_norm(residual_cur, gates, norm_weight=norm_weight, norm_eps=s.norm_eps,
                                   compute_dtype=cd)


def _four_copies(e: torch.Tensor) -> torch.Tensor:
    return e[:, None, :].expand(e.shape[0], HC_MULT, e.shape[1]).contiguous()


def reference_forward_v4(embedding, weights, sublayers, head: HeadWeights, *, scalars: Scalars = V4_SCALARS,
                         compute_dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``mhc_forward_v4`` on ``mhc_cute.reference``: the entry's 4 streams materialised (the broadcast projection is
    the same in exact arithmetic), every post the fp32 FMA chain, everything else in ``compute_dtype``."""
    _check_model(weights, sublayers)
    f, s, cd = _Flat(embedding), scalars, compute_dtype
    residual = _four_copies(embedding.reshape(f.m, f.hidden))
    post = comb = y = None
    for i, (w, sublayer) in enumerate(zip(weights, sublayers)):
        if i:
            residual = reference.post(y, residual, post, comb)
        pre, post, comb = _ref_seam(residual, w, s, cd)
        y = f.call(sublayer, _ref_input(residual, pre, w.norm_weight, s, cd))
    residual = reference.post(y, residual, post, comb)
    li = reference.head(residual, head.fn, head.scale, head.base, rms_eps=s.norm_eps, hc_eps=s.hc_pre_eps,
                        norm_weight=head.norm_weight, norm_eps=s.norm_eps, compute_dtype=cd)
    return li.reshape(*f.lead, f.hidden)


def reference_forward_v41(embedding, weights, sublayers, final_norm_weight, *, engram=None,
                          scalars: Scalars = V41_SCALARS, compute_dtype: torch.dtype = torch.float64):
    """``mhc_forward_v41`` on ``mhc_cute.reference`` (see ``reference_forward_v4``); the identity gates of the entry
    collapse give stream 0, the embedding, exactly."""
    _check_model(weights, sublayers)
    engram = engram or {}
    f, s, cd = _Flat(embedding), scalars, compute_dtype
    residual = _four_copies(embedding.reshape(f.m, f.hidden))
    carried = torch.zeros(f.m, HC_MULT, dtype=cd, device=embedding.device)
    carried[:, 0] = 1  # identity
    post = comb = y = None
    for i, (w, sublayer) in enumerate(zip(weights, sublayers)):
        if i:
            residual = reference.post(y, residual, post, comb)
        if i % 2 == 0 and i // 2 in engram:
            residual = f.call(engram[i // 2], residual)
        pre, post, comb = _ref_seam(residual, w, s, cd)
        y = f.call(sublayer, _ref_input(residual, carried, w.norm_weight, s, cd))
        carried = pre
    residual = reference.post(y, residual, post, comb)
    return _ref_input(residual, carried, final_norm_weight, s, cd).reshape(*f.lead, f.hidden)
