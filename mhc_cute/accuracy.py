"""The accuracy contract: inputs with DeepSeek-V4-like statistics and the float64 checks every backend passes.

Used by the tests and by ``mhc-cute check``.
"""

from __future__ import annotations

import math

import torch

from . import reference
from .api import mhc_fused_hc, mhc_fused_hc_delayed, run_once
from .problem import FORMS, V41_SCALARS, MhcFusedHcDelayedOutput, MhcFusedHcOutput, Problem, Scalars
from .reference import HC_MULT

BF16_MANTISSA_BITS = 7
FP32_SUM_ULPS = 8


def make_inputs(m: int, h: int, *, seed: int = 0, device="cpu", norm: bool = False, lead=None,
                form: str = "regular", pre: str | None = None) -> dict:
    """Random inputs with DeepSeek-V4-like statistics (mixes O(1), comb doubly stochastic), never zeros.

    ``form``: ``"regular"``, ``"no_post"`` (``x_prev``, ``post_mix_prev``, ``comb_mix_prev`` None) or
    ``"broadcast"`` (no post, ``residual_prev [..., H]``). ``pre``: None for ``mhc_fused_hc``'s arguments, else the
    delayed seam's ``pre_mix_prev``: ``"carried"`` (gates as a previous seam returns them) or ``"identity"`` (None).
    """
    if form not in FORMS or pre not in (None, "carried", "identity"):
        raise ValueError(f"make_inputs: form {form!r} (one of {FORMS}), pre {pre!r} (None, 'carried' or 'identity')")
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
    if pre is not None:
        carried = (torch.sigmoid(randn(m, 4)) + 1e-6).reshape(*lead, 4)
        inputs["pre_mix_prev"] = carried if pre == "carried" else None
    if form != "regular":
        inputs.update(x_prev=None, post_mix_prev=None, comb_mix_prev=None)
    if form == "broadcast":
        inputs["residual_prev"] = randn(*lead, h).bfloat16()
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}


def form_of(inputs: dict) -> str:
    """The seam form of a call's arguments: ``residual_prev [..., 4, H]`` without ``x_prev`` is the streams (no
    post), any other shape the broadcast entry's embedding."""
    if inputs["x_prev"] is not None:
        return "regular"
    res = inputs["residual_prev"]
    return "no_post" if res.dim() >= 3 and res.shape[-2] == HC_MULT else "broadcast"


def problem_of(inputs: dict, precision: str = "fp32", **scalars) -> Problem:
    """The flat problem of ``make_inputs``'s arguments: the delayed seam's (V4.1 scalars unless given) when they
    have ``pre_mix_prev``."""
    h = inputs["fn"].shape[1] // 4
    res = inputs["residual_prev"]
    broadcast = form_of(inputs) == "broadcast"
    m = res.numel() // (h if broadcast else 4 * h)
    delayed = "pre_mix_prev" in inputs

    def flat(t, *shape):
        return None if t is None else t.reshape(*shape).contiguous()

    return Problem(
        flat(inputs["x_prev"], m, h),
        flat(res, m, h) if broadcast else flat(res, m, 4, h),
        flat(inputs["post_mix_prev"], m, 4),
        flat(inputs["comb_mix_prev"], m, 4, 4),
        inputs["fn"], inputs["hc_scale"], inputs["hc_base"], inputs["norm_weight"],
        Scalars(**scalars) if scalars or not delayed else V41_SCALARS, precision,
        flat(inputs.get("pre_mix_prev"), m, 4), delayed,
    )


def poisoned_outputs(problem: Problem, lead=None) -> MhcFusedHcOutput | MhcFusedHcDelayedOutput:
    """Output buffers filled with NaN, so that an element a kernel fails to write fails the check: the flat ones a
    backend writes, or with ``lead`` those a call with these leading dims takes as ``out=`` (no post: residual_cur
    None)."""
    out = problem.empty_outputs()
    for t in out:
        if t is not None:
            t.fill_(float("nan"))
    if lead is not None:
        out = type(out)(*(None if t is None else t.view(*lead, *t.shape[1:]) for t in out))
    return out


