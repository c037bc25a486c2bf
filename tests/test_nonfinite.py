"""The non-finite policy: NaN and infinities propagate as IEEE arithmetic through the SPEC's steps on every backend,
and tokens stay independent.

* a NaN or infinity in one token's activations: ``accuracy.check_poisoned_token`` (the other tokens' outputs bit for
  bit those of a clean call; the token's ``residual_cur`` the fp32 FMA chain; its mixes and ``layer_input`` NaN; the
  delayed seam's ``layer_input`` its collapse with the carried gates as IEEE arithmetic gives it), in every form of
  both seams (the carried gates ``pre_mix_prev`` poisoned too);
* a NaN in a weight reaches every token, in exactly the outputs that depend on it (the others keep their bits);
* an infinite weight saturates as IEEE says: the same NaN and infinity pattern as the torch reference.

NaN is written as a GPU computes it (``accuracy.gpu_nan``: a rounding done on the bits can turn that one into zero or
an infinity, where the quiet NaN torch writes survives).
"""

import itertools

import pytest
import torch
from helpers import (
    ACTIVATIONS, CPU_BACKENDS, KERNEL_BACKENDS, SEAM_BACKENDS, SEAM_VARIANTS, skip_unless_available, variant_id,
)

from mhc_cute.accuracy import (
    bits, call_seam, check_poisoned_token, flat_outputs, gpu_nan, make_inputs, problem_of,
)

