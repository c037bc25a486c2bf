"""The public ops: ``mhc_fused_hc`` (drop-in) and ``mhc_fused_hc_delayed`` (V4.1), and their ``torch.library``
registrations for ``torch.compile``.

An eager call costs host time that, below M = 1000 or so, exceeds its kernels' time; so a call's signature (op,
shapes, dtypes, devices, contiguity, scalars, backend, precision, tactic) is checked and resolved once, into a
``_Plan`` (the flattening to do, the backend and its prepared launch: tactic, compiled kernels, scratch sizes), and
later calls of that signature make only the checks that depend on more than it: grad mode, alignment (copies), the
``out=`` buffers' memory, the current device (and, in the launch, stream, capture and prepared weights). Every op
and seam form takes that path, and so do the custom ops' bodies. A call of one of the last few signatures finds its
plan without the signature's key (``signatures.RecentSignatures``: torch's C++ check of the tensors' metadata).
"""

from __future__ import annotations

import threading

import torch

from . import backends, selector
from .problem import (
    Flattening, MhcFusedHcDelayedOutput, MhcFusedHcOutput, Problem, _as_delayed, check_no_grad, check_out_memory,
    flat_out, new_outputs, validate,
)
from .reference import HC_MULT
from .signatures import RecentSignatures


def prepared_launch(problem: Problem, backend: str, tactic, out):
    """The prepared ``launch(inputs, out)`` (``backends``) of ``backend`` (``auto``: the selector's choice) for calls
    of ``problem``'s signature, or the error that says why it cannot run them."""
    b, tactic = _resolve(problem, backend, tactic)
    return _on_device(problem.residual.device, b.load(), problem, tactic, out)


def _resolve(problem: Problem, backend: str, tactic):
    """The ``backends.Backend`` that runs ``problem`` (its op and form) and its tactic, or the error that says why
    none can."""
    dev = problem.residual.device
    form = problem.form
    name = "mhc_" + problem.op
    tactic = _callers_tactic(name, backend, tactic, dev)
    if backend == "auto":
        # the entry forms run the same kernels with flags: their seam's tuned pick (the delayed seam's own tables,
        # else the V4 seam's), where it runs the form at this H (paths E/F's broadcast entry needs H % 256 == 0)
        backend, tactic = selector.SELECTOR.resolve(dev, problem.m, problem.hidden, problem.precision,
                                                    problem.norm_weight is not None,
                                                    "delayed" if problem.delayed else "v4")
        if backend in backends.BACKENDS and problem.hidden % backends.BACKENDS[backend].h_multiple_for(form):
            backend, tactic = backends.pick_auto_for(dev, form, problem.hidden), None
    if backend not in backends.BACKENDS:  # MHC_CUTE_BACKEND's
        raise _unknown_backend(name, backend, dev)
    why = backends.unavailable_reason(backend, dev)
    if why is not None:
        raise RuntimeError(
            f"{name}: backend {backend!r} is unavailable on {dev} ({why}); "
            f"available here: {['auto'] + backends.available(dev)}"
        )
    b = backends.BACKENDS[backend]
    mult = b.h_multiple_for(form)
    if problem.hidden % mult:
        of = " for the broadcast entry" if mult != b.h_multiple else ""
        raise ValueError(f"{name}: backend {backend!r} needs H % {mult} == 0{of}; got H = {problem.hidden}")
    return b, tactic


def _unknown_backend(name: str, backend, dev: torch.device) -> ValueError:
    return ValueError(f"{name}: unknown backend {backend!r}; available here: {['auto'] + backends.available(dev)}")


def _callers_tactic(name: str, backend, tactic, dev: torch.device):
    """The caller's ``backend`` checked (a registered name or ``"auto"``) and their ``tactic`` as that backend runs
    it (its tactic object; None: its own choice), or the error that names what is wrong."""
    if not isinstance(backend, str):
        raise ValueError(f"{name}: `backend` must be a str (a backend's name or 'auto'); got {type(backend).__name__}")
    if backend != "auto" and backend not in backends.BACKENDS:
        raise _unknown_backend(name, backend, dev)
    if tactic is None:
        return None
    if backend == "auto":
        raise ValueError(f"{name}: `tactic` needs a named backend ('auto' picks its own); got {tactic!r}")
    try:
        return backends.checked_tactic(backend, tactic)
    except ValueError as e:
        raise ValueError(f"{name}: `tactic`: {e}") from None