def run_backend(problem: Problem, backend: str, tactic=None) -> MhcFusedHcOutput:
    return run_once(problem, backend, tactic, poisoned_outputs(problem))


def call_seam(inputs: dict, backend: str = "auto", **kw):
    """The seam whose arguments ``inputs`` are (``make_inputs``'s: the delayed seam when they have
    ``pre_mix_prev``), called on ``backend``."""
    return (mhc_fused_hc_delayed if "pre_mix_prev" in inputs else mhc_fused_hc)(**inputs, backend=backend, **kw)


def flat_outputs(out, inputs: dict):
    """What a public seam call on ``inputs`` (``make_inputs``'s, any leading dims) returned (``out``), flattened as
    ``check_outputs`` reads it; without a post ``residual_cur`` must be ``residual_prev`` itself (None here: the
    kernels write no residual)."""
    if form_of(inputs) == "no_post":
        assert out.residual_cur is inputs["residual_prev"], "residual_cur: not residual_prev itself (no post)"
        out = out._replace(residual_cur=None)
    h = out.layer_input.shape[-1]
    m = out.layer_input.numel() // h
    return type(out)(*(None if t is None else t.reshape(m, *t.shape[t.dim() - d:])
                       for t, d in zip(out, (2, 2, 2, 1, 1))))


def check_call(out, inputs: dict, backend: str = "torch", precision: str = "fp32", **scalars) -> dict:
    """``check_outputs`` for what a public seam call on ``inputs`` (``make_inputs``'s, any leading dims) returned
    (``out``; ``scalars``: the call's, as for ``problem_of``), at ``backend``'s tolerances (``"auto"``: the loosest
    it may resolve to); without a post ``residual_cur`` must be ``residual_prev`` itself."""
    backend = "half_mma" if backend == "auto" else backend
    return check_outputs(flat_outputs(out, inputs), problem_of(inputs, precision, **scalars),
                         **tolerances(backend, precision))


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
    out: MhcFusedHcOutput | MhcFusedHcDelayedOutput,
    problem: Problem,
    *,
    mix_tol: float = 1e-5,
    li_ulps: float = 1.0,
    li_normwise: float | None = None,
) -> dict:
    """Compare a backend's flattened outputs with the contract; raise AssertionError with the numbers if off.

    * residual_cur: bit-identical to the fp32 FMA chain of SPEC step 1 (broadcast entry: the 4 copies; no post:
      None, nothing written);
    * post_mix_cur, comb_mix_cur (and the delayed seam's pre_mix_cur): normwise relative error vs float64 <=
      ``mix_tol``;
    * layer_input of ``mhc_fused_hc``: within ``li_ulps`` bf16 ulp of the float64 result rounded to bf16,
      elementwise, plus the error bound of the 4-term collapse given pre gates as accurate as ``mix_tol`` allows
      and fp32 arithmetic (it shows only where the terms cancel), plus one ulp where a float64 value sits within
      that bound of a bf16 rounding boundary (propagated through the norm when fused); or,
      when ``li_normwise`` is given (tf32 precision), normwise relative error <= ``li_normwise``;
    * layer_input of the delayed seam: bit-identical to the fp32 FMA chain of its collapse (step 3) without a norm;
      with the norm, within ``li_ulps`` bf16 ulp of the float64 norm of that collapse (plus one where the float64
      value sits near a rounding boundary).
    Every output must be finite (outputs are poisoned with NaN before the run). Checked in chunks of rows (the
    contract is per token; the normwise errors sum over every row), so that the float64 reference fits any M.
    """
    for name, t in zip(out._fields, out):
        if t is not None:
            assert torch.isfinite(t.float()).all(), f"{name}: non-finite values (unwritten or broken)"
    no_post = problem.x is None and not problem.broadcast
    if no_post:
        assert out.residual_cur is None, "residual_cur: a seam without post writes no residual"
    tally = _Tally()
    for rows in reference.row_chunks(problem.m, problem.hidden, CHECK_ELEMENTS):
        part = problem._replace(**{k: getattr(problem, k)[rows] for k in TOKEN_FIELDS
                                   if getattr(problem, k) is not None})
        part_out = type(out)(*(None if t is None else t[rows] for t in out))
        residual_cur = part.residual if no_post else part_out.residual_cur
        if not no_post:
            res_ref = reference.streams(part.x, part.residual, part.post_mix, part.comb_mix)
            tally.add("residual_cur", (residual_cur.view(torch.int16) != res_ref.view(torch.int16)).sum().item())
        if problem.delayed:
            _tally_delayed_rows(part_out, part, residual_cur, li_ulps, tally)
        else:
            _tally_rows(part_out, part, residual_cur, mix_tol, li_ulps, li_normwise, tally)
    assert tally.count.get("residual_cur", 0) == 0, \
        f"residual_cur: {tally.count['residual_cur']} elements differ bitwise from the fp32 FMA chain"
    gates = ("post_mix", "comb_mix", "pre_mix") if problem.delayed else ("post_mix", "comb_mix")
    errs = {name: tally.normwise(name) for name in gates}
    for name in gates:
        assert errs[name] <= mix_tol, f"{name}_cur normwise error {errs[name]:.3e} > {mix_tol:.0e}"
    if not problem.delayed:
        errs["layer_input_normwise"] = tally.normwise("layer_input")
        if li_normwise is not None:
            assert errs["layer_input_normwise"] <= li_normwise, f"layer_input normwise error {errs}"
            return errs
    if problem.delayed and problem.norm_weight is None:
        bad = tally.count.get("layer_input", 0)
        assert bad == 0, f"layer_input: {bad} elements differ bitwise from the fp32 FMA chain of the collapse"
        return errs
    errs["layer_input_max_ulps"] = tally.top.get("layer_input_ulps", 0.0)
    bad = tally.count.get("layer_input", 0)
    assert bad == 0, f"layer_input: {bad} elements beyond {li_ulps} bf16 ulp (max {errs['layer_input_max_ulps']})"
    return errs


