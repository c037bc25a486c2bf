"""The public ops: ``mhc_fused_hc`` (drop-in) and ``mhc_fused_hc_delayed`` (V4.1), and their ``torch.library``
registrations for ``torch.compile``."""

from __future__ import annotations

import torch

from . import backends, selector
from .problem import (MhcFusedHcDelayedOutput, MhcFusedHcOutput, Problem, Scalars, _as_delayed, check_out_memory,
                      flat_out, validate)
from .reference import HC_MULT


def _dispatch(problem: Problem, backend: str, tactic=None, out=None) -> MhcFusedHcOutput | MhcFusedHcDelayedOutput:
    """Run ``backend`` on the flattened problem, writing into ``out`` (fresh buffers when None)."""
    if out is None:
        out = problem.empty_outputs()
    if problem.m == 0:
        return out
    dev = problem.residual.device
    op, form = problem.op, problem.form
    name = "mhc_" + op
    if backend == "auto":
        if op == "fused_hc" and form == "regular":
            backend, tactic = selector.SELECTOR.resolve(dev, problem.m, problem.hidden, problem.precision,
                                                        problem.norm_weight is not None)
        else:
            backend, tactic = backends.pick_auto_for(dev, problem.m, problem.hidden, op, form), None
    if backend not in backends.BACKENDS:
        raise ValueError(
            f"{name}: unknown backend {backend!r}; available here: {['auto'] + backends.available(dev, op, form)}"
        )
    if backends.BACKENDS[backend].entry_for(op, form) is None:
        raise ValueError(
            f"{name}: backend {backend!r} does not implement the {form.replace('_', ' ')} form of this op; "
            f"available here: {['auto'] + backends.available(dev, op, form)}"
        )
    why = backends.unavailable_reason(backend, dev)
    if why is not None:
        raise RuntimeError(
            f"{name}: backend {backend!r} is unavailable on {dev} ({why}); "
            f"available here: {['auto'] + backends.available(dev, op, form)}"
        )
    mult = backends.BACKENDS[backend].h_multiple
    if problem.hidden % mult:
        raise ValueError(f"{name}: backend {backend!r} needs H % {mult} == 0; got H = {problem.hidden}")
    run = backends.BACKENDS[backend].load(op, form)
    if dev.type == "cuda" and dev.index != torch.cuda.current_device():
        # Triton and the TVM-FFI launches use the current device and its stream: make it the inputs' device
        with torch.cuda.device(dev):
            run(problem, tactic, out)
    else:
        run(problem, tactic, out)
    return out


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
    """The mHC boundary op: post of the previous sublayer fused with pre of the next (``../shared/SPEC.md``).

    Shapes: ``x_prev [..., H]`` bf16, ``residual_prev [..., 4, H]`` bf16, ``post_mix_prev [..., 4(, 1)]`` fp32,
    ``comb_mix_prev [..., 4, 4]`` (or ``[..., 16]``) fp32, ``fn [24, 4H]`` fp32, ``hc_scale [3]`` fp32,
    ``hc_base [24]`` fp32, ``norm_weight [H]`` bf16/fp32 or None. Returns ``MhcFusedHcOutput(residual_cur
    [..., 4, H] bf16, post_mix_cur [..., 4, 1] fp32, comb_mix_cur [..., 4, 4] fp32, layer_input [..., H] bf16)``;
    outputs are fresh tensors, or with ``out`` the caller's. Non-contiguous or misaligned (not 16-byte) inputs are
    copied first.

    ``backend``: ``"auto"`` (tuned choice for this GPU, the reference on a CPU), ``"torch"``, ``"triton"``,
    ``"half_fma"``, ``"all_fma"``, ``"half_mma"``, ``"all_mma"``. ``precision``: ``"fp32"`` (fp32-accurate
    projection) or ``"tf32"`` (allows a single-TF32 projection on the MMA paths; other backends stay fp32).
    ``tactic``: a tactic object or name for the chosen backend (advanced; None lets the backend choose).
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
    scalars = Scalars(rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value, sinkhorn_repeat, norm_eps)
    problem, lead = validate(
        x_prev, residual_prev, post_mix_prev, comb_mix_prev, fn, hc_scale, hc_base, norm_weight, scalars, precision
    )
    return _call(problem, lead, residual_prev, backend, tactic, out)


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
    """DeepSeek-V4.1's delayed seam (``../shared/SPEC.md``, "V4.1: the delayed seam"): the post of the previous
    sublayer, this seam's gates, and the collapse of the new streams with the gates *carried* from the previous seam.

    Arguments as ``mhc_fused_hc``'s, plus ``pre_mix_prev [..., 4(, 1)]`` fp32: the previous seam's ``pre_mix_cur``,
    or None for the identity ``[1, 0, 0, 0]`` (model entry: the collapse is stream 0). Entry forms as in
    ``mhc_fused_hc``. Defaults are V4.1-Flash's (``rms_eps = norm_eps = 1e-20``). Returns
    ``MhcFusedHcDelayedOutput(residual_cur, post_mix_cur, comb_mix_cur, layer_input, pre_mix_cur [..., 4] fp32)``:
    ``layer_input`` is ``bf16(fma-chain of pre_mix_prev[j] * residual_cur[j])``, RMSNorm-ed with ``norm_weight``;
    ``pre_mix_cur`` is this seam's pre gates, for the next seam's ``pre_mix_prev``. ``out``: five buffers (the
    fifth ``[..., 4]`` or ``[..., 4, 1]``), with ``out.residual_cur`` None for a seam without post.
    """
    scalars = Scalars(rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value, sinkhorn_repeat, norm_eps)
    problem, lead = validate(
        x_prev, residual_prev, post_mix_prev, comb_mix_prev, fn, hc_scale, hc_base, norm_weight, scalars, precision,
        pre_mix_prev, delayed=True,
    )
    return _call(problem, lead, residual_prev, backend, tactic, out)


def _call(problem: Problem, lead: tuple, residual_prev: torch.Tensor, backend: str, tactic, out):
    """Both seams after validation: eager or through the custom op, then the outputs in the caller's leading dims;
    without a post ``residual_cur`` is ``residual_prev`` itself."""
    kind = MhcFusedHcDelayedOutput if problem.delayed else MhcFusedHcOutput
    no_post = problem.x is None and not problem.broadcast
    flat = None
    if out is not None:
        try:
            flat = flat_out(out, lead, problem.hidden, problem.residual.device, delayed=problem.delayed,
                            no_post=no_post)
        except ValueError as e:
            raise (_as_delayed(e) if problem.delayed else e) from None
    if torch.compiler.is_compiling():
        s = problem.scalars
        args = (problem.x, problem.residual, problem.post_mix, problem.comb_mix)
        args += (problem.pre_mix,) if problem.delayed else ()
        args += (problem.fn, problem.hc_scale, problem.hc_base, problem.norm_weight, s.rms_eps, s.hc_pre_eps,
                 s.hc_sinkhorn_eps, s.hc_post_mult_value, s.sinkhorn_repeat, s.norm_eps, backend, problem.precision)
        ops = torch.ops.mhc_cute
        if flat is not None:
            (ops.fused_hc_delayed_out if problem.delayed else ops.fused_hc_out)(*flat, *args)
            result = None
        else:
            # the custom op returns an empty residual_cur without a post (an output may not alias an input)
            result = kind(*(ops.fused_hc_delayed if problem.delayed else ops.fused_hc)(*args))
    else:
        # eager: call the implementation directly; the custom-op boundary costs host time per call
        result = _run(problem, backend, tactic, flat)
    if flat is not None:
        result = kind(*out)
    elif no_post:
        result = result._replace(residual_cur=None)
    if flat is None and len(lead) != 1:  # not already [M, ...]
        h = problem.hidden
        shapes = ((*lead, HC_MULT, h), (*lead, HC_MULT, 1), (*lead, HC_MULT, HC_MULT), (*lead, h), (*lead, HC_MULT))
        result = kind(*(None if t is None else t.view(shape) for t, shape in zip(result, shapes)))
    if no_post:
        result = result._replace(residual_cur=residual_prev)
    return result


# The ops' inputs as the custom ops take them (flat tensors, then the scalars, the backend and the precision); one
# schema for both forms of an op, the out= one first taking the buffers it writes (residual_cur None without post).
_OP_TENSORS = "Tensor? x, Tensor residual, Tensor? post_mix, Tensor? comb_mix, "
_OP_REST = ("Tensor fn, Tensor hc_scale, Tensor hc_base, Tensor? norm_weight, float rms_eps, float hc_pre_eps, "
            "float hc_sinkhorn_eps, float hc_post_mult_value, int sinkhorn_repeat, float norm_eps, str backend, "
            "str precision")
_OP_INPUTS = _OP_TENSORS + _OP_REST
_DELAYED_INPUTS = _OP_TENSORS + "Tensor? pre_mix, " + _OP_REST
_OUT_BUFFERS = ("Tensor(a!)? residual_cur, Tensor(b!) post_mix_cur, Tensor(c!) comb_mix_cur, "
                "Tensor(d!) layer_input, ")
torch.library.define("mhc_cute::fused_hc", f"({_OP_INPUTS}) -> (Tensor, Tensor, Tensor, Tensor)")
torch.library.define("mhc_cute::fused_hc_out", f"({_OUT_BUFFERS}{_OP_INPUTS}) -> ()")
torch.library.define("mhc_cute::fused_hc_delayed", f"({_DELAYED_INPUTS}) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")
torch.library.define("mhc_cute::fused_hc_delayed_out",
                     f"({_OUT_BUFFERS}Tensor(e!) pre_mix_cur, {_DELAYED_INPUTS}) -> ()")


def _run(problem: Problem, backend: str, tactic, out):
    """``_dispatch`` into fresh outputs (``out`` None) or the caller's flat buffers, checked against the problem's
    memory first (real tensors only: eager calls and the custom ops' bodies)."""
    if out is not None:
        check_out_memory(out, problem)
    return _dispatch(problem, backend, tactic, out)


def _run_op(out, x, residual, post_mix, comb_mix, fn, hc_scale, hc_base, norm_weight, *scalars_and_mode,
            pre_mix=None, delayed=False):
    """The body of the custom ops (real tensors, already flat): ``out`` None (fresh outputs) or the buffers."""
    *scalars, backend, precision = scalars_and_mode
    problem = Problem(x, residual, post_mix, comb_mix, fn, hc_scale, hc_base, norm_weight, Scalars(*scalars),
                      precision, pre_mix, delayed)
    return _run(problem, backend, None, out)


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
