"""The validated, flattened form of one ``mhc_fused_hc`` or ``mhc_fused_hc_delayed`` call that every backend
receives."""

from __future__ import annotations

import math
from operator import itemgetter
from typing import NamedTuple

import torch

from .reference import HC_MULT, N_MIXES


class MhcFusedHcOutput(NamedTuple):
    residual_cur: torch.Tensor  # [..., 4, H] bf16
    post_mix_cur: torch.Tensor  # [..., 4, 1] fp32
    comb_mix_cur: torch.Tensor  # [..., 4, 4] fp32
    layer_input: torch.Tensor  # [..., H] bf16


class MhcFusedHcDelayedOutput(NamedTuple):
    residual_cur: torch.Tensor  # [..., 4, H] bf16 (no post: residual_prev itself)
    post_mix_cur: torch.Tensor  # [..., 4, 1] fp32
    comb_mix_cur: torch.Tensor  # [..., 4, 4] fp32
    layer_input: torch.Tensor  # [..., H] bf16
    pre_mix_cur: torch.Tensor  # [..., 4] fp32: this seam's pre gates, carried to the next seam


class Scalars(NamedTuple):
    """The op's scalar arguments (a named tuple: built on every call, and hashed into the validation cache)."""

    rms_eps: float = 1e-6
    hc_pre_eps: float = 1e-6
    hc_sinkhorn_eps: float = 1e-6
    hc_post_mult_value: float = 2.0
    sinkhorn_repeat: int = 20
    norm_eps: float = 1e-6

    def as_kwargs(self) -> dict:
        return self._asdict()


V41_SCALARS = Scalars(rms_eps=1e-20, norm_eps=1e-20)  # DeepSeek-V4.1-Flash's (mhc_fused_hc_delayed's defaults)


class Problem(NamedTuple):
    """Contiguous flattened operands: ``x [M, H]``, ``residual [M, 4, H]``, ``post_mix [M, 4]``,
    ``comb_mix [M, 4, 4]``, ``fn [24, 4H]``, ``hc_scale [3]``, ``hc_base [24]``, ``norm_weight [H] | None``;
    ``delayed``: the V4.1 seam, with the carried gates ``pre_mix [M, 4] | None`` (None: identity).
    Entry forms: no post (``x``, ``post_mix``, ``comb_mix`` None), broadcast entry (no post, ``residual [M, H]``).
    A named tuple (immutable): built on every call, and a frozen dataclass costs four times as much to build."""

    x: torch.Tensor
    residual: torch.Tensor
    post_mix: torch.Tensor
    comb_mix: torch.Tensor
    fn: torch.Tensor
    hc_scale: torch.Tensor
    hc_base: torch.Tensor
    norm_weight: torch.Tensor | None
    scalars: Scalars
    precision: str
    pre_mix: torch.Tensor | None = None
    delayed: bool = False

    @property
    def m(self) -> int:
        return self.residual.shape[0]

    @property
    def hidden(self) -> int:
        return self.residual.shape[-1]

    @property
    def broadcast(self) -> bool:
        return self.residual.dim() == 2

    @property
    def inputs(self) -> tuple:
        """The tensors a backend's launch reads: the first eight fields, then ``pre_mix``."""
        return (*self[:8], self.pre_mix)

    @property
    def op(self) -> str:
        """The op's registry key: ``"fused_hc"`` or ``"fused_hc_delayed"``."""
        return "fused_hc_delayed" if self.delayed else "fused_hc"

    @property
    def form(self) -> str:
        """One of ``FORMS`` (SPEC "The op family")."""
        return "regular" if self.x is not None else "broadcast" if self.residual.dim() == 2 else "no_post"

    def empty_outputs(self) -> MhcFusedHcOutput | MhcFusedHcDelayedOutput:
        """Fresh output buffers (never aliasing an input). No post: ``residual_cur`` is None (nothing is written;
        the op returns ``residual_prev`` itself)."""
        return new_outputs(self.x, self.residual, self.post_mix, self.comb_mix, self.delayed, self.m)


