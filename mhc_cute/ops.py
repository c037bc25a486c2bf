"""The standalone ops of a forward pass (``docs/contract.md``, *The op family*): ``mhc_post``, ``mhc_head``,
``mhc_collapse``; their validation, backends, and ``torch.library`` registration for ``torch.compile``.

Each op flattens its leading dims into M, checks every argument (errors name it), and runs one backend on the flat
tensors: ``"torch"`` (the reference in fp32, any device), ``"triton"`` (``mhc_cute.triton.ops``: NVIDIA, ROCm, the
CPU interpreter) or ``"cute"`` (``mhc_cute.kernels.post`` / ``collapse``: CuTe DSL on Hopper); ``mhc_head`` also
runs as ``"seam"``, a seam without post on ``mhc_fused_hc``. ``"auto"`` takes the first available backend in the
order listed, on a GPU.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from . import backends, reference
from .api import planned_launch
from .problem import (
    ALIGN_BYTES, Flattening, Scalars, aligned, check_scalar, fail as _fail, not_requiring_grad, overlap,
)
from .reference import HC_MULT, N_MIXES
from .signatures import RecentSignatures
from .weights import prepared

BF16, F32 = (torch.bfloat16,), (torch.float32,)


class OpBackend(NamedTuple):
    entry: str  # "module:function" running the op on flat tensors into the flat ``out``
    kind: str  # "reference" | "triton" | "cute": availability as the seam backends of that kind
    h_multiple: int = 1


# the seam backend whose availability stands for a kind (same device, GPU and module requirements)
_KIND_PROBE = {"triton": "triton", "cute": "half_fma"}

OP_BACKENDS: dict[str, dict[str, OpBackend]] = {
    "mhc_post": {
        "cute": OpBackend("mhc_cute.kernels.post:run_post", "cute", 8),
        "triton": OpBackend("mhc_cute.triton.ops:run_post", "triton"),
        "torch": OpBackend("mhc_cute.ops:_post_torch", "reference"),
    },
    "mhc_collapse": {
        "cute": OpBackend("mhc_cute.kernels.collapse:run_collapse", "cute", 8),
        "triton": OpBackend("mhc_cute.triton.ops:run_collapse", "triton"),
        "torch": OpBackend("mhc_cute.ops:_collapse_torch", "reference"),
    },
    "mhc_head": {
        # a seam without post on the padded head weight, on mhc_fused_hc's auto pick for that form: first, as it beat
        # the Triton head at every M measured (docs/experiments.md)
        "seam": OpBackend("mhc_cute.ops:_head_as_seam", "reference"),
        "triton": OpBackend("mhc_cute.triton.ops:run_head", "triton"),
        "torch": OpBackend("mhc_cute.ops:_head_torch", "reference"),
    },
}


def unavailable_reason(op: str, backend: str, device: torch.device) -> str | None:
    """None if ``backend`` can run ``op`` on ``device``, else a short reason."""
    b = OP_BACKENDS[op][backend]
    return None if b.kind == "reference" else backends.unavailable_reason(_KIND_PROBE[b.kind], device)


def available(op: str, device: torch.device) -> list[str]:
    return [n for n in OP_BACKENDS[op] if unavailable_reason(op, n, device) is None]


def _auto_may_take(op: str, name: str, device: torch.device, hidden: int) -> bool:
    b = OP_BACKENDS[op][name]
    return (unavailable_reason(op, name, device) is None and hidden % b.h_multiple == 0
            and (name == "torch" or device.type == "cuda"))


def auto_backend(op: str, device: torch.device, hidden: int) -> str:
    """The backend ``auto`` runs ``op`` on at this H."""
    return next(n for n in OP_BACKENDS[op] if _auto_may_take(op, n, device, hidden))


def _resolve(op: str, backend: str, device: torch.device, hidden: int) -> OpBackend:
    if not isinstance(backend, str):
        raise ValueError(f"{op}: `backend` must be a str (a backend's name or 'auto'); got {type(backend).__name__}")
    if backend == "auto":
        backend = auto_backend(op, device, hidden)
    if backend not in OP_BACKENDS[op]:
        raise ValueError(f"{op}: unknown backend {backend!r}; available here: {['auto'] + available(op, device)}")
    why = unavailable_reason(op, backend, device)
    if why is not None:
        raise RuntimeError(f"{op}: backend {backend!r} is unavailable on {device} ({why}); "
                           f"available here: {['auto'] + available(op, device)}")
    b = OP_BACKENDS[op][backend]
    if hidden % b.h_multiple:
        raise ValueError(f"{op}: backend {backend!r} needs H % {b.h_multiple} == 0; got H = {hidden}")
    return b


def _dispatch(op: str, backend: str, device: torch.device, hidden: int, m: int, args: tuple, out: torch.Tensor):
    """Run ``backend`` (resolved) on the flat ``args`` into the flat ``out``; nothing to do for M = 0."""
    if m == 0:
        return out
    run = backends.load_entry(_resolve(op, backend, device, hidden).entry)
    backends.call_on(device.index if device.type == "cuda" else None, run, *args, out)
    return out


# --- the torch backend (the reference in fp32) ----------------------------------------------------------------

# in row chunks (``reference.row_chunks``): the float64 temporaries of a chunk, not of the whole call

def _post_torch(x, residual, post_mix, comb_mix, out):
    for rows in reference.row_chunks(residual.shape[0], residual.shape[-1]):
        out[rows].copy_(reference.post(x[rows], residual[rows], post_mix[rows], comb_mix[rows]))


def _collapse_torch(residual, pre_mix, norm_weight, norm_eps, out):
    for rows in reference.row_chunks(residual.shape[0], residual.shape[-1]):
        out[rows].copy_(reference.collapse_norm(residual[rows], pre_mix[rows], norm_weight=norm_weight,
                                                norm_eps=norm_eps))


def _head_torch(residual, head_fn, head_scale, head_base, norm_weight, rms_eps, hc_eps, norm_eps, out):
    for rows in reference.row_chunks(residual.shape[0], residual.shape[-1]):
        out[rows].copy_(reference.head(residual[rows], head_fn, head_scale, head_base, rms_eps=rms_eps,
                                       hc_eps=hc_eps, norm_weight=norm_weight, norm_eps=norm_eps))


# --- mhc_head on the seam kernels ----------------------------------------------------------------------------

def _head_as_seam(residual, head_fn, head_scale, head_base, norm_weight, rms_eps, hc_eps, norm_eps, out):
    """``mhc_head`` as a seam without post (``mhc_fused_hc`` on ``auto``: the V4 seam's tuned pick, every CuTe path
    running that form): the head weight as the pre rows of a 24-row weight (zero rows after them,
    ``head_scale`` for every group, zero bias), prepared once per weight; the seam's pre gates and collapse (and norm)
    are then the head's, written into ``out`` as its ``layer_input`` (no copy). Its post gates and Sinkhorn are
    computed on zero mixes into scratch and dropped (a few hundred bytes a token beside 10H). The inputs are flat and
    aligned and the buffers fresh, so the seam's launch is called directly, without an ``out=`` call's checks."""
    fn = prepared(head_fn, "head_fn_as_24_rows", lambda f: torch.cat([f, f.new_zeros(N_MIXES - HC_MULT, f.shape[1])]))
    scale = prepared(head_scale, "head_scale_as_3", lambda t: t.reshape(1).expand(3).contiguous())
    base = prepared(head_base, "head_base_as_24", lambda b: torch.cat([b, b.new_zeros(N_MIXES - HC_MULT)]))
    m = residual.shape[0]
    mixes = (residual.new_empty(m, HC_MULT, 1, dtype=torch.float32),
             residual.new_empty(m, HC_MULT, HC_MULT, dtype=torch.float32))
    inputs = (None, residual, None, None, fn, scale, base, norm_weight, None)
    launch = planned_launch(inputs, tuple(Scalars(rms_eps=rms_eps, hc_pre_eps=hc_eps, norm_eps=norm_eps)))
    launch(inputs, (None, *mixes, out))  # M > 0 here (``_dispatch``)


# --- validation -------------------------------------------------------------------------------------------------

class _Checker:
    """Argument checks of one op: every error names the op and the argument."""

    def __init__(self, op: str, first: str, t, trailing: int):
        self.op = op
        if not isinstance(t, torch.Tensor):
            _fail(op, first, "a torch.Tensor", type(t).__name__)
        if t.dim() < trailing or t.shape[-1] <= 0:
            _fail(op, first, "of shape [..., H] with H > 0" if trailing == 1 else "of shape [..., 4, H] with H > 0",
                  list(t.shape))
        self.device = t.device
        self.hidden = t.shape[-1]
        self.lead = tuple(t.shape[:-trailing])
        self.m = math.prod(self.lead)
        self.tensors: list[tuple[str, torch.Tensor]] = []

    def tensor(self, name, t, dtypes, shapes, *, optional=False):
        """``t`` of one of ``dtypes`` and one of the ``shapes`` (tuples), on the first argument's device."""
        if t is None and optional:
            return None
        if not isinstance(t, torch.Tensor):
            _fail(self.op, name, "a torch.Tensor", type(t).__name__)
        if t.dtype not in dtypes:
            _fail(self.op, name, " or ".join(str(d) for d in dtypes), t.dtype)
        if t.device != self.device:
            _fail(self.op, name, f"on the same device as the first argument ({self.device})", t.device)
        if tuple(t.shape) not in shapes:
            _fail(self.op, name, "of shape " + " or ".join(str(list(s)) for s in shapes), list(t.shape))
        if torch.is_grad_enabled() and t.requires_grad:
            _fail(self.op, name, not_requiring_grad(name), "requires_grad=True")
        self.tensors.append((name, t))
        return t

    def scalar(self, name, v, *, positive: bool):
        return check_scalar(self.op, name, v, "> 0" if positive else ">= 0")

    def flat(self, t, *shape):
        """``t`` reshaped to the flat ``shape``, contiguous and 16-byte aligned (copied when it is not)."""
        if t is None:
            return None
        t = t.reshape(shape).contiguous()
        return t if torch.compiler.is_compiling() else aligned(t)

    def out(self, out, shape: tuple, flat_shape: tuple):
        """The caller's output buffer: a bf16 tensor of ``shape``, contiguous, on the device; viewed flat."""
        name = "out"
        if not isinstance(out, torch.Tensor):
            _fail(self.op, name, "a torch.Tensor", type(out).__name__)
        if out.dtype != torch.bfloat16:
            _fail(self.op, name, str(torch.bfloat16), out.dtype)
        if out.device != self.device:
            _fail(self.op, name, f"on the same device as the inputs ({self.device})", out.device)
        if tuple(out.shape) != shape:
            _fail(self.op, name, f"of shape {list(shape)}", list(out.shape))
        if not out.is_contiguous():
            _fail(self.op, name, "contiguous (the op writes it in place)", f"strides {list(out.stride())}")
        return out.view(flat_shape)

    def out_memory(self, out: torch.Tensor) -> None:
        """``out``: 16-byte aligned, sharing no byte with any input (real tensors only)."""
        p, n = out.data_ptr(), out.nbytes
        if p % ALIGN_BYTES:
            _fail(self.op, "out", f"{ALIGN_BYTES}-byte aligned", f"data_ptr % {ALIGN_BYTES} == {p % ALIGN_BYTES}")
        for name, t in self.tensors:
            q, k = t.data_ptr(), t.nbytes
            if overlap(p, n, q, k):
                _fail(self.op, "out", f"a buffer that shares no memory with {name}", "overlapping memory")