def _on_device(device: torch.device, fn, *args):
    """``fn(*args)`` with ``device`` current (``backends.call_on``)."""
    return backends.call_on(device.index if device.type == "cuda" else None, fn, *args)


def run_once(problem: Problem, backend: str, tactic=None, out=None) -> MhcFusedHcOutput | MhcFusedHcDelayedOutput:
    """Run ``backend`` once on the flattened problem, writing into ``out`` (fresh buffers when None); no plan is
    kept (the accuracy checks' entry)."""
    if out is None:
        out = problem.empty_outputs()
    if problem.m == 0:
        return out
    _on_device(problem.residual.device, prepared_launch(problem, backend, tactic, out), problem.inputs, out)
    return out


def _flat_out(out, lead: tuple, problem: Problem, no_post: bool):
    """``flat_out`` for ``problem``'s op and form, its errors under the op's name."""
    try:
        return flat_out(out, lead, problem.hidden, problem.residual.device, delayed=problem.delayed,
                        no_post=no_post)
    except ValueError as e:
        raise (_as_delayed(e) if problem.delayed else e) from None


def _shaped(result, lead: tuple, hidden: int, kind, no_post: bool, residual_prev, out):
    """The flat outputs ``result`` as the caller gets them: ``out`` itself when given, else in the caller's leading
    dims; without a post ``residual_cur`` is ``residual_prev`` itself."""
    if out is not None:
        result = kind(*out)
    elif len(lead) != 1:  # not already [M, ...]
        shapes = ((*lead, HC_MULT, hidden), (*lead, HC_MULT, 1), (*lead, HC_MULT, HC_MULT), (*lead, hidden),
                  (*lead, HC_MULT))
        result = kind(*(None if t is None else t.view(*shape) for t, shape in zip(result, shapes)))
    if no_post:
        result = result._replace(residual_cur=residual_prev)
    return result


class _Plan:
    """A call signature, checked and resolved: ``plan.run(tensors, out)`` runs a call of it (module docstring)."""

    __slots__ = ("lead", "m", "hidden", "device", "device_index", "flatten", "scalars", "precision", "delayed",
                 "no_post", "kind", "launch", "as_returned")

    def __init__(self, tensors, problem: Problem, lead: tuple, launch):
        self.lead, self.m, self.hidden, self.device = lead, problem.m, problem.hidden, problem.residual.device
        self.device_index = self.device.index if self.device.type == "cuda" else None
        self.flatten = Flattening(tensors, problem.inputs)
        self.scalars, self.precision, self.delayed = problem.scalars, problem.precision, problem.delayed
        self.no_post = problem.form == "no_post"
        self.kind = MhcFusedHcDelayedOutput if problem.delayed else MhcFusedHcOutput
        self.launch = launch  # None: no tokens
        self.as_returned = len(lead) == 1 and not self.no_post  # fresh flat outputs are what the caller gets

    def run(self, tensors: tuple, out):
        """The call on ``tensors`` (the arguments in the order of ``Problem.inputs``): its flat outputs (``out``'s
        flat views when given; ``residual_cur`` None without a post)."""
        tensors = self.flatten(tensors)
        if out is None:
            outs = new_outputs(tensors[0], tensors[1], tensors[2], tensors[3], self.delayed, self.m)
        else:
            problem = Problem(*tensors[:8], self.scalars, self.precision, tensors[8], self.delayed)
            outs = _flat_out(out, self.lead, problem, self.no_post)
            check_out_memory(outs, tensors)
        if self.launch is not None:
            backends.call_on(self.device_index, self.launch, tensors, outs)
        return outs

    def __call__(self, tensors: tuple, out):
        """The call as the caller gets it (``_shaped``)."""
        result = self.run(tensors, out)
        if out is None and self.as_returned:
            return result
        return _shaped(result, self.lead, self.hidden, self.kind, self.no_post, tensors[1], out)