def new_outputs(x, residual, post_mix, comb_mix, delayed: bool, m: int) -> MhcFusedHcOutput | MhcFusedHcDelayedOutput:
    """``Problem.empty_outputs`` of the flat inputs of ``m`` tokens (an eager call's plan allocates without building a
    Problem)."""
    if x is not None:
        # empty_like of the flat (contiguous) inputs of the same shapes and dtypes, and sizes passed as separate ints
        # rather than a tuple (torch parses a tuple argument at twice the cost): the cheapest allocation calls
        outs = (torch.empty_like(residual), post_mix.new_empty(m, HC_MULT, 1), torch.empty_like(comb_mix),
                torch.empty_like(x))
    else:
        h = residual.shape[-1]
        f32 = dict(dtype=torch.float32)
        outs = (residual.new_empty(m, HC_MULT, h) if residual.dim() == 2 else None,
                residual.new_empty(m, HC_MULT, 1, **f32), residual.new_empty(m, HC_MULT, HC_MULT, **f32),
                residual.new_empty(m, h))
    if delayed:
        return MhcFusedHcDelayedOutput(*outs, outs[1].new_empty(m, HC_MULT))
    return MhcFusedHcOutput(*outs)


FORMS = ("regular", "no_post", "broadcast")  # the seam forms: with a post, without one, the broadcast entry
PRECISIONS = ("fp32", "tf32")


def fail(op: str, name: str, expected: str, got) -> None:
    """The error every op gives for a bad argument: the op, the argument, what it must be, what it is."""
    raise ValueError(f"{op}: `{name}` must be {expected}; got {got}")


def _fail(name: str, expected: str, got) -> None:
    fail("mhc_fused_hc", name, expected, got)


# the seams' float scalars and their bounds (``check_scalar``); ``sinkhorn_repeat`` is checked apart (an int)
SCALAR_BOUNDS = dict(rms_eps="> 0", hc_pre_eps=">= 0", hc_sinkhorn_eps=">= 0", hc_post_mult_value=None, norm_eps="> 0")


def check_scalar(op: str, name: str, v, bound: str | None = None) -> float:
    """A scalar argument of ``op``: a finite float (not a bool), within ``bound`` (``"> 0"``, ``">= 0"`` or None)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        fail(op, name, "a finite float", repr(v))
    if (bound == "> 0" and v <= 0) or (bound == ">= 0" and v < 0):
        fail(op, name, bound, v)
    return float(v)


def not_requiring_grad(name: str) -> str:
    """What an input requiring grad must be instead (every op is inference-only)."""
    return ("a tensor that does not require grad (the op is inference-only, with no backward: call it under "
            f"torch.inference_mode() or torch.no_grad(), or pass {name}.detach())")


def overlap(p: int, n: int, q: int, k: int) -> bool:
    """Whether the byte ranges [p, p + n) and [q, q + k) share a byte."""
    return bool(n and k and q < p + n and p < q + k)


def _as_delayed(e: ValueError) -> ValueError:
    """A validation error of the delayed seam: the same message under the delayed op's name."""
    return ValueError(str(e).replace("mhc_fused_hc:", "mhc_fused_hc_delayed:", 1))


def _check_tensor(name, t, dtypes, shape_tail, device, anchor="x_prev"):
    """``anchor``: the argument whose device the call runs on (named in the device error)."""
    if not isinstance(t, torch.Tensor):
        _fail(name, "a torch.Tensor", type(t).__name__)
    if t.dtype not in dtypes:
        _fail(name, " or ".join(str(d) for d in dtypes), t.dtype)
    if t.device != device:
        _fail(name, f"on the same device as {anchor} ({device})", t.device)
    if shape_tail is not None:
        n = len(shape_tail)
        if t.dim() < n or tuple(t.shape[t.dim() - n :]) != tuple(shape_tail):
            _fail(name, f"of shape [..., {', '.join(map(str, shape_tail))}]", list(t.shape))


def _check_exact(name, t, dtypes, shape, device, anchor):
    _check_tensor(name, t, dtypes, None, device, anchor)
    if tuple(t.shape) != tuple(shape):
        _fail(name, f"of shape {list(shape)}", list(t.shape))


