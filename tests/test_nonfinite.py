"""The non-finite policy: NaN and infinities propagate as IEEE arithmetic through the SPEC's steps on every backend,
and tokens stay independent.

* a NaN or infinity in one token's activations: ``accuracy.check_poisoned_token`` (the other tokens' outputs bit for
  bit those of a clean call; the token's ``residual_cur`` the fp32 FMA chain; its mixes and ``layer_input`` NaN);
* a NaN in a weight reaches every token, in exactly the outputs that depend on it (the others keep their bits);
* an infinite weight saturates as IEEE says: the same NaN and infinity pattern as the torch reference.

NaN is written as a GPU computes it (``accuracy.gpu_nan``: a rounding done on the bits can turn that one into zero or
an infinity, where the quiet NaN torch writes survives).
"""

import pytest
import torch

from mhc_cute import backends, mhc_fused_hc
from mhc_cute.accuracy import check_poisoned_token, gpu_nan, make_inputs, problem_of

KERNEL_BACKENDS = ["triton", "half_fma", "all_fma", "half_mma", "all_mma"]
ACTIVATIONS = ("x_prev", "residual_prev", "post_mix_prev", "comb_mix_prev")
AT = {"x_prev": (37,), "residual_prev": (2, 37), "post_mix_prev": (1, 0), "comb_mix_prev": (3, 1)}  # in a token


def poison(inputs: dict, name: str, index: tuple, value: str) -> dict:
    """``inputs`` with ``inputs[name][index]`` set to ``value`` ("nan", "inf" or "-inf"), the rest shared."""
    t = inputs[name].clone()
    v = gpu_nan(t.dtype) if value == "nan" else torch.tensor(float(value), dtype=t.dtype)
    t[index] = v.to(t.device)
    return dict(inputs, **{name: t})


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


def run(backend, inputs, tactic=None):
    return mhc_fused_hc(**inputs, backend=backend, tactic=tactic)


def _skip_if_unavailable(backend, device):
    why = backends.unavailable_reason(backend, torch.device(device))
    if why is not None:
        pytest.skip(f"{backend} unavailable: {why}")


# --- one token -----------------------------------------------------------------------------------------------------

def check_token(backend, m, h, device, name, cases, norm=True, tactic=None):
    """For each (value, token) of ``cases``: that value at ``AT[name]`` of the token, against a clean call."""
    _skip_if_unavailable(backend, device)
    inputs = make_inputs(m, h, seed=m + h, device=device, norm=norm)
    clean = run(backend, inputs, tactic)
    for value, token in cases:
        bad = poison(inputs, name, (token, *AT[name]), value)
        try:
            check_poisoned_token(run(backend, bad, tactic), clean, problem_of(bad), token)
        except AssertionError as e:
            raise AssertionError(f"{name}[{token}, {AT[name]}] = {value}: {e}") from None


@pytest.mark.parametrize("name", ACTIVATIONS)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_token_cpu(backend, name):
    check_token(backend, 3, 64, "cpu", name, [("nan", 1), ("inf", 2), ("-inf", 0)])


def test_token_without_norm_cpu():
    check_token("torch", 3, 64, "cpu", "residual_prev", [("nan", 1)], norm=False)
    check_token("triton", 3, 64, "cpu", "x_prev", [("inf", 2)], norm=False)


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
    _skip_if_unavailable(backend, device)
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


@pytest.mark.parametrize("backend", ["torch", "triton"])
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
    _skip_if_unavailable(backend, device)
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
@pytest.mark.parametrize("backend", ["torch"] + KERNEL_BACKENDS)
def test_token_gpu(backend, m, h, name):
    check_token(backend, m, h, "cuda", name, [("nan", m // 2), ("inf", m - 1), ("-inf", 0), ("nan", m - 1)])


@pytest.mark.gpu
@pytest.mark.parametrize("m,h", GPU_POINTS)
@pytest.mark.parametrize("backend", ["torch"] + KERNEL_BACKENDS)
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
    check_token(tactic.path, m, 4096, "cuda", "residual_prev", [("nan", m - 1), ("inf", 0)], tactic=tactic)
    check_weight_nan(tactic.path, m, 4096, "cuda", tactic)
    check_weight_inf(tactic.path, m, 4096, "cuda", tactic)


def test_explicit_tactics_are_valid():
    for t in _explicit_tactics():
        assert t.invalid_reason(4096) is None, t.name