TOKEN_FIELDS = ("x", "residual", "post_mix", "comb_mix", "pre_mix")  # the fields of a Problem with a row per token


class _Tally:
    """``check_outputs``'s sums over its chunks of rows: squared norms (of differences and of references) for the
    normwise errors, counts of elements off the contract, and maxima."""

    def __init__(self):
        self.squares: dict = {}
        self.count: dict = {}
        self.top: dict = {}

    def norms(self, name: str, a: torch.Tensor, ref: torch.Tensor) -> None:
        d, r = a.double() - ref.double(), ref.double()
        diff, size = self.squares.get(name, (0.0, 0.0))
        self.squares[name] = (diff + (d * d).sum().item(), size + (r * r).sum().item())

    def normwise(self, name: str) -> float:
        diff, size = self.squares.get(name, (0.0, 0.0))
        return math.sqrt(diff) / max(math.sqrt(size), 1e-300)

    def add(self, name: str, n: int) -> None:
        self.count[name] = self.count.get(name, 0) + n

    def max(self, name: str, v: float) -> None:
        self.top[name] = max(self.top.get(name, 0.0), v)


def _tally_rows(out, problem, residual_cur, mix_tol, li_ulps, li_normwise, tally) -> None:
    """``check_outputs`` of ``mhc_fused_hc`` on one chunk of rows, after ``residual_cur``: tallies only."""
    s = problem.scalars
    post64, comb64, li64 = reference.pre(
        residual_cur, problem.fn, problem.hc_scale, problem.hc_base, norm_weight=problem.norm_weight,
        broadcast=problem.broadcast, compute_dtype=torch.float64, **s.as_kwargs(),
    )
    tally.norms("post_mix", out.post_mix_cur, post64)
    tally.norms("comb_mix", out.comb_mix_cur, comb64)
    tally.norms("layer_input", out.layer_input, li64)
    if li_normwise is not None:
        return
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
    xf, fn = _projection64(residual_cur, problem)
    mix64 = _mixes64(residual_cur, problem)
    gate_err = _gate_error(xf, fn[:4], mix64, problem.hc_scale[0], s.rms_eps, mix_tol)
    pre64 = torch.sigmoid(mix64[:, :4]) + s.hc_pre_eps
    bad, max_ulps = _layer_input_error(out.layer_input, li64, residual_cur, pre64, gate_err, problem.norm_weight,
                                       s.norm_eps, li_ulps)
    tally.add("layer_input", bad)
    tally.max("layer_input_ulps", max_ulps)


