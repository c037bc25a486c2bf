"""The accuracy contract: inputs with DeepSeek-V4-like statistics and the float64 checks every backend passes.

Used by the tests and by ``mhc-cute check``.
"""

from __future__ import annotations

import math

import torch

from . import reference
from .api import _dispatch
from .problem import MhcFusedHcOutput, Problem, Scalars

BF16_MANTISSA_BITS = 7
FP32_SUM_ULPS = 8


def make_inputs(m: int, h: int, *, seed: int = 0, device="cpu", norm: bool = False, lead=None) -> dict:
    """Random inputs with DeepSeek-V4-like statistics (mixes O(1), comb doubly stochastic), never zeros."""
    g = torch.Generator().manual_seed(seed)
    lead = (m,) if lead is None else tuple(lead)
    m = math.prod(lead)

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    comb = reference.sinkhorn(randn(m, 4, 4), 1e-6, 20)
    inputs = dict(
        x_prev=randn(*lead, h).bfloat16(),
        residual_prev=randn(*lead, 4, h).bfloat16(),
        post_mix_prev=(torch.sigmoid(randn(m, 4)) * 2).reshape(*lead, 4, 1),
        comb_mix_prev=comb.reshape(*lead, 4, 4),
        fn=randn(24, 4 * h) / math.sqrt(4 * h),
        hc_scale=torch.rand(3, generator=g) + 0.5,
        hc_base=randn(24) * 0.5,
        norm_weight=(1 + 0.1 * randn(h)).bfloat16() if norm else None,
    )
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}


def problem_of(inputs: dict, precision: str = "fp32", **scalars) -> Problem:
    m = inputs["x_prev"].numel() // inputs["x_prev"].shape[-1]
    h = inputs["x_prev"].shape[-1]
    return Problem(
        inputs["x_prev"].reshape(m, h).contiguous(),
        inputs["residual_prev"].reshape(m, 4, h).contiguous(),
        inputs["post_mix_prev"].reshape(m, 4).contiguous(),
        inputs["comb_mix_prev"].reshape(m, 4, 4).contiguous(),
        inputs["fn"], inputs["hc_scale"], inputs["hc_base"], inputs["norm_weight"],
        Scalars(**scalars), precision,
    )


def poisoned_outputs(problem: Problem) -> MhcFusedHcOutput:
    """Output buffers filled with NaN, so that an element a kernel fails to write fails the check."""
    out = problem.empty_outputs()
    for t in out:
        t.fill_(float("nan"))
    return out


def run_backend(problem: Problem, backend: str, tactic=None) -> MhcFusedHcOutput:
    return _dispatch(problem, backend, tactic, poisoned_outputs(problem))


def normwise(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-300)).item()