_PLANS: dict[tuple, _Plan] = {}  # call signature -> plan; insertion-ordered, the oldest goes first when full
_PLANS_LOCK = threading.Lock()  # taken to add a plan (lookups need none)
MAX_PLANS = 4096

# per op (delayed or not): the plans of the last few signatures, found by a C++ check of the tensors' metadata
_RECENT = {False: RecentSignatures(), True: RecentSignatures()}


def _new_plan(tensors, scalars: tuple, backend: str, precision: str, tactic, out, delayed: bool) -> _Plan:
    """Every check of a call (the errors the API promises), then its backend resolved and prepared."""
    problem, lead = validate(*tensors[:8], scalars, precision, tensors[8], delayed=delayed)
    launch = None
    if out is not None:
        out = _flat_out(out, lead, problem, problem.form == "no_post")
        check_out_memory(out, problem.inputs)
    if problem.m:
        launch = prepared_launch(problem, backend, tactic, out or problem.empty_outputs())
    return _Plan(tensors, problem, lead, launch)


def _plan(tensors: tuple, scalars: tuple, backend: str, precision: str, tactic, out, delayed: bool) -> _Plan:
    """The plan of a call's signature (eager calls and the custom ops' bodies), made on its first call: found among
    the recent ones by a C++ check of the tensors' metadata, else by the signature's key."""
    if torch.is_grad_enabled():
        try:
            check_no_grad(tensors)
        except ValueError as e:
            raise (_as_delayed(e) if delayed else e) from None
    rest = (scalars, backend, precision, tactic, selector.generation)
    plan = _RECENT[delayed].find(tensors, rest)
    if plan is not None:
        return plan
    try:
        key = []
        for t in tensors:
            key += (None,) if t is None else (t.shape, t.dtype, t.device, t.is_contiguous())
        key = (*key, delayed, scalars, backend, precision, tactic, selector.generation)
        plan = _PLANS.get(key)
    except (AttributeError, TypeError):  # not a tensor, or an unhashable argument: the checks will name it
        key = plan = None
    if plan is None:
        plan = _new_plan(tensors, scalars, backend, precision, tactic, out, delayed)
        if key is not None:
            with _PLANS_LOCK:
                if len(_PLANS) >= MAX_PLANS:
                    del _PLANS[next(iter(_PLANS))]
                _PLANS[key] = plan
    if key is not None:
        _RECENT[delayed].remember(tensors, rest, plan)
    return plan


def planned_launch(tensors: tuple, scalars: tuple):
    """``auto``'s prepared ``launch(inputs, out)`` for ``mhc_fused_hc`` calls of this signature (its plan's: checked
    and made on first use; None for no tokens), for a caller that passes flat, aligned inputs (``Problem.inputs``
    order) and fresh output buffers of its own, so that none of a call's per-call checks apply (``ops``' head as a
    seam)."""
    return _plan(tensors, scalars, "auto", "fp32", None, None, False).launch


def _call(tensors: tuple, scalars: tuple, backend: str, precision: str, tactic, out, delayed: bool):
    """Both seams: eager (the implementation directly: the custom-op boundary costs host time per call) or, while
    ``torch.compile`` traces, through the custom ops."""
    if torch.compiler.is_compiling():
        return _traced(tensors, scalars, backend, precision, tactic, out, delayed)
    return _plan(tensors, scalars, backend, precision, tactic, out, delayed)(tensors, out)