def _gate_error(xf, pre_fn, mix64, pre_scale, rms_eps, mix_tol) -> torch.Tensor:
    """``[M, 1]``: how far a backend's pre gates may lie from float64 (the mixes ``mix64`` within ``mix_tol``
    normwise, plus the projection's fp32 rounding, see ``check_outputs``); ``xf [M, K]`` and ``pre_fn [4, K]``:
    the projection's operands in float64 (``_projection64``)."""
    rstd64 = torch.rsqrt((xf * xf).mean(-1, keepdim=True) + rms_eps)
    dot_scale = (xf.abs() @ pre_fn.abs().t()) * rstd64 * pre_scale.double().abs()
    mix_err = mix_tol * mix64.norm(dim=1, keepdim=True) + xf.shape[1] ** 0.5 * 2.0**-24 * dot_scale
    return 0.25 * mix_err  # |sigmoid'| <= 1/4


def _check_layer_input(li, li64, residual_cur, pre64, gate_err, norm_weight, norm_eps, li_ulps, errs) -> dict:
    """``li``: within ``li_ulps`` bf16 ulp of ``li64`` plus the collapse's error bound (``_layer_input_error``); adds
    ``layer_input_max_ulps`` to ``errs`` and returns it."""
    bad, errs["layer_input_max_ulps"] = _layer_input_error(li, li64, residual_cur, pre64, gate_err, norm_weight,
                                                           norm_eps, li_ulps)
    assert bad == 0, f"layer_input: {bad} elements beyond {li_ulps} bf16 ulp (max {errs['layer_input_max_ulps']})"
    return errs


def _layer_input_error(li, li64, residual_cur, pre64, gate_err, norm_weight, norm_eps, li_ulps) -> tuple[int, float]:
    """How many elements of ``li`` lie beyond ``li_ulps`` bf16 ulp of ``li64`` plus the collapse's error bound
    (gates ``pre64`` off by up to ``gate_err``, fp32 sums) and a rounding flip near a bf16 boundary (see
    ``check_outputs``), and the largest error in ulps."""
    res = residual_cur.double()
    terms = pre64[:, :, None] * res
    collapse64 = terms.sum(1)
    collapse_err = FP32_SUM_ULPS * 2.0**-24 * terms.abs().sum(1) + (gate_err[:, :, None] * res.abs()).sum(1)
    flip = near_bf16_midpoint(collapse64, collapse_err).double()
    ulp = torch.maximum(bf16_ulp(li64), bf16_ulp(li))  # the coarser one where they straddle a binade
    if norm_weight is None:
        allowed = (li_ulps + flip) * ulp + collapse_err
    else:
        li_pre = collapse64.bfloat16().double()
        mean_sq = (li_pre * li_pre).mean(-1, keepdim=True) + norm_eps
        gain = torch.rsqrt(mean_sq) * norm_weight.double().abs()
        final_flip = near_bf16_midpoint(li_pre * gain).double()
        pre_err = collapse_err + flip * bf16_ulp(collapse64)
        # the row's rms is taken over the erring collapse: to first order its relative error is
        # sum|x| err / (H mean_sq), and it scales the whole row (an outlier channel's flip moves every element)
        row_err = (li_pre.abs() * pre_err).mean(-1, keepdim=True) / mean_sq
        allowed = (li_ulps + final_flip) * ulp + pre_err * gain + row_err * li64.double().abs()
    err = (li.double() - li64.double()).abs()
    return (err > allowed).sum().item(), (err / ulp).max().item() if err.numel() else 0.0