# NaN and infinities are these tests' inputs: numpy (under Triton's interpreter) warning of them is expected
pytestmark = [pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")]

# where in a token each per-token input is poisoned (the broadcast entry's residual_prev: the embedding, [M, H])
AT = {"x_prev": (37,), "residual_prev": (2, 37), "post_mix_prev": (1, 0), "comb_mix_prev": (3, 1),
      "pre_mix_prev": (1,)}
AT_EMBEDDING = (37,)


def poison(inputs: dict, name: str, index: tuple, value: str) -> dict:
    """``inputs`` with ``inputs[name][index]`` set to ``value`` ("nan", "inf" or "-inf"), the rest shared."""
    t = inputs[name].clone()
    v = gpu_nan(t.dtype) if value == "nan" else torch.tensor(float(value), dtype=t.dtype)
    t[index] = v.to(t.device)
    return dict(inputs, **{name: t})


def run(backend, inputs, tactic=None):
    """The seam ``inputs`` are arguments of, on ``backend``: its outputs flat (no post: residual_cur None)."""
    return flat_outputs(call_seam(inputs, backend, tactic=tactic), inputs)


# --- one token -----------------------------------------------------------------------------------------------------

def check_token(backend, m, h, device, cases, norm=True, tactic=None, variant=SEAM_VARIANTS[0]):
    """For each (name, value, token) of ``cases``: that value at ``AT[name]`` of the token, against a clean call, in
    seam ``variant`` ((op, form, pre), ``helpers.SEAM_VARIANTS``)."""
    skip_unless_available(backend, device)
    _, form, pre = variant
    inputs = make_inputs(m, h, seed=m + h, device=device, norm=norm, form=form, pre=pre)
    clean = run(backend, inputs, tactic)
    for name, value, token in cases:
        at = AT_EMBEDDING if name == "residual_prev" and form == "broadcast" else AT[name]
        bad = poison(inputs, name, (token, *at), value)
        try:
            check_poisoned_token(run(backend, bad, tactic), clean, problem_of(bad), token)
        except AssertionError as e:
            raise AssertionError(f"{variant_id(variant)}: {name}[{token}, {at}] = {value}: {e}") from None


def variant_cases(variant, tokens) -> list:
    """(name, value, token): each per-token input of seam ``variant`` poisoned once, the values and ``tokens`` in
    turn."""
    _, form, pre = variant
    names = (ACTIVATIONS if form == "regular" else ("residual_prev",)) + (("pre_mix_prev",) if pre == "carried" else ())
    return [(n, v, t) for n, v, t in zip(names, itertools.cycle(("nan", "inf", "-inf")), itertools.cycle(tokens))]


@pytest.mark.parametrize("name", ACTIVATIONS)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_token_cpu(backend, name):
    check_token(backend, 3, 64, "cpu", [(name, "nan", 1), (name, "inf", 2), (name, "-inf", 0)])


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_token_without_norm_cpu(backend):
    check_token(backend, 3, 64, "cpu", [("residual_prev", "nan", 1), ("x_prev", "inf", 2)], norm=False)


# the other forms of mhc_fused_hc and every form of the delayed seam (the regular mhc_fused_hc: above)
VARIANTS = [v for v in SEAM_VARIANTS if v != SEAM_VARIANTS[0]]


# the interpreter takes a second a case: one norm setting per variant on Triton (without it where the carried gates
# make the delayed seam's layer_input a finite-where-it-can collapse, compared bit for bit)
CPU_VARIANT_CASES = [(b, v, norm) for b in CPU_BACKENDS for v in VARIANTS for norm in (False, True)
                     if b == "torch" or norm == (v[2] != "carried")]


@pytest.mark.parametrize("backend,variant,norm", CPU_VARIANT_CASES,
                         ids=[f"{b}-{variant_id(v)}-{norm}" for b, v, norm in CPU_VARIANT_CASES])
def test_token_variants_cpu(backend, variant, norm):
    check_token(backend, 3, 64, "cpu", variant_cases(variant, (1, 2, 0)), norm=norm, variant=variant)


@pytest.mark.parametrize("variant", [SEAM_VARIANTS[0], ("fused_hc", "no_post", None),
                                     ("fused_hc_delayed", "regular", "carried"),
                                     ("fused_hc_delayed", "broadcast", "carried")], ids=variant_id)
def test_the_token_check_fails_where_the_policy_does_not_hold(variant):
    """``check_poisoned_token`` passes the reference's outputs and fails each kind of departure from the policy, so
    that the checks above cannot pass vacuously."""
    _, form, pre = variant
    inputs = make_inputs(3, 64, seed=5, form=form, pre=pre)
    clean = run("torch", inputs)
    bad = poison(inputs, "residual_prev", (1, *(AT_EMBEDDING if form == "broadcast" else AT["residual_prev"])), "inf")
    out, problem = run("torch", bad), problem_of(bad)
    check_poisoned_token(out, clean, problem, 1)

    def changed(name, index, value=None):
        t = getattr(out, name).clone()
        if value is None:
            bits(t)[index] ^= 1
        else:
            t[index] = value
        return out._replace(**{name: t})

    departures = [(changed("post_mix_cur", (0, 2, 0)), "post_mix_cur: a token other than 1 changed"),
                  (changed("comb_mix_cur", (1, 3, 2), 0.25), "comb_mix_cur: not NaN in the poisoned token 1")]
    if out.residual_cur is not None:
        departures.append((changed("residual_cur", (1, 0, 5)), "residual_cur: differs from the reference"))
    if problem.delayed:
        departures += [(changed("pre_mix_cur", (1, 0), 0.5), "pre_mix_cur: not NaN"),
                       (changed("layer_input", (1, 5)), "layer_input: differs from the reference")]
    else:
        departures.append((changed("layer_input", (1, 5), 1.0), "layer_input: not NaN"))
    for broken, message in departures:
        with pytest.raises(AssertionError, match=message):
            check_poisoned_token(broken, clean, problem, 1)


# --- weights ---------------------------------------------------------------------------------------------------------

ALL = (Ellipsis,)
# (weight, index, value) -> {output: the elements that become NaN}; every other element keeps its clean bits
WEIGHT_NAN_CASES = [
    (("fn", (1, 77)), {"layer_input": ALL}),  # a pre column: the pre gate, then the whole collapse
    (("fn", (5, 200)), {"post_mix_cur": (slice(None), 1)}),  # a post column: that post gate
    (("fn", (13, 5)), {"comb_mix_cur": ALL}),  # a comb column: the Sinkhorn mixes all 16
    (("hc_scale", (0,)), {"layer_input": ALL}),
    (("hc_scale", (1,)), {"post_mix_cur": ALL}),
    (("hc_scale", (2,)), {"comb_mix_cur": ALL}),
    (("hc_base", (3,)), {"layer_input": ALL}),
    (("hc_base", (7,)), {"post_mix_cur": (slice(None), 3)}),
    (("hc_base", (23,)), {"comb_mix_cur": ALL}),
    (("norm_weight", (37,)), {"layer_input": (slice(None), 37)}),
]


def check_weight_nan(backend, m, h, device, tactic=None):
    skip_unless_available(backend, device)
    inputs = make_inputs(m, h, seed=m + h + 1, device=device, norm=True)
    clean = run(backend, inputs, tactic)
    for (weight, index), nan_at in WEIGHT_NAN_CASES:
        out = run(backend, poison(inputs, weight, index, "nan"), tactic)
        for name, got, want in zip(out._fields, out, clean):
            mask = torch.zeros_like(got, dtype=torch.bool)
            if name in nan_at:
                mask[nan_at[name]] = True
            where = f"NaN in {weight}{list(index)}: {name}"
            nan, kept = bool(got[mask].isnan().all()), torch.equal(bits(got[~mask]), bits(want[~mask]))
            assert nan, f"{where}: not NaN where it depends on the weight"
            assert kept, f"{where}: changed where it does not depend on it"


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_weight_nan_cpu(backend):
    check_weight_nan(backend, 2, 64, "cpu")


# (weight, index, value, the outputs it may change): the NaN / infinity pattern of the torch reference, the other
# outputs' bits unchanged
WEIGHT_INF_CASES = [
    ("hc_base", (2,), "inf", ("layer_input",)),  # pre gate 1 (+ eps)
    ("hc_base", (2,), "-inf", ("layer_input",)),  # pre gate 0 (+ eps)
    ("hc_base", (9,), "inf", ("comb_mix_cur",)),  # softmax row 0: exp(inf - inf), NaN
    ("hc_base", (9,), "-inf", ("comb_mix_cur",)),  # softmax weight 0, a finite Sinkhorn
    ("hc_scale", (1,), "inf", ("post_mix_cur",)),  # post gates 0 or 2
    ("fn", (0, 40), "inf", ("layer_input",)),  # mix 0 = +-inf: pre gate 0 or 1 by token
    ("fn", (6, 9), "-inf", ("post_mix_cur",)),
    ("norm_weight", (37,), "inf", ("layer_input",)),
]


def check_weight_inf(backend, m, h, device, tactic=None):
    skip_unless_available(backend, device)
    inputs = make_inputs(m, h, seed=m + h + 2, device=device, norm=True)
    clean = run(backend, inputs, tactic)
    for weight, index, value, changes in WEIGHT_INF_CASES:
        bad = poison(inputs, weight, index, value)
        out, ref = run(backend, bad, tactic), run("torch", bad)
        for name, got, want, before in zip(out._fields, out, ref, clean):
            where = f"{value} in {weight}{list(index)}: {name}"
            for kind in (torch.isnan, torch.isposinf, torch.isneginf):
                same = torch.equal(kind(got), kind(want))
                assert same, f"{where}: {kind.__name__} differs from the reference's"
            kept = name in changes or torch.equal(bits(got), bits(before))
            assert kept, f"{where}: changed, yet it does not depend on it"


def _triton_tensor_core_tactic():
    from mhc_cute.triton.configs import TritonTactic

    return TritonTactic(16, 16, 2, 4)  # 16-token blocks: fn's three bf16 terms on the tensor cores


@pytest.mark.parametrize("backend,tactic", [("torch", None), ("triton", None), ("triton", "tensor cores")])
def test_weight_inf_cpu(backend, tactic):
    check_weight_inf(backend, 2, 64, "cpu", tactic and _triton_tensor_core_tactic())


def test_weight_splits_keep_infinities_and_nan():
    """The exact splits of ``fn`` the tensor-core paths multiply (Triton's three bf16 terms, the TF32 hi + lo): an
    infinity is its first part alone, so that its products are infinities as in fp32 (inf - inf would make the rest
    NaN), and NaN, as a GPU computes it, stays NaN in every part."""
    from mhc_cute.weights import bf16_terms

    w = torch.stack([torch.tensor(float("inf")), torch.tensor(-float("inf")), gpu_nan(torch.float32),
                     torch.tensor(1.0 + 2.0**-20)])
    terms = bf16_terms(w)
    assert [t[0].item() for t in terms] == [float("inf"), 0.0, 0.0]
    assert [t[1].item() for t in terms] == [-float("inf"), 0.0, 0.0]
    assert all(t[2].isnan() for t in terms)
    assert sum(t[3].double() for t in terms).item() == 1.0 + 2.0**-20
    mma = pytest.importorskip("mhc_cute.kernels.mma", reason="needs CuTe DSL")
    hi, lo = mma.split_tf32(w)
    assert hi[:2].tolist() == [float("inf"), -float("inf")] and lo[:2].tolist() == [0.0, 0.0]
    assert hi[2].isnan() and lo[2].isnan()


def test_the_poison_reaches_every_output_it_should():
    """The policy's claims about the reference itself, so that the pattern comparisons above cannot pass vacuously:
    an infinite pre base changes layer_input and keeps it finite; a +inf comb base makes the comb NaN, -inf not."""
    inputs = make_inputs(3, 64, seed=1, norm=True)
    clean = run("torch", inputs)
    sat = run("torch", poison(inputs, "hc_base", (2,), "inf"))
    assert torch.isfinite(sat.layer_input.float()).all() and not torch.equal(sat.layer_input, clean.layer_input)
    assert run("torch", poison(inputs, "hc_base", (9,), "inf")).comb_mix_cur.isnan().all()
    assert torch.isfinite(run("torch", poison(inputs, "hc_base", (9,), "-inf")).comb_mix_cur).all()


# --- the GPU: every backend, the defaults at a warp-MMA and an FFMA M, and the last token of a CTA's block ----------

GPU_POINTS = [(17, 4096), (130, 5120)]


@pytest.mark.gpu
@pytest.mark.parametrize("name", ACTIVATIONS)
@pytest.mark.parametrize("m,h", GPU_POINTS)
@pytest.mark.parametrize("backend", SEAM_BACKENDS)
def test_token_gpu(backend, m, h, name):
    check_token(backend, m, h, "cuda", [(name, "nan", m // 2), (name, "inf", m - 1), (name, "-inf", 0),
                                        (name, "nan", m - 1)])


@pytest.mark.gpu
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
@pytest.mark.parametrize("m,h", GPU_POINTS)
@pytest.mark.parametrize("backend", SEAM_BACKENDS)
def test_token_variants_gpu(backend, m, h, variant, norm):
    check_token(backend, m, h, "cuda", variant_cases(variant, (m // 2, m - 1, 0)), norm=norm, variant=variant)


@pytest.mark.gpu
@pytest.mark.parametrize("m,h", GPU_POINTS)
@pytest.mark.parametrize("backend", SEAM_BACKENDS)
def test_weight_nan_gpu(backend, m, h):
    check_weight_nan(backend, m, h, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("m,h", GPU_POINTS)
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_weight_inf_gpu(backend, m, h):
    check_weight_inf(backend, m, h, "cuda")


def _explicit_tactics():
    """Tactics the defaults above do not reach: the FMA paths' projection on warp MMA and in FFMA at both M, the
    tensor-core paths with one K split and with the most."""
    from mhc_cute.tactics import FmaTactic, MmaTactic

    out = []
    for path in ("half_fma", "all_fma"):
        out += [FmaTactic(path, 4096 // 64, 16, 6, 256, warp_mma=True), FmaTactic(path, 8, 8, 6, 256)]
    for path in ("half_mma", "all_mma"):
        out += [MmaTactic(path, 1, 64, 4), MmaTactic(path, 128, 64, 4)]
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("m", [3, 130])
@pytest.mark.parametrize("tactic", _explicit_tactics(), ids=lambda t: t.name)
def test_explicit_tactics_gpu(tactic, m):
    check_token(tactic.path, m, 4096, "cuda", [("residual_prev", "nan", m - 1), ("residual_prev", "inf", 0)],
                tactic=tactic)
    check_weight_nan(tactic.path, m, 4096, "cuda", tactic)
    check_weight_inf(tactic.path, m, 4096, "cuda", tactic)


def test_explicit_tactics_are_valid():
    for t in _explicit_tactics():
        assert t.invalid_reason(4096) is None, t.name