def mhc_fused_hc(
    x_prev: torch.Tensor | None,
    residual_prev: torch.Tensor,
    post_mix_prev: torch.Tensor | None,
    comb_mix_prev: torch.Tensor | None,
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
    backend: str = "auto",
    precision: str = "fp32",
    tactic=None,
    out=None,
) -> MhcFusedHcOutput:
    """The mHC boundary op: post of the previous sublayer fused with pre of the next (``docs/contract.md``).

    Shapes: ``x_prev [..., H]`` bf16, ``residual_prev [..., 4, H]`` bf16, ``post_mix_prev [..., 4(, 1)]`` fp32,
    ``comb_mix_prev [..., 4, 4]`` (or ``[..., 16]``) fp32, ``fn [24, 4H]`` fp32, ``hc_scale [3]`` fp32,
    ``hc_base [24]`` fp32, ``norm_weight [H]`` bf16/fp32 or None. Returns ``MhcFusedHcOutput(residual_cur
    [..., 4, H] bf16, post_mix_cur [..., 4, 1] fp32, comb_mix_cur [..., 4, 4] fp32, layer_input [..., H] bf16)``;
    outputs are fresh tensors, or with ``out`` the caller's. Non-contiguous or misaligned (not 16-byte) inputs are
    copied first.

    ``backend``: ``"auto"`` (tuned choice for this GPU, the reference on a CPU), ``"torch"``, ``"triton"``,
    ``"half_fma"``, ``"all_fma"``, ``"half_mma"``, ``"all_mma"``. ``precision``: ``"fp32"`` (fp32-accurate
    projection) or ``"tf32"`` (allows a single-TF32 projection on the MMA paths; other backends stay fp32).
    ``tactic``: a tactic of the named backend, as an object or its name (advanced; None lets the backend choose;
    ``auto`` and ``torch`` take none): refused with a ValueError when it is not one of that backend's.
    ``out``: the caller's output buffers ``(residual_cur, post_mix_cur, comb_mix_cur, layer_input)`` (e.g. the
    static buffers of a CUDA graph): the output shapes and dtypes (``post_mix_cur`` may be ``[..., 4]``,
    ``comb_mix_cur`` ``[..., 16]``), contiguous, 16-byte aligned, sharing no memory with each other or with the
    inputs; the op writes every element and returns them.

    Entry forms (SPEC "The op family"): ``x_prev``, ``post_mix_prev`` and ``comb_mix_prev`` all None is a seam
    without post (pipeline entry, Engram seam): ``residual_cur`` is then ``residual_prev`` itself (the same tensor,
    nothing written; with ``out``, ``out.residual_cur`` must be None). Without post, ``residual_prev [..., H]`` is
    the broadcast entry (the embedding: 4 equal streams, written to ``residual_cur``; the projection runs over H
    with ``fn`` summed over the streams, prepared once per weight). Without post, ``[..., 4, H]`` with at least
    one leading dim is read as 4 streams and anything else as an embedding: flatten an embedding whose last leading
    dim is 4 (``[B, 4, H]``) to ``[4B, H]``.

    Inference only (no backward): with grad mode on, an input that requires grad raises ``ValueError``. Inputs on a
    GPU other than the current one run on their own GPU.
    """
    tensors = (x_prev, residual_prev, post_mix_prev, comb_mix_prev, fn, hc_scale, hc_base, norm_weight, None)
    scalars = (rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value, sinkhorn_repeat, norm_eps)
    return _call(tensors, scalars, backend, precision, tactic, out, False)