def _tally_delayed_rows(out, problem, residual_cur, li_ulps, tally) -> None:
    """``check_outputs`` of the delayed seam on one chunk of rows, after ``residual_cur``: the gates, then
    ``layer_input`` (bitwise without a norm); tallies only."""
    s = problem.scalars
    pre64, post64, comb64 = reference.gates(
        residual_cur, problem.fn, problem.hc_scale, problem.hc_base, broadcast=problem.broadcast,
        compute_dtype=torch.float64, **{k: v for k, v in s.as_kwargs().items() if k != "norm_eps"},
    )
    tally.norms("post_mix", out.post_mix_cur, post64[:, :, None])
    tally.norms("comb_mix", out.comb_mix_cur, comb64)
    tally.norms("pre_mix", out.pre_mix_cur, pre64)
    x1 = reference.collapse_carried(residual_cur, problem.pre_mix)
    if problem.norm_weight is None:
        tally.add("layer_input", (out.layer_input.view(torch.int16) != x1.view(torch.int16)).sum().item())
        return
    x1f = x1.double()
    li64 = x1f * torch.rsqrt((x1f * x1f).mean(-1, keepdim=True) + s.norm_eps) * problem.norm_weight.double()
    ulp = torch.maximum(bf16_ulp(li64), bf16_ulp(out.layer_input))
    allowed = (li_ulps + near_bf16_midpoint(li64).double()) * ulp
    err = (out.layer_input.double() - li64.bfloat16().double()).abs()
    tally.max("layer_input_ulps", (err / ulp).max().item() if err.numel() else 0.0)
    tally.add("layer_input", (err > allowed).sum().item())


def _projection64(residual_cur, problem):
    """The projection's operands in float64: ``([M, K] rows, [24, K] weight)``, K = 4H, or H with ``fn``
    summed over the streams for the broadcast entry."""
    if problem.broadcast:
        return residual_cur[:, 0].double(), reference.broadcast_fn(problem.fn).double()
    return residual_cur.flatten(1).double(), problem.fn.double()


def _mixes64(residual_cur, problem):
    if problem.broadcast:
        residual_cur, fn = residual_cur[:, :1], reference.broadcast_fn(problem.fn)
    else:
        fn = problem.fn
    return reference.mixes(residual_cur, fn, problem.hc_scale, problem.hc_base, problem.scalars.rms_eps,
                           torch.float64)


def tolerances(backend: str, precision: str) -> dict:
    """The contract's tolerances for ``backend`` at ``precision`` (keyword arguments of ``check_outputs``)."""
    if backend in ("half_mma", "all_mma"):
        return dict(mix_tol=2e-5) if precision == "fp32" else dict(mix_tol=1e-3, li_normwise=1e-2)
    return dict(mix_tol=1e-5)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bits of a bf16 or fp32 tensor (int16 or int32), for bitwise comparisons that see NaN payloads."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


def same_bits(a: MhcFusedHcOutput, b: MhcFusedHcOutput) -> bool:
    """Whether two sets of outputs are bit-for-bit identical (None, an unwritten residual, matches None)."""
    return all((x is None and y is None) or (x is not None and y is not None and torch.equal(bits(x), bits(y)))
               for x, y in zip(a, b))


def gpu_nan(dtype: torch.dtype) -> torch.Tensor:
    """NaN as an NVIDIA GPU computes it, every mantissa bit set (0x7FFFFFFF in fp32, 0x7FFF in bf16): a rounding done
    on the bits can carry its payload into the sign or the exponent (zero, or an infinity), where the quiet NaN that
    torch writes (``float("nan")``, 0x7FC00000) survives. The value the non-finite tests poison with."""
    if dtype == torch.bfloat16:
        return torch.tensor(0x7FFF, dtype=torch.int16).view(torch.bfloat16)
    return torch.tensor(0x7FFFFFFF, dtype=torch.int32).view(dtype)


