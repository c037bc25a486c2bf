"""Weights prepared once per weight tensor (tensor-core layouts, exact splits of ``fn``), cached on its identity.

A boundary's ``fn`` is a model parameter: the same tensor comes back on every call, so a backend that wants it in
another form (the MMA paths' TF32 hi + lo tiles, the Triton path's three bf16 terms) prepares it once.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch

from .reference import broadcast_fn

CACHE_ENTRIES = 512  # V4-Pro has 122 boundary weights: every one stays prepared in a couple of forms

_cache: dict = {}  # insertion-ordered: the oldest entry goes first when full


def bf16_terms(w: torch.Tensor, count: int = 3) -> list[torch.Tensor]:
    """``w`` as ``count`` bf16 terms, each the rest so far rounded to nearest: two carry 16 of fp32's 24 significand
    bits, three all of them (their sum is ``w`` exactly for weights between about 2^-100 and bf16's largest). An
    infinite weight is its first term, the others zero (inf - inf would make them NaN, and its products NaN where
    IEEE gives an infinity); NaN stays NaN in every term."""
    terms, rest = [], w.float()
    for i in range(count):
        terms.append(rest.to(torch.bfloat16))
        if i + 1 < count:
            rest = torch.where(torch.isinf(terms[-1]), 0.0, rest - terms[-1].float())
    return terms


def prepared(fn: torch.Tensor, kind: str, prepare: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``prepare(fn)``, computed once per weight tensor and ``kind`` (the name of the prepared form).

    Keyed on (address, version counter, shape, device, kind); an entry is only reused while the tensor that
    owns the memory (``fn``, or the base ``fn`` is a view of) is alive: once it is freed, a new weight may be
    allocated at the same address with the same version, and must not get the old one's tiles. Inference tensors
    (made under ``torch.inference_mode``) have no version counter, so an in-place update of one is not seen:
    ``clear()`` after updating such a weight in place.
    """
    key = (fn.data_ptr(), None if fn.is_inference() else fn._version, tuple(fn.shape), fn.device, kind)
    hit = _cache.get(key)
    if hit is not None and hit[0]() is not None:
        return hit[1]
    w = prepare(fn)
    if fn.is_cuda and torch.cuda.is_current_stream_capturing():
        # prepared inside the graph (redone on every replay, always right); caching it would hand eager calls
        # a tensor that holds the right values only after a replay. Call once eagerly before capture to avoid it.
        return w
    for k in [k for k, (owner, _) in _cache.items() if owner() is None]:
        del _cache[k]
    while len(_cache) >= CACHE_ENTRIES:
        del _cache[next(iter(_cache))]
    _cache[key] = (weakref.ref(fn if fn._base is None else fn._base), w)
    return w


def broadcast_weight(fn: torch.Tensor) -> torch.Tensor:
    """The broadcast entry's weight ``reference.broadcast_fn(fn)`` (``[24, H]``), prepared once per weight tensor
    for every backend."""
    return prepared(fn, "broadcast_fn", broadcast_fn)


def clear() -> None:
    """Forget every prepared weight (``mhc_cute.clear_prepared_weights``): the next call prepares its weight again.
    Needed after an in-place update of a weight that is an inference tensor, whose version counter does not exist."""
    _cache.clear()