_MAX_SIGNATURES = 4096
ALIGN_BYTES = 16  # TMA and 16-byte vector loads need aligned bases


def _signature(tensors, *rest) -> tuple:
    """Everything the checks of ``tensors`` depend on, as one flat tuple (a nested one costs twice as much to
    build)."""
    sig = list(rest)
    for t in tensors:
        if isinstance(t, torch.Tensor):
            sig += (t.shape, t.stride(), t.dtype, t.device)
        else:
            sig.append(t)
    return tuple(sig)


INPUT_NAMES = ("x_prev", "residual_prev", "post_mix_prev", "comb_mix_prev", "fn", "hc_scale", "hc_base",
               "norm_weight")  # the user's names of the Problem's tensors
OUT_NAMES = tuple(f"out.{name}" for name in MhcFusedHcDelayedOutput._fields)  # the names the errors give the buffers
OUT_SHAPES = (  # per output: its dtype and the trailing shapes it may have (after the leading dims of x_prev)
    ("residual_cur", torch.bfloat16, ((HC_MULT, None),)),
    ("post_mix_cur", torch.float32, ((HC_MULT, 1), (HC_MULT,))),
    ("comb_mix_cur", torch.float32, ((HC_MULT, HC_MULT), (HC_MULT * HC_MULT,))),
    ("layer_input", torch.bfloat16, ((None,),)),
    ("pre_mix_cur", torch.float32, ((HC_MULT,), (HC_MULT, 1))),  # the delayed seam's only
)


def check_no_grad(tensors) -> None:
    """With grad mode on: no input may require grad, since the op has no backward (its outputs would silently carry
    no gradient). ``tensors`` in the order of ``INPUT_NAMES``, then ``pre_mix_prev``. Made on every call (it depends
    on the grad mode), after ``torch.is_grad_enabled()``: under ``torch.inference_mode()`` (serving) that call is all
    it costs."""
    for name, t in zip(INPUT_NAMES + ("pre_mix_prev",), tensors):
        if getattr(t, "requires_grad", False):  # a non-tensor is validate()'s to name
            _fail(name, not_requiring_grad(name), "requires_grad=True")


_OUT_VALIDATED: dict[tuple, tuple] = {}  # out= signature -> the flat shape to view each buffer as (None: as it is)


def flat_out(out, lead: tuple[int, ...], hidden: int, device, *, delayed: bool = False,
             no_post: bool = False) -> MhcFusedHcOutput | MhcFusedHcDelayedOutput:
    """The caller's output buffers (``out=``) checked (four tensors of the output shapes, five for the delayed
    seam, or the flat alternatives the inputs also accept, dtypes, device, contiguous) and viewed as the flat
    outputs the backends write. ``no_post``: ``out.residual_cur`` must be None (the op returns ``residual_prev``
    itself and writes no residual). A signature (shapes, strides, dtypes, devices) that passed once skips the
    checks: they depend on nothing else. Memory checks (alignment, overlap) need real pointers:
    ``check_out_memory``."""
    kind = MhcFusedHcDelayedOutput if delayed else MhcFusedHcOutput
    try:
        sig = _signature(out, lead, (hidden, device, delayed, no_post))
        shapes = _OUT_VALIDATED.get(sig)
    except TypeError:  # not a sequence, or an unhashable item: the full checks will say so
        sig, shapes = None, None
    if shapes is None:
        shapes = _check_out(out, lead, hidden, device, kind, no_post)
        if sig is not None and len(_OUT_VALIDATED) < _MAX_SIGNATURES:
            _OUT_VALIDATED[sig] = shapes
    return kind(*(t if shape is None else t.view(shape) for t, shape in zip(out, shapes)))