def check_poisoned_token(out, clean, problem: Problem, token: int) -> None:
    """The non-finite policy for a NaN or infinity in the activations of one token (``x``, ``residual``,
    ``post_mix``, ``comb_mix`` or the delayed seam's carried ``pre_mix`` of ``problem``, flattened; any seam form), on
    the flat outputs ``out`` (no post: ``residual_cur`` None) against ``clean``, the same call without it: every other
    token's outputs are ``clean``'s bit for bit; the token's ``residual_cur`` is the fp32 FMA chain of SPEC step 1 (the
    entry forms: the streams as given, 4 copies of the embedding) with NaN exactly where the chain gives NaN, the same
    bits elsewhere, infinities included. Where that value is non-finite, its RMS and projection see it: the token's
    gates (``post_mix_cur``, ``comb_mix_cur``, ``pre_mix_cur``) are NaN, and so is ``mhc_fused_hc``'s ``layer_input``
    (its collapse takes those gates). The delayed seam's ``layer_input`` is its collapse with the carried gates as
    IEEE arithmetic gives it: NaN where the fp32 FMA chain of the collapse is NaN, the chain's bits elsewhere; with the
    norm the row's rms is not finite, and each element is NaN or the fp32 reference's value (a zero or an infinity).
    Raises AssertionError naming what is off."""
    others = torch.arange(problem.m, device=problem.residual.device) != token
    for name, a, b in zip(out._fields, out, clean):
        if a is None and b is None:  # no post: residual_cur not written
            continue
        assert torch.equal(bits(a[others]), bits(b[others])), f"{name}: a token other than {token} changed"
    one = slice(token, token + 1)

    def row(t):
        return None if t is None else t[one]

    want = reference.streams(row(problem.x), problem.residual[one], row(problem.post_mix), row(problem.comb_mix))
    pre = row(problem.pre_mix) if problem.delayed else None
    streams_finite = bool(torch.isfinite(want).all())
    assert not streams_finite or (pre is not None and not torch.isfinite(pre).all()), \
        "the poisoned value reaches no output (not a non-finite input?)"
    if out.residual_cur is not None:
        _check_nonfinite_row("residual_cur", out.residual_cur[token], want[0])
    if not streams_finite:
        gates = ("post_mix_cur", "comb_mix_cur") + (("pre_mix_cur",) if problem.delayed else ("layer_input",))
        for name in gates:
            assert getattr(out, name)[token].isnan().all(), f"{name}: not NaN in the poisoned token {token}"
    if problem.delayed:
        li = reference.collapse_carried(want, pre)
        if problem.norm_weight is not None:
            li = reference.rms_norm(li, problem.norm_weight, problem.scalars.norm_eps, torch.float32)
        if problem.norm_weight is None:
            _check_nonfinite_row("layer_input", out.layer_input[token], li[0])
        else:  # the rms of a non-finite row: rsqrt(inf) is 0 in torch, NaN after the kernels' Newton step
            got, want = out.layer_input[token], li[0]
            assert got[want.isnan()].isnan().all(), "layer_input: not NaN where the reference gives NaN"
            keep = ~got.isnan()
            assert torch.equal(got[keep], want[keep]), "layer_input: neither NaN nor the reference's value"


def _check_nonfinite_row(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """``got``: NaN exactly where ``want`` is, elsewhere ``want``'s bits."""
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan), f"{name}: NaN elsewhere than where the reference gives NaN"
    assert torch.equal(bits(got[~nan]), bits(want[~nan])), f"{name}: differs from the reference where it is not NaN"


def check_backend(problem: Problem, backend: str, tactic=None) -> dict:
    """Run ``backend`` twice on ``problem`` (outputs poisoned), check the contract and that the two runs are
    bit-identical; return the errors of ``check_outputs``, raise AssertionError with the first failure."""
    first = run_backend(problem, backend, tactic)
    errs = check_outputs(first, problem, **tolerances(backend, problem.precision))
    again = run_backend(problem, backend, tactic)
    for name, a, b in zip(first._fields, first, again):
        assert same_bits((a,), (b,)), f"{name} differs between two runs"
    return errs