def mhc_fused_hc_delayed(
    x_prev: torch.Tensor | None,
    residual_prev: torch.Tensor,
    post_mix_prev: torch.Tensor | None,
    comb_mix_prev: torch.Tensor | None,
    pre_mix_prev: torch.Tensor | None,
    fn: torch.Tensor,
    hc_scale: torch.Tensor,
    hc_base: torch.Tensor,
    *,
    rms_eps: float = 1e-20,
    hc_pre_eps: float = 1e-6,
    hc_sinkhorn_eps: float = 1e-6,
    hc_post_mult_value: float = 2.0,
    sinkhorn_repeat: int = 20,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-20,
    backend: str = "auto",
    precision: str = "fp32",
    tactic=None,
    out=None,
) -> MhcFusedHcDelayedOutput:
    """DeepSeek-V4.1's delayed seam (``docs/contract.md``, "V4.1: the delayed seam"): the post of the previous
    sublayer, this seam's gates, and the collapse of the new streams with the gates *carried* from the previous seam.

    Arguments as ``mhc_fused_hc``'s, plus ``pre_mix_prev [..., 4(, 1)]`` fp32: the previous seam's ``pre_mix_cur``,
    or None for the identity ``[1, 0, 0, 0]`` (model entry: the collapse is stream 0). Entry forms as in
    ``mhc_fused_hc``. Defaults are V4.1-Flash's (``rms_eps = norm_eps = 1e-20``). Returns
    ``MhcFusedHcDelayedOutput(residual_cur, post_mix_cur, comb_mix_cur, layer_input, pre_mix_cur [..., 4] fp32)``:
    ``layer_input`` is ``bf16(fma-chain of pre_mix_prev[j] * residual_cur[j])``, RMSNorm-ed with ``norm_weight``;
    ``pre_mix_cur`` is this seam's pre gates, for the next seam's ``pre_mix_prev``. ``out``: five buffers (the
    fifth ``[..., 4]`` or ``[..., 4, 1]``), with ``out.residual_cur`` None for a seam without post.
    """
    tensors = (x_prev, residual_prev, post_mix_prev, comb_mix_prev, fn, hc_scale, hc_base, norm_weight, pre_mix_prev)
    scalars = (rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value, sinkhorn_repeat, norm_eps)
    return _call(tensors, scalars, backend, precision, tactic, out, True)


def _traced(tensors: tuple, scalars: tuple, backend: str, precision: str, tactic, out, delayed: bool):
    """The call as ``torch.compile`` traces it: checked (on fake tensors), then one of the custom ops on the flat
    tensors (the tactic by its name)."""
    problem, lead = validate(*tensors[:8], scalars, precision, tensors[8], delayed=delayed)
    name = "mhc_" + problem.op
    tactic = _callers_tactic(name, backend, tactic, problem.residual.device)
    no_post = problem.form == "no_post"
    flat = None if out is None else _flat_out(out, lead, problem, no_post)
    s = problem.scalars
    args = (problem.x, problem.residual, problem.post_mix, problem.comb_mix)
    args += (problem.pre_mix,) if delayed else ()
    args += (problem.fn, problem.hc_scale, problem.hc_base, problem.norm_weight, s.rms_eps, s.hc_pre_eps,
             s.hc_sinkhorn_eps, s.hc_post_mult_value, s.sinkhorn_repeat, s.norm_eps, backend, precision,
             None if tactic is None else tactic.name)
    ops = torch.ops.mhc_cute
    kind = MhcFusedHcDelayedOutput if delayed else MhcFusedHcOutput
    result = None
    if flat is not None:
        (ops.fused_hc_delayed_out if delayed else ops.fused_hc_out)(*flat, *args)
    else:
        # the custom op returns an empty residual_cur without a post (an output may not alias an input)
        result = kind(*(ops.fused_hc_delayed if delayed else ops.fused_hc)(*args))
        if no_post:
            result = result._replace(residual_cur=None)
    return _shaped(result, lead, problem.hidden, kind, no_post, tensors[1], out)


# The ops' inputs as the custom ops take them (flat tensors, then the scalars, the backend, the precision and the
# tactic's name); one schema for both forms of an op, the out= one first taking the buffers it writes (residual_cur
# None without post).
_OP_TENSORS = "Tensor? x, Tensor residual, Tensor? post_mix, Tensor? comb_mix, "
_OP_REST = ("Tensor fn, Tensor hc_scale, Tensor hc_base, Tensor? norm_weight, float rms_eps, float hc_pre_eps, "
            "float hc_sinkhorn_eps, float hc_post_mult_value, int sinkhorn_repeat, float norm_eps, str backend, "
            "str precision, str? tactic")
_OP_INPUTS = _OP_TENSORS + _OP_REST
_DELAYED_INPUTS = _OP_TENSORS + "Tensor? pre_mix, " + _OP_REST
_OUT_BUFFERS = ("Tensor(a!)? residual_cur, Tensor(b!) post_mix_cur, Tensor(c!) comb_mix_cur, "
                "Tensor(d!) layer_input, ")