def _check_out(out, lead, hidden, device, kind=MhcFusedHcOutput, no_post=False) -> tuple:
    n = len(kind._fields)
    if not isinstance(out, (tuple, list)) or len(out) != n:
        _fail("out", f"a tuple of {n} tensors ({', '.join(kind._fields)})",
              type(out).__name__ if not isinstance(out, (tuple, list)) else f"{len(out)} items")
    m = math.prod(lead)
    shapes = []
    for t, (name, dtype, tails) in zip(out, OUT_SHAPES):
        name = f"out.{name}"
        if no_post and name == "out.residual_cur":
            if t is not None:
                _fail(name, "None without a post (x_prev None: residual_cur is residual_prev itself, not written)",
                      type(t).__name__)
            shapes.append(None)
            continue
        tails = [tuple(hidden if d is None else d for d in tail) for tail in tails]
        _check_tensor(name, t, (dtype,), None, device, "the inputs")
        if not _shape_in(t.shape, [lead + tail for tail in tails]):
            _fail(name, "of shape " + " or ".join(str(list(lead + tail)) for tail in tails), list(t.shape))
        if not t.is_contiguous():
            _fail(name, "contiguous (the op writes it in place)", f"strides {list(t.stride())}")
        flat = (m,) + tails[0]
        shapes.append(None if _same_shape(t.shape, flat) else flat)
    return tuple(shapes)


def _same_shape(a, b) -> bool:
    """``tuple(a) == tuple(b)`` dimension by dimension: ``torch.compile`` traces that with dynamic (symbolic) sizes,
    where a tuple's ``in`` and ``==`` compare symbols as different objects."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x != y:
            return False
    return True


def _shape_in(shape, options) -> bool:
    for option in options:
        if _same_shape(shape, option):
            return True
    return False


def check_out_memory(out: MhcFusedHcOutput, inputs) -> None:
    """``out=`` buffers: 16-byte aligned bases, and no byte shared with another output or with any input the
    op reads (``inputs``: the flattened problem's tensors, ``Problem.inputs``; inputs may overlap each other, they
    are only read). Needs real tensors (not the fake ones ``torch.compile`` traces). Runs on every call: plain
    loops, names only for the error."""
    outs = [(t.data_ptr(), t.nbytes) if t is not None else (0, 0) for t in out]
    for i, (p, _) in enumerate(outs):
        if p % ALIGN_BYTES:
            _fail(OUT_NAMES[i], f"{ALIGN_BYTES}-byte aligned", f"data_ptr % {ALIGN_BYTES} == {p % ALIGN_BYTES}")
    spans = outs + [(t.data_ptr(), t.nbytes) if t is not None else (0, 0) for t in inputs]
    names = OUT_NAMES[:len(outs)] + INPUT_NAMES + ("pre_mix_prev",)
    for i, (p, n) in enumerate(outs):
        for j in range(i + 1, len(spans)):
            q, k = spans[j]
            if overlap(p, n, q, k):
                _fail(OUT_NAMES[i], f"a buffer that shares no memory with {names[j]}", "overlapping memory")


def aligned(t):
    """``t``, or a copy of it at an aligned base when its base is not ``ALIGN_BYTES``-aligned (None stays None)."""
    return t if t is None or t.data_ptr() % ALIGN_BYTES == 0 else t.clone()


class Flattening:
    """How a call signature's tensor arguments become the flat, contiguous, aligned tensors its backend reads (an
    eager plan's, resolved once from one call's ``tensors`` and their ``flat`` forms): a view or a copy of each input
    that is not already flat and contiguous, and every call's alignment check (misaligned bases are copied)."""

    __slots__ = ("reshapes", "present")

    def __init__(self, tensors, flat):
        # (argument index, flat shape as ints, contiguous)
        self.reshapes = tuple((i, tuple(f.shape), t.is_contiguous()) for i, (t, f) in enumerate(zip(tensors, flat))
                              if t is not None and (t.shape != f.shape or not t.is_contiguous()))
        self.present = itemgetter(*(i for i, t in enumerate(tensors) if t is not None))

    def __call__(self, tensors) -> tuple | list:
        if self.reshapes:
            tensors = list(tensors)
            for i, shape, contiguous in self.reshapes:  # sizes as ints: a tuple argument costs torch twice as much
                tensors[i] = tensors[i].view(*shape) if contiguous else tensors[i].reshape(shape).contiguous()
        ptrs = 0
        for t in self.present(tensors):
            ptrs |= t.data_ptr()
        return tuple(map(aligned, tensors)) if ptrs % ALIGN_BYTES else tensors