def failure_of(problem: Problem, backend: str, tactic=None) -> str | None:
    """None if ``check_backend`` passes, else its first failure line (for sweeps that report, not raise)."""
    try:
        check_backend(problem, backend, tactic)
    except AssertionError as e:
        return str(e).splitlines()[0][:200]
    return None


# --- the standalone ops (``mhc_cute.ops``) --------------------------------------------------------------------

STANDALONE_OPS = ("mhc_post", "mhc_collapse", "mhc_head")


def make_op_inputs(op: str, m: int, h: int, *, seed: int = 0, device="cpu", norm: bool = False, lead=None) -> dict:
    """Keyword inputs of a standalone op, drawn as ``make_inputs`` draws the delayed seam's (``op_inputs_of``)."""
    return op_inputs_of(op, make_inputs(m, h, seed=seed, device=device, norm=norm, lead=lead, pre="carried"))


def op_inputs_of(op: str, s: dict) -> dict:
    """A standalone op's keyword inputs from a delayed seam's (``make_inputs(..., pre="carried")``): the head weight
    is the seam weight's pre rows; the carried gates of ``mhc_collapse`` are the seam's ``pre_mix_prev``."""
    if op == "mhc_post":
        return dict(x=s["x_prev"], residual=s["residual_prev"], post_mix=s["post_mix_prev"],
                    comb_mix=s["comb_mix_prev"])
    if op == "mhc_collapse":
        return dict(residual=s["residual_prev"], pre_mix=s["pre_mix_prev"], norm_weight=s["norm_weight"])
    if op == "mhc_head":
        return dict(residual=s["residual_prev"], head_fn=s["fn"][:HC_MULT].contiguous(),
                    head_scale=s["hc_scale"][:1].clone(), head_base=s["hc_base"][:HC_MULT].clone(),
                    norm_weight=s["norm_weight"])
    raise ValueError(f"unknown op {op!r}; one of {STANDALONE_OPS}")


def call_op(op: str, inputs: dict, backend: str = "auto", out=None, **kw) -> torch.Tensor:
    from . import ops

    return getattr(ops, op)(**inputs, backend=backend, out=out, **kw)


def op_output_like(op: str, inputs: dict) -> torch.Tensor:
    """A NaN-filled output buffer of ``op`` (an element a kernel fails to write fails the check)."""
    res = inputs["residual"]
    shape = res.shape if op == "mhc_post" else res.shape[:-2] + res.shape[-1:]
    return torch.full(shape, float("nan"), dtype=torch.bfloat16, device=res.device)


def check_op_output(op: str, out: torch.Tensor, inputs: dict, *, mix_tol: float = 1e-5, li_ulps: float = 1.0,
                    **scalars) -> dict:
    """The contract of a standalone op on its output ``out`` (``scalars``: the op's keyword scalars as called):
    ``mhc_post`` bit-identical to SPEC step 1's fp32 FMA chain; ``mhc_collapse`` and ``mhc_head`` within the
    layer_input bound of ``check_outputs`` against float64 (exact gates for ``mhc_collapse``; for ``mhc_head`` gates
    from mixes within ``mix_tol``). Raise AssertionError with the numbers if off; return the errors."""
    res = inputs["residual"]
    h = res.shape[-1]
    m = res.numel() // (HC_MULT * h)
    lead = res.dim() - 2
    flat = {k: (v.reshape(m, *v.shape[lead:]) if isinstance(v, torch.Tensor) and k != "norm_weight"
                and not k.startswith("head_") else v) for k, v in inputs.items()}
    out = out.reshape(m, *out.shape[lead:])
    assert torch.isfinite(out.float()).all(), f"{op}: non-finite values (unwritten or broken)"
    # the ops are row-wise: checked in chunks of rows, so that the float64 reference fits any M
    errs: dict = {}
    for chunk in reference.row_chunks(m, h, CHECK_ELEMENTS):
        rows = {k: (v[chunk] if isinstance(v, torch.Tensor) and v.shape[:1] == (m,) and k != "norm_weight"
                    and not k.startswith("head_") else v) for k, v in flat.items()}
        for k, v in _check_op_rows(op, out[chunk], rows, mix_tol, li_ulps, **scalars).items():
            errs[k] = max(errs.get(k, 0), v)
    return errs