def _lead_shapes(lead, *tails):
    return [tuple(lead) + tuple(t) for t in tails]


class _OpPlan:
    """A checked call signature of a standalone op returning a fresh output: the flattening to do, the output's
    allocation and shape, the backend's entry resolved; a call of it makes only the checks that depend on more than
    its signature (grad mode, in ``_fast``; alignment: copies)."""

    __slots__ = ("flatten", "scalars", "alloc", "shape", "run", "device_index")

    def __init__(self, tensors: tuple, flat: tuple, scalars: tuple, alloc, shape, run, device: torch.device):
        self.flatten = Flattening(tensors, flat)
        self.scalars, self.alloc, self.shape, self.run = scalars, alloc, shape, run
        self.device_index = device.index if device.type == "cuda" else None

    def __call__(self, tensors: tuple) -> torch.Tensor:
        tensors = self.flatten(tensors)
        out = self.alloc(tensors)
        if self.run is not None:  # None: no tokens
            backends.call_on(self.device_index, self.run, *tensors, *self.scalars, out)
        return out if self.shape is None else out.view(*self.shape)


# per op: the plans of its last few signatures (eager, fresh output), found by a C++ check of the tensors' metadata
# (``signatures``); a call that matches none is checked in full
_RECENT = {op: RecentSignatures() for op in OP_BACKENDS}