torch.library.define("mhc_cute::fused_hc", f"({_OP_INPUTS}) -> (Tensor, Tensor, Tensor, Tensor)")
torch.library.define("mhc_cute::fused_hc_out", f"({_OUT_BUFFERS}{_OP_INPUTS}) -> ()")
torch.library.define("mhc_cute::fused_hc_delayed", f"({_DELAYED_INPUTS}) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")
torch.library.define("mhc_cute::fused_hc_delayed_out",
                     f"({_OUT_BUFFERS}Tensor(e!) pre_mix_cur, {_DELAYED_INPUTS}) -> ()")


def _run_op(out, x, residual, post_mix, comb_mix, fn, hc_scale, hc_base, norm_weight, *scalars_and_mode,
            pre_mix=None, delayed=False):
    """The body of the custom ops (real tensors, already flat): ``out`` None (fresh outputs) or the buffers; the
    flat outputs, through the plan of the call's signature."""
    *scalars, backend, precision, tactic = scalars_and_mode
    tensors = (x, residual, post_mix, comb_mix, fn, hc_scale, hc_base, norm_weight, pre_mix)
    return _plan(tensors, tuple(scalars), backend, precision, tactic, out, delayed).run(tensors, out)


def _fresh(result):
    """A custom op's outputs: without a post, an empty ``residual_cur`` stands for ``residual_prev``."""
    return tuple(t if t is not None else torch.empty(0, dtype=torch.bfloat16, device=result[1].device)
                 for t in result)


@torch.library.impl("mhc_cute::fused_hc", "CompositeExplicitAutograd")
def _fused_hc_op(*args):
    return _fresh(_run_op(None, *args))


def _fake_outputs(x, residual, n_out):
    if x is None and residual.dim() == 3:
        res = residual.new_empty(0)
    else:
        res = residual.new_empty(residual.shape[0], HC_MULT, residual.shape[-1])
    m, h = residual.shape[0], residual.shape[-1]
    outs = (res, residual.new_empty(m, HC_MULT, 1, dtype=torch.float32),
            residual.new_empty(m, HC_MULT, HC_MULT, dtype=torch.float32), residual.new_empty(m, h),
            residual.new_empty(m, HC_MULT, dtype=torch.float32))
    return outs[:n_out]


@torch.library.register_fake("mhc_cute::fused_hc")
def _(x, residual, *args):
    return _fake_outputs(x, residual, 4)


@torch.library.impl("mhc_cute::fused_hc_out", "CompositeExplicitAutograd")
def _fused_hc_out_op(residual_cur, post_mix_cur, comb_mix_cur, layer_input, *args):
    """``mhc_fused_hc(..., out=...)`` under ``torch.compile``: writes the flat output buffers in place."""
    _run_op(MhcFusedHcOutput(residual_cur, post_mix_cur, comb_mix_cur, layer_input), *args)


@torch.library.register_fake("mhc_cute::fused_hc_out")
def _(*args):
    return None


@torch.library.impl("mhc_cute::fused_hc_delayed", "CompositeExplicitAutograd")
def _fused_hc_delayed_op(x, residual, post_mix, comb_mix, pre_mix, *args):
    return _fresh(_run_op(None, x, residual, post_mix, comb_mix, *args, pre_mix=pre_mix, delayed=True))


@torch.library.register_fake("mhc_cute::fused_hc_delayed")
def _(x, residual, *args):
    return _fake_outputs(x, residual, 5)


@torch.library.impl("mhc_cute::fused_hc_delayed_out", "CompositeExplicitAutograd")
def _fused_hc_delayed_out_op(residual_cur, post_mix_cur, comb_mix_cur, layer_input, pre_mix_cur,
                             x, residual, post_mix, comb_mix, pre_mix, *args):
    """``mhc_fused_hc_delayed(..., out=...)`` under ``torch.compile``: writes the flat output buffers in place."""
    _run_op(MhcFusedHcDelayedOutput(residual_cur, post_mix_cur, comb_mix_cur, layer_input, pre_mix_cur),
            x, residual, post_mix, comb_mix, *args, pre_mix=pre_mix, delayed=True)


@torch.library.register_fake("mhc_cute::fused_hc_delayed_out")
def _(*args):
    return None