CHECK_ELEMENTS = 1 << 24  # residual elements per chunk of ``check_op_output`` (a few float64 temporaries of each)


def _check_op_rows(op: str, out: torch.Tensor, inputs: dict, mix_tol: float, li_ulps: float, **scalars) -> dict:
    """``check_op_output`` on flat rows."""
    flat_res = inputs["residual"]
    m, _, h = flat_res.shape
    if op == "mhc_post":
        want = reference.post(inputs["x"].reshape(m, h), flat_res, inputs["post_mix"].reshape(m, HC_MULT),
                              inputs["comb_mix"].reshape(m, HC_MULT, HC_MULT))
        mism = (out.reshape(m, HC_MULT, h).view(torch.int16) != want.view(torch.int16)).sum().item()
        assert mism == 0, f"mhc_post: {mism} elements differ bitwise from the fp32 FMA chain"
        return {"mismatches": mism}
    li = out.reshape(m, h)
    norm_weight = inputs.get("norm_weight")
    norm_eps = scalars.get("norm_eps", 1e-20 if op == "mhc_collapse" else 1e-6)
    errs: dict = {}
    if op == "mhc_collapse":
        pre64 = inputs["pre_mix"].reshape(m, HC_MULT).double()
        li64 = reference.collapse_norm(flat_res, pre64, norm_weight=norm_weight, norm_eps=norm_eps,
                                       compute_dtype=torch.float64)
        gate_err = torch.zeros(m, 1, dtype=torch.float64, device=flat_res.device)
    else:
        rms_eps, hc_eps = scalars.get("rms_eps", 1e-6), scalars.get("hc_eps", 1e-6)
        head = (inputs["head_fn"], inputs["head_scale"], inputs["head_base"])
        mix64 = reference.head_mixes(flat_res, *head, rms_eps, torch.float64)
        pre64 = torch.sigmoid(mix64) + hc_eps
        gate_err = _gate_error(flat_res.flatten(1).double(), inputs["head_fn"].double(), mix64, inputs["head_scale"][0],
                               rms_eps, mix_tol)
        li64 = reference.head(flat_res, *head, rms_eps=rms_eps, hc_eps=hc_eps, norm_weight=norm_weight,
                              norm_eps=norm_eps, compute_dtype=torch.float64)
    return _check_layer_input(li, li64, flat_res, pre64, gate_err, norm_weight, norm_eps, li_ulps, errs)


def op_tolerances(op: str, backend: str) -> dict:
    """The contract's tolerances for a standalone op on ``backend`` (keyword arguments of ``check_op_output``):
    mhc_head's "seam" backend (and "auto", which may resolve to it) runs on the seam's auto pick, an MMA path."""
    return tolerances("half_mma", "fp32") if op == "mhc_head" and backend in ("seam", "auto") else {}


def check_op(op: str, inputs: dict, backend: str, **scalars) -> dict:
    """Run ``op`` on ``backend`` twice into NaN-poisoned ``out=`` buffers, check the contract
    (``check_op_output``) and that the two runs are bit-identical; return the errors."""
    first = call_op(op, inputs, backend, op_output_like(op, inputs), **scalars)
    errs = check_op_output(op, first, inputs, **op_tolerances(op, backend), **scalars)
    again = call_op(op, inputs, backend, op_output_like(op, inputs), **scalars)
    assert torch.equal(bits(first), bits(again)), f"{op}: output differs between two runs"
    return errs