def last_plan(op: str):
    """The plan of ``op``'s most recent call signature (its checks and backend resolved; ``benchmark``'s floor)."""
    return _RECENT[op].entries[0].plan


def _fast(op: str, tensors: tuple, rest: tuple, out):
    """The plan of a recent signature of ``op`` for this call, or None (``out=`` and tracing take the full path, and
    so does an input that requires grad with grad mode on, for its error)."""
    if out is not None or torch.compiler.is_compiling():
        return None
    if torch.is_grad_enabled():
        for t in tensors:
            if getattr(t, "requires_grad", False):
                return None
    return _RECENT[op].find(tensors, rest)


def _remember(op: str, c: "_Checker", tensors: tuple, rest: tuple, flat: tuple, scalars: tuple, alloc,
              shape: tuple, backend, out) -> None:
    """Keep the plan of a call just checked in full (fresh output of ``shape``, eager)."""
    if out is not None or torch.compiler.is_compiling():
        return
    run = backends.load_entry(_resolve(op, backend, c.device, c.hidden).entry) if c.m else None
    shape = None if len(c.lead) == 1 else shape
    _RECENT[op].remember(tensors, rest, _OpPlan(tensors, flat, scalars, alloc, shape, run, c.device))


def _post_out(flat):
    return torch.empty_like(flat[1])