def bf16_ulp(v: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 numbers at |v| (float64)."""
    mag = v.double().abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
    return torch.exp2(torch.floor(torch.log2(mag)) - BF16_MANTISSA_BITS)


def near_bf16_midpoint(v: torch.Tensor, slack=0.0, frac: float = 0.02) -> torch.Tensor:
    """Elements whose float64 value lies within ``frac`` ulp + ``slack`` of a bf16 rounding boundary."""
    v = v.double()
    ulp = bf16_ulp(v)
    pos = (v.abs() / ulp) % 1.0
    return (pos - 0.5).abs() * ulp < frac * ulp + slack


def check_outputs(
    out: MhcFusedHcOutput,
    problem: Problem,
    *,
    mix_tol: float = 1e-5,
    li_ulps: float = 1.0,
    li_normwise: float | None = None,
) -> dict:
    """Compare a backend's flattened outputs with the contract; raise AssertionError with the numbers if off.

    * residual_cur: bit-identical to the fp32 FMA chain of SPEC step 1;
    * post_mix_cur, comb_mix_cur: normwise relative error vs float64 <= ``mix_tol``;
    * layer_input: within ``li_ulps`` bf16 ulp of the float64 result rounded to bf16, elementwise, plus the error
      bound of the 4-term collapse given pre gates as accurate as ``mix_tol`` allows and fp32 arithmetic (it
      shows only where the terms cancel), plus one ulp where a float64 value sits within that bound of a bf16
      rounding boundary (propagated through the norm when fused); or,
      when ``li_normwise`` is given (tf32 precision), normwise relative error <= ``li_normwise``.
    Every output must be finite (outputs are poisoned with NaN before the run).
    """
    for name, t in zip(out._fields, out):
        assert torch.isfinite(t.float()).all(), f"{name}: non-finite values (unwritten or broken)"
    res_ref = reference.post(problem.x, problem.residual, problem.post_mix, problem.comb_mix)
    mism = (out.residual_cur.view(torch.int16) != res_ref.view(torch.int16)).sum().item()
    assert mism == 0, f"residual_cur: {mism} elements differ bitwise from the fp32 FMA chain"

    s = problem.scalars
    post64, comb64, li64 = reference.pre(
        out.residual_cur, problem.fn, problem.hc_scale, problem.hc_base, norm_weight=problem.norm_weight,
        compute_dtype=torch.float64, **s.as_kwargs(),
    )
    errs = {
        "post_mix": normwise(out.post_mix_cur, post64),
        "comb_mix": normwise(out.comb_mix_cur, comb64),
        "layer_input_normwise": normwise(out.layer_input, li64),
    }
    assert errs["post_mix"] <= mix_tol, f"post_mix_cur normwise error {errs['post_mix']:.3e} > {mix_tol:.0e}"
    assert errs["comb_mix"] <= mix_tol, f"comb_mix_cur normwise error {errs['comb_mix']:.3e} > {mix_tol:.0e}"
    if li_normwise is not None:
        assert errs["layer_input_normwise"] <= li_normwise, f"layer_input normwise error {errs}"
        return errs
    # The float64 values at the two bf16 rounding points (after the collapse, after the norm). The collapse
    # sum_j pre[j] * res[j] is computed by a backend from its own pre gates, which the contract lets differ
    # from float64 as much as its mixes may (mix_tol, normwise; a gate moves by at most 1/4 of its mix), and
    # in fp32, exact to a few fp32 ulps of sum |terms|. Both are far below a bf16 ulp of the result except
    # where the terms cancel (an ill-conditioned element), so that error is allowed on top of the ulps; within
    # it of a rounding boundary an implementation may round the other way (one more ulp). With the fused norm,
    # such a flip moves li by one bf16 ulp of li, which the norm scales by r * |w|.
    # A pre mix computed in fp32 over K = 4H errs relative to sum_k |x_k fn_jk| (rstd- and scale-weighted), not
    # to its value: where the projection itself cancels, that exceeds mix_tol of the token's mixes. Seen on an
    # H200 with cuBLAS's fp32 GEMM (the torch backend) at M = 8192, H = 5120. sqrt(K) fp32 ulps of that sum
    # bound it in practice (a rounding-error random walk), and it is far below a bf16 ulp of layer_input
    # except where the collapse cancels too.
    mix64 = _mixes64(out.residual_cur, problem)
    pre64 = torch.sigmoid(mix64[:, :4]) + s.hc_pre_eps
    res = out.residual_cur.double()
    terms = pre64[:, :, None] * res
    collapse64 = terms.sum(1)
    xf = res.flatten(1)
    rstd64 = reference.rstd(out.residual_cur, s.rms_eps, torch.float64)[:, None]
    dot_scale = (xf.abs() @ problem.fn[:4].double().abs().t()) * rstd64 * problem.hc_scale[0].double().abs()
    mix_err = mix_tol * mix64.norm(dim=1, keepdim=True) + xf.shape[1] ** 0.5 * 2.0**-24 * dot_scale
    gate_err = 0.25 * mix_err  # |sigmoid'| <= 1/4
    collapse_err = FP32_SUM_ULPS * 2.0**-24 * terms.abs().sum(1) + (gate_err[:, :, None] * res.abs()).sum(1)
    flip = near_bf16_midpoint(collapse64, collapse_err).double()
    ulp = torch.maximum(bf16_ulp(li64), bf16_ulp(out.layer_input))  # the coarser one where they straddle a binade
    if problem.norm_weight is None:
        allowed = (li_ulps + flip) * ulp + collapse_err
    else:
        li_pre = collapse64.bfloat16().double()
        gain = torch.rsqrt((li_pre * li_pre).mean(-1, keepdim=True) + s.norm_eps) * problem.norm_weight.double().abs()
        final_flip = near_bf16_midpoint(li_pre * gain).double()
        allowed = (li_ulps + final_flip) * ulp + (collapse_err + flip * bf16_ulp(collapse64)) * gain
    err = (out.layer_input.double() - li64.double()).abs()
    errs["layer_input_max_ulps"] = (err / ulp).max().item() if err.numel() else 0.0
    bad = (err > allowed).sum().item()
    assert bad == 0, f"layer_input: {bad} elements beyond {li_ulps} bf16 ulp (max {errs['layer_input_max_ulps']})"
    return errs


def _mixes64(residual_cur, problem):
    return reference.mixes(residual_cur, problem.fn, problem.hc_scale, problem.hc_base,
                            problem.scalars.rms_eps, torch.float64)


def tolerances(backend: str, precision: str) -> dict:
    """The contract's tolerances for ``backend`` at ``precision`` (keyword arguments of ``check_outputs``)."""
    if backend in ("half_mma", "all_mma"):
        return dict(mix_tol=2e-5) if precision == "fp32" else dict(mix_tol=1e-3, li_normwise=1e-2)
    return dict(mix_tol=1e-5)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


def same_bits(a: MhcFusedHcOutput, b: MhcFusedHcOutput) -> bool:
    """Whether two sets of outputs are bit-for-bit identical."""
    return all(torch.equal(_bits(x), _bits(y)) for x, y in zip(a, b))


def gpu_nan(dtype: torch.dtype) -> torch.Tensor:
    """NaN as an NVIDIA GPU computes it, every mantissa bit set (0x7FFFFFFF in fp32, 0x7FFF in bf16): a rounding done
    on the bits can carry its payload into the sign or the exponent (zero, or an infinity), where the quiet NaN that
    torch writes (``float("nan")``, 0x7FC00000) survives. The value the non-finite tests poison with."""
    if dtype == torch.bfloat16:
        return torch.tensor(0x7FFF, dtype=torch.int16).view(torch.bfloat16)
    return torch.tensor(0x7FFFFFFF, dtype=torch.int32).view(dtype)


def check_poisoned_token(out: MhcFusedHcOutput, clean: MhcFusedHcOutput, problem: Problem, token: int) -> None:
    """The non-finite policy for a NaN or infinity in the activations of one token (``x``, ``residual``,
    ``post_mix`` or ``comb_mix`` of ``problem``, flattened), against ``clean``, the same call without it: every other
    token's outputs are ``clean``'s bit for bit; the token's ``residual_cur`` is the fp32 FMA chain of SPEC step 1
    (NaN exactly where the chain gives NaN, the same bits elsewhere, infinities included), and as its RMS and
    projection then see a non-finite value, its ``post_mix_cur``, ``comb_mix_cur`` and ``layer_input`` are NaN.
    Raises AssertionError naming what is off."""
    others = torch.arange(problem.m, device=problem.x.device) != token
    for name, a, b in zip(out._fields, out, clean):
        assert torch.equal(_bits(a[others]), _bits(b[others])), f"{name}: a token other than {token} changed"
    one = slice(token, token + 1)
    want = reference.post(problem.x[one], problem.residual[one], problem.post_mix[one], problem.comb_mix[one])[0]
    got = out.residual_cur[token]
    nan = want.isnan()
    assert not torch.isfinite(want).all(), "the poisoned value does not reach residual_cur (not a non-finite input?)"
    assert torch.equal(got.isnan(), nan), "residual_cur: NaN elsewhere than where the fp32 FMA chain gives NaN"
    assert torch.equal(_bits(got[~nan]), _bits(want[~nan])), "residual_cur: differs from the fp32 FMA chain"
    for name in ("post_mix_cur", "comb_mix_cur", "layer_input"):
        assert getattr(out, name)[token].isnan().all(), f"{name}: not NaN in the poisoned token {token}"


def check_backend(problem: Problem, backend: str, tactic=None) -> dict:
    """Run ``backend`` twice on ``problem`` (outputs poisoned), check the contract and that the two runs are
    bit-identical; return the errors of ``check_outputs``, raise AssertionError with the first failure."""
    first = run_backend(problem, backend, tactic)
    errs = check_outputs(first, problem, **tolerances(backend, problem.precision))
    again = run_backend(problem, backend, tactic)
    for name, a, b in zip(first._fields, first, again):
        assert torch.equal(_bits(a), _bits(b)), f"{name} differs between two runs"
    return errs


def failure_of(problem: Problem, backend: str, tactic=None) -> str | None:
    """None if ``check_backend`` passes, else its first failure line (for sweeps that report, not raise)."""
    try:
        check_backend(problem, backend, tactic)
    except AssertionError as e:
        return str(e).splitlines()[0][:200]
    return None
