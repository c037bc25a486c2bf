"""The public op: ``mhc_fused_hc`` (drop-in), and its ``torch.library`` registration for ``torch.compile``."""

from __future__ import annotations

import torch

from . import autotune, backends
from .problem import MhcFusedHcOutput, Problem, Scalars, check_out_memory, flat_out, validate
from .reference import HC_MULT


def _dispatch(problem: Problem, backend: str, tactic=None, out: MhcFusedHcOutput | None = None) -> MhcFusedHcOutput:
    """Run ``backend`` on the flattened problem, writing into ``out`` (fresh buffers when None)."""
    if out is None:
        out = problem.empty_outputs()
    if problem.m == 0:
        return out
    dev = problem.x.device
    if backend == "auto":
        backend, tactic = autotune.SELECTOR.resolve(dev, problem.m, problem.hidden, problem.precision,
                                                    problem.norm_weight is not None)
    if backend not in backends.BACKENDS:
        raise ValueError(
            f"mhc_fused_hc: unknown backend {backend!r}; available here: {['auto'] + backends.available(dev)}"
        )
    why = backends.unavailable_reason(backend, dev)
    if why is not None:
        raise RuntimeError(
            f"mhc_fused_hc: backend {backend!r} is unavailable on {dev} ({why}); "
            f"available here: {['auto'] + backends.available(dev)}"
        )
    mult = backends.BACKENDS[backend].h_multiple
    if problem.hidden % mult:
        raise ValueError(f"mhc_fused_hc: backend {backend!r} needs H % {mult} == 0; got H = {problem.hidden}")
    run = backends.BACKENDS[backend].load()
    if dev.type == "cuda" and dev.index != torch.cuda.current_device():
        # Triton and the TVM-FFI launches use the current device and its stream: make it the inputs' device
        with torch.cuda.device(dev):
            run(problem, tactic, out)
    else:
        run(problem, tactic, out)
    return out


def mhc_fused_hc(
    x_prev: torch.Tensor,
    residual_prev: torch.Tensor,
    post_mix_prev: torch.Tensor,
    comb_mix_prev: torch.Tensor,
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

    Inference only (no backward): with grad mode on, an input that requires grad raises ``ValueError``. Inputs on a
    GPU other than the current one run on their own GPU.
    """
    scalars = Scalars(rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value, sinkhorn_repeat, norm_eps)
    problem, lead = validate(
        x_prev, residual_prev, post_mix_prev, comb_mix_prev, fn, hc_scale, hc_base, norm_weight, scalars, precision
    )
    flat = None if out is None else flat_out(out, lead, problem.hidden, problem.x.device)
    if torch.compiler.is_compiling():
        s = problem.scalars
        args = (problem.x, problem.residual, problem.post_mix, problem.comb_mix, problem.fn, problem.hc_scale,
                problem.hc_base, problem.norm_weight, s.rms_eps, s.hc_pre_eps, s.hc_sinkhorn_eps,
                s.hc_post_mult_value, s.sinkhorn_repeat, s.norm_eps, backend, precision)
        if flat is not None:
            torch.ops.mhc_cute.fused_hc_out(*flat, *args)
            return MhcFusedHcOutput(*out)
        result = MhcFusedHcOutput(*torch.ops.mhc_cute.fused_hc(*args))
    else:
        # eager: call the implementation directly; the custom-op boundary costs host time per call
        result = _run(problem, backend, tactic, flat)
        if flat is not None:
            return MhcFusedHcOutput(*out)
    if len(lead) == 1:  # already [M, ...]
        return result
    h = problem.hidden
    return MhcFusedHcOutput(
        result.residual_cur.view(*lead, HC_MULT, h),
        result.post_mix_cur.view(*lead, HC_MULT, 1),
        result.comb_mix_cur.view(*lead, HC_MULT, HC_MULT),
        result.layer_input.view(*lead, h),
    )


# The op's inputs as the custom ops take them (flat tensors, then the scalars, the backend and the precision); one
# schema for both ops, the out= one first taking the four buffers it writes.
_OP_INPUTS = ("Tensor x, Tensor residual, Tensor post_mix, Tensor comb_mix, Tensor fn, Tensor hc_scale, "
              "Tensor hc_base, Tensor? norm_weight, float rms_eps, float hc_pre_eps, float hc_sinkhorn_eps, "
              "float hc_post_mult_value, int sinkhorn_repeat, float norm_eps, str backend, str precision")
torch.library.define("mhc_cute::fused_hc", f"({_OP_INPUTS}) -> (Tensor, Tensor, Tensor, Tensor)")
torch.library.define(
    "mhc_cute::fused_hc_out",
    f"(Tensor(a!) residual_cur, Tensor(b!) post_mix_cur, Tensor(c!) comb_mix_cur, Tensor(d!) layer_input, "
    f"{_OP_INPUTS}) -> ()",
)


def _run(problem: Problem, backend: str, tactic, out: MhcFusedHcOutput | None) -> MhcFusedHcOutput:
    """``_dispatch`` into fresh outputs (``out`` None) or the caller's flat buffers, checked against the problem's
    memory first (real tensors only: eager calls and the custom ops' bodies)."""
    if out is not None:
        check_out_memory(out, problem)
    return _dispatch(problem, backend, tactic, out)


def _run_op(out, x, residual, post_mix, comb_mix, fn, hc_scale, hc_base, norm_weight, *scalars_and_mode):
    """The body of the custom ops (real tensors, already flat): ``out`` None (fresh outputs) or the buffers."""
    *scalars, backend, precision = scalars_and_mode
    problem = Problem(x, residual, post_mix, comb_mix, fn, hc_scale, hc_base, norm_weight, Scalars(*scalars), precision)
    return _run(problem, backend, None, out)


@torch.library.impl("mhc_cute::fused_hc", "CompositeExplicitAutograd")
def _fused_hc_op(*args):
    return tuple(_run_op(None, *args))


@torch.library.register_fake("mhc_cute::fused_hc")
def _(x, *args):
    m, h = x.shape
    return (
        x.new_empty(m, HC_MULT, h),
        x.new_empty(m, HC_MULT, 1, dtype=torch.float32),
        x.new_empty(m, HC_MULT, HC_MULT, dtype=torch.float32),
        x.new_empty(m, h),
    )


@torch.library.impl("mhc_cute::fused_hc_out", "CompositeExplicitAutograd")
def _fused_hc_out_op(residual_cur, post_mix_cur, comb_mix_cur, layer_input, *args):
    """``mhc_fused_hc(..., out=...)`` under ``torch.compile``: writes the flat output buffers in place."""
    _run_op(MhcFusedHcOutput(residual_cur, post_mix_cur, comb_mix_cur, layer_input), *args)


@torch.library.register_fake("mhc_cute::fused_hc_out")
def _(*args):
    return None