def _token_rows_out(flat):
    return flat[0].new_empty(flat[0].shape[0], flat[0].shape[-1])


# --- mhc_post ---------------------------------------------------------------------------------------------------

def mhc_post(x, residual, post_mix, comb_mix, *, backend: str = "auto", out=None) -> torch.Tensor:
    """SPEC step 1 alone (the post of a sublayer; the same bits as the seams' post): ``residual_cur [..., 4, H]`` bf16
    from ``x [..., H]`` bf16, ``residual [..., 4, H]`` bf16, ``post_mix [..., 4(, 1)]`` fp32 and ``comb_mix
    [..., 4, 4]`` (or ``[..., 16]``) fp32. ``out``: the caller's ``[..., 4, H]`` bf16 buffer (contiguous, 16-byte
    aligned, sharing no memory with the inputs), written and returned. Inference only."""
    op = "mhc_post"
    tensors, rest = (x, residual, post_mix, comb_mix), (backend,)
    plan = _fast(op, tensors, rest, out)
    if plan is not None:
        return plan(tensors)
    c = _Checker(op, "x", x, 1)
    h, lead, m = c.hidden, c.lead, c.m
    c.tensor("x", x, BF16, [tuple(x.shape)])
    c.tensor("residual", residual, BF16, _lead_shapes(lead, (HC_MULT, h)))
    c.tensor("post_mix", post_mix, F32, _lead_shapes(lead, (HC_MULT,), (HC_MULT, 1)))
    c.tensor("comb_mix", comb_mix, F32, _lead_shapes(lead, (HC_MULT, HC_MULT), (HC_MULT * HC_MULT,)))
    args = (c.flat(x, m, h), c.flat(residual, m, HC_MULT, h), c.flat(post_mix, m, HC_MULT),
            c.flat(comb_mix, m, HC_MULT, HC_MULT))
    shape = lead + (HC_MULT, h)
    flat_out = None if out is None else c.out(out, shape, (m, HC_MULT, h))
    if torch.compiler.is_compiling():
        if flat_out is not None:
            torch.ops.mhc_cute.post_out(flat_out, *args, backend)
            return out
        return torch.ops.mhc_cute.post(*args, backend).view(shape)
    if flat_out is None:
        flat_out = _post_out(args)
    else:
        c.out_memory(flat_out)
    _dispatch(op, backend, c.device, h, m, args, flat_out)
    _remember(op, c, tensors, rest, args, (), _post_out, shape, backend, out)
    return out if out is not None else flat_out.view(shape)


# --- mhc_collapse -----------------------------------------------------------------------------------------------