def validate(
    x_prev,
    residual_prev,
    post_mix_prev,
    comb_mix_prev,
    fn,
    hc_scale,
    hc_base,
    norm_weight,
    scalars: tuple,
    precision: str,
    pre_mix_prev=None,
    delayed: bool = False,
) -> tuple[Problem, tuple[int, ...]]:
    """Check every argument and return the flattened problem plus the leading dims of the outputs. ``scalars``: the
    six scalar arguments in the order of ``Scalars``.

    Non-contiguous inputs are made contiguous and misaligned ones (base not 16-byte aligned) are copied (except while
    ``torch.compile`` traces: the tensors are fake and the op's allocations aligned); inputs are never modified.
    ``delayed``: the V4.1 seam (``mhc_fused_hc_delayed``), with the carried gates ``pre_mix_prev``; errors name that
    op. The API checks each call signature once (``api._Plan``).
    """
    tensors = (x_prev, residual_prev, post_mix_prev, comb_mix_prev, fn, hc_scale, hc_base, norm_weight, pre_mix_prev)
    try:
        return _validate(tensors, scalars, precision, delayed)
    except ValueError as e:
        if delayed:
            raise _as_delayed(e) from None
        raise


def _validate(tensors, scalars, precision, delayed):
    if torch.is_grad_enabled():
        check_no_grad(tensors)
    return _validate_all(*tensors, Scalars(*scalars), precision, delayed, align=not torch.compiler.is_compiling())


def _flatten(x_prev, residual_prev, post_mix_prev, comb_mix_prev, fn, hc_scale, hc_base, norm_weight, pre_mix_prev,
             lead, scalars, precision, delayed, align: bool = True) -> Problem:
    m, h = math.prod(lead), residual_prev.shape[-1]

    def flat(t, *shape):
        if t is None:
            return None
        if tuple(t.shape) != shape:
            t = t.reshape(shape)
        t = t.contiguous()
        return aligned(t) if align else t

    broadcast = residual_prev.dim() == len(lead) + 1
    return Problem(
        x=flat(x_prev, m, h),
        residual=flat(residual_prev, m, h) if broadcast else flat(residual_prev, m, HC_MULT, h),
        post_mix=flat(post_mix_prev, m, HC_MULT),
        comb_mix=flat(comb_mix_prev, m, HC_MULT, HC_MULT),
        fn=flat(fn, *fn.shape),
        hc_scale=flat(hc_scale, 3),
        hc_base=flat(hc_base, N_MIXES),
        norm_weight=flat(norm_weight, h),
        scalars=scalars,
        precision=precision,
        pre_mix=flat(pre_mix_prev, m, HC_MULT),
        delayed=delayed,
    )


def _leading_dims(x_prev, residual_prev, post_mix_prev, comb_mix_prev):
    """``(lead, H, device)`` from ``x_prev``, or without a post from ``residual_prev``: ``[..., 4, H]`` (at least
    one leading dim) is the 4 streams, anything else ``[..., H]`` the embedding of the broadcast entry."""
    if x_prev is None:
        for name, t in (("post_mix_prev", post_mix_prev), ("comb_mix_prev", comb_mix_prev)):
            if t is not None:
                _fail(name, "None when x_prev is None (a seam without post)", type(t).__name__)
        if not isinstance(residual_prev, torch.Tensor):
            _fail("residual_prev", "a torch.Tensor", type(residual_prev).__name__)
        if residual_prev.dim() < 1:
            _fail("residual_prev", "of shape [..., 4, H] or [..., H]", list(residual_prev.shape))
        streams = residual_prev.dim() >= 3 and residual_prev.shape[-2] == HC_MULT
        lead = tuple(residual_prev.shape[:-2] if streams else residual_prev.shape[:-1])
        return lead, residual_prev.shape[-1], residual_prev.device, "residual_prev"
    if not isinstance(x_prev, torch.Tensor):
        _fail("x_prev", "a torch.Tensor or None", type(x_prev).__name__)
    if x_prev.dim() < 1:
        _fail("x_prev", "of shape [..., H]", list(x_prev.shape))
    return tuple(x_prev.shape[:-1]), x_prev.shape[-1], x_prev.device, "x_prev"


