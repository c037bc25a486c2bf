"""The public op: ``mhc_fused_hc`` (drop-in), and its ``torch.library`` registration for ``torch.compile``."""

from __future__ import annotations

import torch

from . import autotune, backends
from .problem import MhcFusedHcOutput, Problem, Scalars, validate
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
    backends.BACKENDS[backend].load()(problem, tactic, out)
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
) -> MhcFusedHcOutput:
    """The mHC boundary op: post of the previous sublayer fused with pre of the next (``../shared/SPEC.md``).

    Shapes: ``x_prev [..., H]`` bf16, ``residual_prev [..., 4, H]`` bf16, ``post_mix_prev [..., 4(, 1)]`` fp32,
    ``comb_mix_prev [..., 4, 4]`` (or ``[..., 16]``) fp32, ``fn [24, 4H]`` fp32, ``hc_scale [3]`` fp32,
    ``hc_base [24]`` fp32, ``norm_weight [H]`` bf16/fp32 or None. Returns ``MhcFusedHcOutput(residual_cur
    [..., 4, H] bf16, post_mix_cur [..., 4, 1] fp32, comb_mix_cur [..., 4, 4] fp32, layer_input [..., H] bf16)``;
    outputs are fresh tensors. Non-contiguous or misaligned (not 16-byte) inputs are copied first.

    ``backend``: ``"auto"`` (tuned choice for this GPU, the reference on a CPU), ``"torch"``, ``"triton"``,
    ``"half_fma"``, ``"all_fma"``, ``"half_mma"``, ``"all_mma"``. ``precision``: ``"fp32"`` (fp32-accurate
    projection) or ``"tf32"`` (allows a single-TF32 projection on the MMA paths; other backends stay fp32).
    ``tactic``: a tactic object or name for the chosen backend (advanced; None lets the backend choose).
    """
    scalars = Scalars(rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value, sinkhorn_repeat, norm_eps)
    problem, lead = validate(
        x_prev, residual_prev, post_mix_prev, comb_mix_prev, fn, hc_scale, hc_base, norm_weight, scalars, precision
    )
    if torch.compiler.is_compiling():
        s = problem.scalars
        out = torch.ops.mhc_cute.fused_hc(
            problem.x, problem.residual, problem.post_mix, problem.comb_mix, problem.fn, problem.hc_scale,
            problem.hc_base, problem.norm_weight, s.rms_eps, s.hc_pre_eps, s.hc_sinkhorn_eps,
            s.hc_post_mult_value, s.sinkhorn_repeat, s.norm_eps, backend, precision,
        )
        out = MhcFusedHcOutput(*out)
    else:
        # eager: call the implementation directly; the custom-op boundary costs host time per call
        out = _dispatch(problem, backend, tactic)
    if len(lead) == 1:  # already [M, ...]
        return out
    h = problem.hidden
    return MhcFusedHcOutput(
        out.residual_cur.view(*lead, HC_MULT, h),
        out.post_mix_cur.view(*lead, HC_MULT, 1),
        out.comb_mix_cur.view(*lead, HC_MULT, HC_MULT),
        out.layer_input.view(*lead, h),
    )


@torch.library.custom_op("mhc_cute::fused_hc", mutates_args=())
def _fused_hc_op(
    x: torch.Tensor,
    residual: torch.Tensor,
    post_mix: torch.Tensor,
    comb_mix: torch.Tensor,
    fn: torch.Tensor,
    hc_scale: torch.Tensor,
    hc_base: torch.Tensor,
    norm_weight: torch.Tensor | None,
    rms_eps: float,
    hc_pre_eps: float,
    hc_sinkhorn_eps: float,
    hc_post_mult_value: float,
    sinkhorn_repeat: int,
    norm_eps: float,
    backend: str,
    precision: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    problem = Problem(
        x, residual, post_mix, comb_mix, fn, hc_scale, hc_base, norm_weight,
        Scalars(rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value, sinkhorn_repeat, norm_eps), precision,
    )
    return tuple(_dispatch(problem, backend))


@_fused_hc_op.register_fake
def _(x, residual, post_mix, comb_mix, fn, hc_scale, hc_base, norm_weight, *args):
    m, h = x.shape
    return (
        x.new_empty(m, HC_MULT, h),
        x.new_empty(m, HC_MULT, 1, dtype=torch.float32),
        x.new_empty(m, HC_MULT, HC_MULT, dtype=torch.float32),
        x.new_empty(m, h),
    )