def mhc_collapse(residual, pre_mix, *, norm_weight=None, norm_eps: float = 1e-20, backend: str = "auto",
                 out=None) -> torch.Tensor:
    """V4.1's final collapse with the carried gates (SPEC step 6 with the given ``pre_mix``, then with
    ``norm_weight`` step 7, the final RMSNorm): ``[..., H]`` bf16 from ``residual [..., 4, H]`` bf16 and ``pre_mix
    [..., 4(, 1)]`` fp32; ``norm_weight [H]`` bf16 or fp32. ``out``: the caller's ``[..., H]`` bf16 buffer."""
    op = "mhc_collapse"
    tensors, rest = (residual, pre_mix, norm_weight), (backend, norm_eps)
    plan = _fast(op, tensors, rest, out)
    if plan is not None:
        return plan(tensors)
    c = _Checker(op, "residual", residual, 2)
    h, lead, m = c.hidden, c.lead, c.m
    c.tensor("residual", residual, BF16, _lead_shapes(lead, (HC_MULT, h)))
    c.tensor("pre_mix", pre_mix, F32, _lead_shapes(lead, (HC_MULT,), (HC_MULT, 1)))
    c.tensor("norm_weight", norm_weight, BF16 + F32, [(h,)], optional=True)
    norm_eps = c.scalar("norm_eps", norm_eps, positive=True)
    args = (c.flat(residual, m, HC_MULT, h), c.flat(pre_mix, m, HC_MULT), c.flat(norm_weight, h), norm_eps)
    return _run_collapsing(op, c, args, out, torch.ops.mhc_cute.collapse, torch.ops.mhc_cute.collapse_out, backend,
                           tensors, rest)


def _run_collapsing(op, c: _Checker, args, out, custom_op, custom_out_op, backend, tensors, rest):
    """The end of ``mhc_collapse`` and ``mhc_head`` (``[..., H]`` output); ``tensors`` and ``rest``: the call's
    signature (``_remember``)."""
    h, lead, m = c.hidden, c.lead, c.m
    shape = lead + (h,)
    flat_out = None if out is None else c.out(out, shape, (m, h))
    if torch.compiler.is_compiling():
        if flat_out is not None:
            custom_out_op(flat_out, *args, backend)
            return out
        return custom_op(*args, backend).view(shape)
    if flat_out is None:
        flat_out = _token_rows_out(args)
    else:
        c.out_memory(flat_out)
    _dispatch(op, backend, c.device, h, m, args, flat_out)
    n = len(tensors)
    _remember(op, c, tensors, rest, args[:n], args[n:], _token_rows_out, shape, backend, out)
    return out if out is not None else flat_out.view(shape)


# --- mhc_head ---------------------------------------------------------------------------------------------------

def mhc_head(residual, head_fn, head_scale, head_base, *, rms_eps: float = 1e-6, hc_eps: float = 1e-6,
             norm_weight=None, norm_eps: float = 1e-6, backend: str = "auto", out=None) -> torch.Tensor:
    """V4's ``hc_head`` (SPEC steps 2-3 with the 4 head columns, ``pre = sigmoid(mix) + hc_eps``, step 6; with
    ``norm_weight`` also step 7, the model's final RMSNorm): ``[..., H]`` bf16 from ``residual [..., 4, H]`` bf16,
    ``head_fn [4, 4H]``, ``head_scale [1]``, ``head_base [4]`` fp32. ``out``: the caller's ``[..., H]`` bf16
    buffer."""
    op = "mhc_head"
    tensors, rest = (residual, head_fn, head_scale, head_base, norm_weight), (backend, rms_eps, hc_eps, norm_eps)
    plan = _fast(op, tensors, rest, out)
    if plan is not None:
        return plan(tensors)
    c = _Checker(op, "residual", residual, 2)
    h, lead, m = c.hidden, c.lead, c.m
    c.tensor("residual", residual, BF16, _lead_shapes(lead, (HC_MULT, h)))
    c.tensor("head_fn", head_fn, F32, [(HC_MULT, HC_MULT * h)])
    c.tensor("head_scale", head_scale, F32, [(1,)])
    c.tensor("head_base", head_base, F32, [(HC_MULT,)])
    c.tensor("norm_weight", norm_weight, BF16 + F32, [(h,)], optional=True)
    rms_eps = c.scalar("rms_eps", rms_eps, positive=True)
    hc_eps = c.scalar("hc_eps", hc_eps, positive=False)
    norm_eps = c.scalar("norm_eps", norm_eps, positive=True)
    args = (c.flat(residual, m, HC_MULT, h), c.flat(head_fn, HC_MULT, HC_MULT * h), c.flat(head_scale, 1),
            c.flat(head_base, HC_MULT), c.flat(norm_weight, h), rms_eps, hc_eps, norm_eps)
    return _run_collapsing(op, c, args, out, torch.ops.mhc_cute.head, torch.ops.mhc_cute.head_out, backend, tensors,
                           rest)