def _validate_all(
    x_prev,
    residual_prev,
    post_mix_prev,
    comb_mix_prev,
    fn,
    hc_scale,
    hc_base,
    norm_weight,
    pre_mix_prev,
    scalars: Scalars,
    precision: str,
    delayed: bool = False,
    align: bool = True,
) -> tuple[Problem, tuple[int, ...]]:
    lead, h, dev, anchor = _leading_dims(x_prev, residual_prev, post_mix_prev, comb_mix_prev)
    bf16, f32 = (torch.bfloat16,), (torch.float32,)
    if h <= 0:
        _fail(anchor, "of shape [..., H] with H > 0", list((x_prev if x_prev is not None else residual_prev).shape))
    if x_prev is not None:
        _check_tensor("x_prev", x_prev, bf16, None, dev)
        _check_tensor("residual_prev", residual_prev, bf16, (HC_MULT, h), dev)
        if not _same_shape(residual_prev.shape[:-2], lead):
            _fail("residual_prev", f"of shape {list(lead) + [HC_MULT, h]} (leading dims of x_prev, hc_mult 4, H)",
                  list(residual_prev.shape))
        _check_tensor("post_mix_prev", post_mix_prev, f32, None, dev)
        if not _shape_in(post_mix_prev.shape, (lead + (HC_MULT,), lead + (HC_MULT, 1))):
            _fail("post_mix_prev", f"of shape {list(lead) + [4]} or {list(lead) + [4, 1]}",
                  list(post_mix_prev.shape))
        _check_tensor("comb_mix_prev", comb_mix_prev, f32, None, dev)
        if not _shape_in(comb_mix_prev.shape, (lead + (HC_MULT, HC_MULT), lead + (HC_MULT * HC_MULT,))):
            _fail("comb_mix_prev", f"of shape {list(lead) + [4, 4]} or {list(lead) + [16]}",
                  list(comb_mix_prev.shape))
    else:
        _check_tensor("residual_prev", residual_prev, bf16, None, dev, anchor)
    if pre_mix_prev is not None:
        _check_tensor("pre_mix_prev", pre_mix_prev, f32, None, dev, anchor)
        if not _shape_in(pre_mix_prev.shape, (lead + (HC_MULT,), lead + (HC_MULT, 1))):
            _fail("pre_mix_prev", f"of shape {list(lead) + [4]} or {list(lead) + [4, 1]} (leading dims of "
                  f"{anchor})", list(pre_mix_prev.shape))
    _check_exact("fn", fn, f32, (N_MIXES, HC_MULT * h), dev, anchor)
    _check_exact("hc_scale", hc_scale, f32, (3,), dev, anchor)
    _check_exact("hc_base", hc_base, f32, (N_MIXES,), dev, anchor)
    if norm_weight is not None:
        _check_exact("norm_weight", norm_weight, (torch.bfloat16, torch.float32), (h,), dev, anchor)
    floats = {name: check_scalar("mhc_fused_hc", name, getattr(scalars, name), bound)
              for name, bound in SCALAR_BOUNDS.items()}
    rep = scalars.sinkhorn_repeat
    if isinstance(rep, bool) or not isinstance(rep, int) or rep < 1:
        _fail("sinkhorn_repeat", "an int >= 1", repr(rep))
    if precision not in PRECISIONS:
        _fail("precision", f"one of {PRECISIONS}", repr(precision))

    checked = Scalars(**floats, sinkhorn_repeat=int(rep))
    problem = _flatten(x_prev, residual_prev, post_mix_prev, comb_mix_prev, fn, hc_scale, hc_base, norm_weight,
                       pre_mix_prev, lead, checked, precision, delayed, align)
    return problem, lead