# --- torch.compile: custom ops on the flat tensors, with fakes -----------------------------------------------------

def _flat_run(op, out, *args):
    """A custom op's body: ``out`` checked against the inputs' memory (real tensors here), then the backend."""
    *args, backend = args
    residual = args[1] if op == "mhc_post" else args[0]
    c = _Checker(op, "x" if op == "mhc_post" else "residual", residual, 2)
    c.tensors = [(f"input {i}", t) for i, t in enumerate(args) if isinstance(t, torch.Tensor)]
    c.out_memory(out)
    return _dispatch(op, backend, residual.device, residual.shape[-1], residual.shape[0], tuple(args), out)


@torch.library.custom_op("mhc_cute::post", mutates_args=())
def _post_op(x: torch.Tensor, residual: torch.Tensor, post_mix: torch.Tensor, comb_mix: torch.Tensor,
             backend: str) -> torch.Tensor:
    return _flat_run("mhc_post", torch.empty_like(residual), x, residual, post_mix, comb_mix, backend)


@_post_op.register_fake
def _(x, residual, post_mix, comb_mix, backend):
    return torch.empty_like(residual)


@torch.library.custom_op("mhc_cute::post_out", mutates_args=("out",))
def _post_out_op(out: torch.Tensor, x: torch.Tensor, residual: torch.Tensor, post_mix: torch.Tensor,
                 comb_mix: torch.Tensor, backend: str) -> None:
    _flat_run("mhc_post", out, x, residual, post_mix, comb_mix, backend)


@torch.library.custom_op("mhc_cute::collapse", mutates_args=())
def _collapse_op(residual: torch.Tensor, pre_mix: torch.Tensor, norm_weight: torch.Tensor | None, norm_eps: float,
                 backend: str) -> torch.Tensor:
    out = residual.new_empty(residual.shape[0], residual.shape[2])
    return _flat_run("mhc_collapse", out, residual, pre_mix, norm_weight, norm_eps, backend)


@_collapse_op.register_fake
def _(residual, pre_mix, norm_weight, norm_eps, backend):
    return residual.new_empty(residual.shape[0], residual.shape[2])


@torch.library.custom_op("mhc_cute::collapse_out", mutates_args=("out",))
def _collapse_out_op(out: torch.Tensor, residual: torch.Tensor, pre_mix: torch.Tensor,
                     norm_weight: torch.Tensor | None, norm_eps: float, backend: str) -> None:
    _flat_run("mhc_collapse", out, residual, pre_mix, norm_weight, norm_eps, backend)


@torch.library.custom_op("mhc_cute::head", mutates_args=())
def _head_op(residual: torch.Tensor, head_fn: torch.Tensor, head_scale: torch.Tensor, head_base: torch.Tensor,
             norm_weight: torch.Tensor | None, rms_eps: float, hc_eps: float, norm_eps: float,
             backend: str) -> torch.Tensor:
    out = residual.new_empty(residual.shape[0], residual.shape[2])
    return _flat_run("mhc_head", out, residual, head_fn, head_scale, head_base, norm_weight, rms_eps, hc_eps,
                     norm_eps, backend)


@_head_op.register_fake
def _(residual, *args):
    return residual.new_empty(residual.shape[0], residual.shape[2])


@torch.library.custom_op("mhc_cute::head_out", mutates_args=("out",))
def _head_out_op(out: torch.Tensor, residual: torch.Tensor, head_fn: torch.Tensor, head_scale: torch.Tensor,
                 head_base: torch.Tensor, norm_weight: torch.Tensor | None, rms_eps: float, hc_eps: float,
                 norm_eps: float, backend: str) -> None:
    _flat_run("mhc_head", out, residual, head_fn, head_scale, head_base, norm_weight, rms_eps, hc_eps, norm_eps,
              backend)
