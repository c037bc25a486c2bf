"""The public API on the CPU: hand-checked cases, the reference's properties, validation, torch.compile."""

import math

import pytest
import torch
from helpers import KERNEL_BACKENDS, fresh_plans, misaligned

from mhc_cute.accuracy import (
    check_call, check_outputs, make_inputs, poisoned_outputs, problem_of, run_backend, tolerances,
)
from mhc_cute import MhcFusedHcOutput, backends, mhc_fused_hc, reference


def call(inputs, **kw):
    return mhc_fused_hc(**inputs, **kw)


def test_import_and_output_shapes():
    inp = make_inputs(3, 64)
    out = call(inp)
    assert isinstance(out, MhcFusedHcOutput)
    assert out.residual_cur.shape == (3, 4, 64) and out.residual_cur.dtype == torch.bfloat16
    assert out.post_mix_cur.shape == (3, 4, 1) and out.post_mix_cur.dtype == torch.float32
    assert out.comb_mix_cur.shape == (3, 4, 4) and out.comb_mix_cur.dtype == torch.float32
    assert out.layer_input.shape == (3, 64) and out.layer_input.dtype == torch.bfloat16


def test_post_hand_checked():
    # one token, H = 2: residual_cur[j][h] = post[j]*x[h] + sum_k comb[k][j]*res[k][h]
    x = torch.tensor([[1.0, -2.0]]).bfloat16()
    res = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [2.0, 2.0], [0.5, -0.5]]]).bfloat16()
    post = torch.tensor([[1.0, 0.5, 0.0, 2.0]])
    comb = torch.arange(16.0).reshape(1, 4, 4) / 16
    got = reference.post(x, res, post, comb).float()
    want = torch.zeros(1, 4, 2)
    for j in range(4):
        for h in range(2):
            want[0, j, h] = post[0, j] * x[0, h].float() + sum(comb[0, k, j] * res[0, k, h].float() for k in range(4))
    torch.testing.assert_close(got, want.bfloat16().float(), rtol=0, atol=0)


def test_fma_emulation_is_single_rounding():
    # (1 + 2^-12)^2 - 1 = 2^-11 + 2^-24 is exact in fp32, but the fp32 product 1 + 2^-11 + 2^-24 is not
    a = torch.tensor([1 + 2.0**-12])
    c = torch.tensor([-1.0])
    assert reference.fma_f32(a, a, c).item() == 2.0**-11 + 2.0**-24
    assert (a * a + c).item() == 2.0**-11  # two roundings


def test_mixes_hand_checked():
    # H = 1, one token, residual_cur all ones: rstd = 1/sqrt(1 + eps), dots = row sums of fn
    res = torch.ones(1, 4, 1).bfloat16()
    fn = torch.arange(96.0).reshape(24, 4) / 100
    scale = torch.tensor([1.0, 2.0, 3.0])
    base = torch.linspace(-1, 1, 24)
    got = reference.mixes(res, fn, scale, base, 1e-6, torch.float64)
    rstd = 1 / math.sqrt(1 + 1e-6)
    g = torch.tensor([1.0] * 4 + [2.0] * 4 + [3.0] * 16, dtype=torch.float64)
    want = fn.double().sum(1) * rstd * g + base.double()
    torch.testing.assert_close(got[0], want, rtol=1e-15, atol=0)


def test_sinkhorn_properties():
    c = reference.sinkhorn(torch.randn(64, 4, 4, dtype=torch.float64), 1e-6, 20)
    assert torch.allclose(c.sum(-2), torch.ones(64, 4, dtype=torch.float64), atol=1e-5)  # ends on a column step
    assert torch.allclose(c.sum(-1), torch.ones(64, 4, dtype=torch.float64), atol=1e-3)
    assert (c > 0).all()


def test_sinkhorn_one_repeat_is_softmax_then_columns():
    logits = torch.randn(2, 4, 4, dtype=torch.float64)
    s = torch.softmax(logits, -1) + 1e-6
    want = s / (s.sum(-2, keepdim=True) + 1e-6)
    torch.testing.assert_close(reference.sinkhorn(logits, 1e-6, 1), want)


@pytest.mark.parametrize("norm", [False, True])
def test_auto_on_cpu_matches_float64(norm):
    inp = make_inputs(9, 256, norm=norm, seed=3)
    check_call(call(inp), inp)


def test_norm_changes_only_layer_input():
    inp = make_inputs(4, 128, norm=True)
    a = call(inp)
    b = call({**inp, "norm_weight": None})
    assert torch.equal(a.residual_cur, b.residual_cur) and torch.equal(a.comb_mix_cur, b.comb_mix_cur)
    li = b.layer_input.float()
    want = (li * torch.rsqrt((li * li).mean(-1, keepdim=True) + 1e-6) * inp["norm_weight"].float()).bfloat16()
    assert torch.equal(a.layer_input, want)


def test_fp32_norm_weight_accepted():
    inp = make_inputs(2, 64, norm=True)
    a = call(inp)
    b = call({**inp, "norm_weight": inp["norm_weight"].float()})
    assert torch.equal(a.layer_input, b.layer_input)


def test_leading_dims_and_alt_shapes():
    inp = make_inputs(6, 64, lead=(2, 3))
    out = call(inp)
    assert out.residual_cur.shape == (2, 3, 4, 64) and out.layer_input.shape == (2, 3, 64)
    flat = make_inputs(6, 64, lead=(2, 3))
    flat["post_mix_prev"] = flat["post_mix_prev"].reshape(2, 3, 4)
    flat["comb_mix_prev"] = flat["comb_mix_prev"].reshape(2, 3, 16)
    alt = call(flat)
    for a, b in zip(out, alt):
        assert torch.equal(a, b)


@pytest.mark.parametrize("lead", [(0,), (2, 0)])
def test_zero_tokens(lead):
    inp = make_inputs(1, 64, lead=lead)
    out = call(inp)
    assert out.residual_cur.shape == (*lead, 4, 64) and out.post_mix_cur.shape == (*lead, 4, 1)
    assert out.comb_mix_cur.shape == (*lead, 4, 4) and out.layer_input.shape == (*lead, 64)


def test_inputs_not_mutated_and_outputs_fresh():
    inp = make_inputs(5, 64, norm=True)
    before = {k: v.clone() for k, v in inp.items() if isinstance(v, torch.Tensor)}
    out = call(inp)
    for k, v in before.items():
        assert torch.equal(inp[k], v), f"{k} was modified"
    in_ptrs = {v.untyped_storage().data_ptr() for v in inp.values() if isinstance(v, torch.Tensor)}
    for name, t in zip(out._fields, out):
        assert t.untyped_storage().data_ptr() not in in_ptrs, f"{name} aliases an input"


def test_non_contiguous_inputs():
    inp = make_inputs(4, 64)
    want = call(inp)
    nc = dict(inp)
    nc["x_prev"] = torch.cat([inp["x_prev"], inp["x_prev"]], -1)[:, :64]
    nc["residual_prev"] = inp["residual_prev"].transpose(0, 1).contiguous().transpose(0, 1)
    nc["fn"] = inp["fn"].t().contiguous().t()
    assert not nc["x_prev"].is_contiguous() and not nc["residual_prev"].is_contiguous()
    got = call(nc)
    for a, b in zip(want, got):
        assert torch.equal(a, b)


def test_torch_compile_fullgraph():
    inp = make_inputs(3, 64, norm=True)
    compiled = torch.compile(mhc_fused_hc, fullgraph=True, backend="eager")
    got = compiled(**inp)
    want = call(inp)
    for a, b in zip(want, got):
        assert torch.equal(a, b)


def test_torch_compile_inductor():
    inp = make_inputs(2, 64)
    got = torch.compile(lambda **kw: mhc_fused_hc(**kw).layer_input, fullgraph=True)(**inp)
    assert torch.equal(got, call(inp).layer_input)


def test_run_backend_writes_every_element():
    problem = problem_of(make_inputs(3, 64))
    out = run_backend(problem, "torch")
    check_outputs(out, problem)


# --- out=: the caller's output buffers ----------------------------------------------------------------------

@pytest.mark.parametrize("lead", [(5,), (2, 3)])
def test_out_buffers_are_written_and_returned(lead):
    inp = make_inputs(math.prod(lead), 64, seed=4, norm=True, lead=lead)
    want = call(inp)
    bufs = poisoned_outputs(problem_of(inp), lead)
    got = call(inp, out=bufs)
    assert isinstance(got, MhcFusedHcOutput)
    for g, b, w in zip(got, bufs, want):
        assert g is b
        assert torch.equal(b, w)


def test_out_accepts_the_flat_mix_shapes():
    inp = make_inputs(3, 64, seed=5)
    want = call(inp)
    bufs = (torch.empty(3, 4, 64, dtype=torch.bfloat16), torch.empty(3, 4), torch.empty(3, 16),
            torch.empty(3, 64, dtype=torch.bfloat16))
    call(inp, out=bufs)
    assert torch.equal(bufs[1], want.post_mix_cur.view(3, 4)) and torch.equal(bufs[2], want.comb_mix_cur.view(3, 16))
    assert torch.equal(bufs[0], want.residual_cur) and torch.equal(bufs[3], want.layer_input)


def test_out_with_zero_tokens():
    inp = make_inputs(0, 64, lead=(0,))
    bufs = poisoned_outputs(problem_of(inp), (0,))
    assert all(g is b for g, b in zip(call(inp, out=bufs), bufs))


def test_out_under_torch_compile():
    inp = make_inputs(6, 64, seed=6, norm=True, lead=(2, 3))
    want = call(inp)
    bufs = poisoned_outputs(problem_of(inp), (2, 3))
    got = torch.compile(lambda i, o: mhc_fused_hc(**i, out=o), fullgraph=True, backend="eager")(inp, bufs)
    assert all(g is b for g, b in zip(got, bufs)) and all(torch.equal(b, w) for b, w in zip(bufs, want))
    bufs = poisoned_outputs(problem_of(inp), (2, 3))
    doubled = torch.compile(lambda i, o: mhc_fused_hc(**i, out=o).layer_input * 2, fullgraph=True)(inp, bufs)
    assert torch.equal(doubled, want.layer_input * 2) and all(torch.equal(b, w) for b, w in zip(bufs, want))


BAD_OUT_CASES = {
    "not a tuple": (lambda o, i: o[0], "out"),
    "three items": (lambda o, i: o[:3], "out"),
    "dtype": (lambda o, i: (o[0].float(),) + o[1:], "out.residual_cur"),
    "shape": (lambda o, i: o[:3] + (o[3][:, :32],), "out.layer_input"),
    "tokens": (lambda o, i: (o[0], o[1][:2]) + o[2:], "out.post_mix_cur"),
    "device": (lambda o, i: o[:2] + (torch.empty(3, 4, 4, device="meta"), o[3]), "out.comb_mix_cur"),
    "non-contiguous": (lambda o, i: o[:3] + (torch.empty(64, 3, dtype=torch.bfloat16).t(),), "out.layer_input"),
    "misaligned": (lambda o, i: o[:3] + (misaligned(o[3]),), "out.layer_input"),
    "overlaps an output": (lambda o, i: o[:3] + (o[0].view(-1)[:3 * 64].view(3, 64),), "out.residual_cur"),
    "overlaps an input": (lambda o, i: o[:3] + (i["x_prev"],), "out.layer_input"),
    "overlaps the weight": (lambda o, i: (o[0], i["fn"].view(-1)[:12].view(3, 4, 1)) + o[2:], "out.post_mix_cur"),
}


@pytest.mark.parametrize("case", list(BAD_OUT_CASES))
def test_bad_out_names_the_buffer(case):
    make_bad, name = BAD_OUT_CASES[case]
    inp = make_inputs(3, 64, seed=8, norm=True)
    bufs = poisoned_outputs(problem_of(inp), (3,))
    before = {k: v.clone() for k, v in inp.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(ValueError, match=f"`{name}`"):
        call(inp, out=make_bad(bufs, inp))
    for k, v in before.items():  # nothing was written before the error
        assert torch.equal(inp[k], v), k


def test_out_may_sit_next_to_an_input_in_one_buffer():
    """Adjacent slices of one allocation share no byte: accepted (an engine's arena)."""
    inp = make_inputs(3, 64, seed=9)
    arena = torch.empty(2 * 3 * 64, dtype=torch.bfloat16)
    arena[:3 * 64].view(3, 64).copy_(inp["x_prev"])
    inp = dict(inp, x_prev=arena[:3 * 64].view(3, 64))
    want = call(inp)
    bufs = (torch.empty_like(want.residual_cur), torch.empty_like(want.post_mix_cur),
            torch.empty_like(want.comb_mix_cur), arena[3 * 64:].view(3, 64))
    call(inp, out=bufs)
    assert torch.equal(bufs[3], want.layer_input)


# --- validation: each bad input gets a ValueError naming the argument -------------------------------------

def _bad(inp, **changes):
    return {**inp, **changes}


BAD_CASES = {
    "x_prev dtype": (lambda i: _bad(i, x_prev=i["x_prev"].float()), "x_prev"),
    "x_prev not tensor": (lambda i: _bad(i, x_prev=[1.0]), "x_prev"),
    "residual dtype": (lambda i: _bad(i, residual_prev=i["residual_prev"].half()), "residual_prev"),
    "residual hc_mult": (lambda i: _bad(i, residual_prev=i["residual_prev"][:, :3]), "residual_prev"),
    "residual H": (lambda i: _bad(i, residual_prev=i["residual_prev"][..., :32]), "residual_prev"),
    "residual M": (lambda i: _bad(i, residual_prev=i["residual_prev"][:2]), "residual_prev"),
    "post dtype": (lambda i: _bad(i, post_mix_prev=i["post_mix_prev"].double()), "post_mix_prev"),
    "post shape": (lambda i: _bad(i, post_mix_prev=i["post_mix_prev"][:, :3]), "post_mix_prev"),
    "comb shape": (lambda i: _bad(i, comb_mix_prev=i["comb_mix_prev"][:, :, :3]), "comb_mix_prev"),
    "comb dtype": (lambda i: _bad(i, comb_mix_prev=i["comb_mix_prev"].bfloat16()), "comb_mix_prev"),
    "fn shape": (lambda i: _bad(i, fn=i["fn"][:, :-64]), "fn"),
    "fn rows": (lambda i: _bad(i, fn=i["fn"][:23]), "fn"),
    "fn dtype": (lambda i: _bad(i, fn=i["fn"].bfloat16()), "fn"),
    "scale shape": (lambda i: _bad(i, hc_scale=torch.ones(4)), "hc_scale"),
    "base shape": (lambda i: _bad(i, hc_base=torch.ones(23)), "hc_base"),
    "base dtype": (lambda i: _bad(i, hc_base=torch.ones(24, dtype=torch.float64)), "hc_base"),
    "norm shape": (lambda i: _bad(i, norm_weight=torch.ones(63).bfloat16()), "norm_weight"),
    "norm dtype": (lambda i: _bad(i, norm_weight=torch.ones(64).half()), "norm_weight"),
    "device": (lambda i: _bad(i, hc_base=torch.ones(24, device="meta")), "hc_base"),
    "x_prev 0-dim": (lambda i: _bad(i, x_prev=torch.tensor(1.0).bfloat16()), "x_prev"),
    "H == 0": (lambda i: _bad(i, x_prev=i["x_prev"][:, :0]), "x_prev"),
    # without a post (x_prev None) the call's leading dims, H and device are residual_prev's
    "residual not tensor, no post": (lambda i: _bad(_no_post(i), residual_prev=[1.0]), "residual_prev"),
    "residual 0-dim, no post": (lambda i: _bad(_no_post(i), residual_prev=torch.tensor(1.0).bfloat16()),
                                "residual_prev"),
    "H == 0, no post": (lambda i: _bad(_no_post(i), residual_prev=i["residual_prev"][..., :0]), "residual_prev"),
}


def _no_post(inp):
    return _bad(inp, x_prev=None, post_mix_prev=None, comb_mix_prev=None)


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_input_names_the_argument(case):
    make_bad, name = BAD_CASES[case]
    inp = make_inputs(3, 64, norm=True)
    with pytest.raises(ValueError, match=rf"^mhc_fused_hc: `{name}` must be"):
        call(make_bad(inp))


@pytest.mark.parametrize(
    "kw,name",
    [
        (dict(rms_eps=float("nan")), "rms_eps"),
        (dict(rms_eps=0.0), "rms_eps"),
        (dict(hc_pre_eps=float("inf")), "hc_pre_eps"),
        (dict(hc_sinkhorn_eps=-1.0), "hc_sinkhorn_eps"),
        (dict(hc_post_mult_value=float("nan")), "hc_post_mult_value"),
        (dict(norm_eps=float("-inf")), "norm_eps"),
        (dict(sinkhorn_repeat=0), "sinkhorn_repeat"),
        (dict(sinkhorn_repeat=2.5), "sinkhorn_repeat"),
        (dict(precision="bf16"), "precision"),
    ],
)
def test_bad_scalars(kw, name):
    with pytest.raises(ValueError, match=f"`{name}`"):
        call(make_inputs(2, 64), **kw)


@pytest.mark.parametrize("name", ["fn", "residual_prev", "norm_weight"])
def test_inputs_requiring_grad_are_refused_with_grad_mode_on(name):
    """The op has no backward: with grad mode on, an input that requires grad (e.g. ``fn`` as an nn.Parameter) gets an
    error naming it rather than outputs that silently carry no gradient; under inference_mode / no_grad it runs."""
    inp = make_inputs(3, 64, norm=True)
    want = call(inp)
    inp[name] = inp[name].clone().requires_grad_()
    with pytest.raises(ValueError, match=f"`{name}`.*inference-only"):
        call(inp)
    for mode in (torch.inference_mode, torch.no_grad):
        with mode():
            got = call(inp)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_unknown_backend_lists_available():
    with pytest.raises(ValueError, match=r"unknown backend 'nope'.*available here: \['auto', 'torch'"):
        call(make_inputs(2, 64), backend="nope")
    with pytest.raises(ValueError, match=r"^mhc_fused_hc: `backend` must be a str .*; got list"):
        call(make_inputs(2, 64), backend=["torch"])


def test_the_device_error_names_the_argument_the_call_runs_by():
    """Without a post the call's device is residual_prev's (x_prev is None): the error names it."""
    inp = make_inputs(3, 64, form="no_post")
    with pytest.raises(ValueError, match=r"^mhc_fused_hc: `fn` must be on the same device as residual_prev \(cpu\)"):
        call({**inp, "fn": inp["fn"].to("meta")})
    inp = make_inputs(3, 64)
    with pytest.raises(ValueError, match=r"^mhc_fused_hc: `fn` must be on the same device as x_prev \(cpu\)"):
        call({**inp, "fn": inp["fn"].to("meta")})


TACTIC_ERRORS = [
    ("auto", "half_fma:k1:t1:n6:w256:s1:b1:flat", r"`tactic` needs a named backend \('auto' picks its own\)"),
    ("torch", object(), r"`tactic`: backend 'torch' takes none \(it has no tactics\)"),
    ("torch", "half_fma:k1:t1:n6:w256:s1:b1:flat", r"`tactic`: tactic '[^']+' is one of backend 'half_fma', not of "
                                                   r"'torch'"),
    ("triton", "half_fma:k1:t1:n6:w256:s1:b1:flat", r"`tactic`: unknown Triton tactic name"),
    ("triton", 3, r"`tactic`: backend 'triton' takes a TritonTactic or its name; got 3"),
    ("half_fma", "half_mma:k8:m64:s3:fbw", r"`tactic`: tactic '[^']+' is one of backend 'half_mma', not of "
                                           r"'half_fma'"),
    ("half_mma", "nonsense", r"`tactic`: unknown tactic name 'nonsense'"),
]


@pytest.mark.parametrize("backend,tactic,message", TACTIC_ERRORS)
def test_a_tactic_the_backend_cannot_run_is_refused(backend, tactic, message):
    """A tactic is checked against the backend named with it before anything runs (so on any machine)."""
    with pytest.raises(ValueError, match="^mhc_fused_hc: " + message):
        call(make_inputs(2, 64), backend=backend, tactic=tactic)


def test_tactic_names_read_back():
    from mhc_cute import tactics
    from mhc_cute.triton.configs import TABLES, TritonTactic

    for table in TABLES:
        for _, t in table.buckets:
            assert backends.parse_tactic("triton", t.name) == t
    t = TritonTactic(32, 64, 16, 8, num_stages=3, reduce_block_t=2, reduce_block_h=4096, reduce_warps=8, chunk_m=1024)
    assert t.name == "triton:m32:h64:k16:w8:s3:rt2:rh4096:rw8:c1024" and backends.checked_tactic("triton", t.name) == t
    for name in ("half_fma:k112:t1:n6:w256:s1:b1:flat", "all_mma:k8:m64:s3:fbw"):
        t = tactics.parse_tactic(name)
        assert backends.parse_tactic(t.path, name) == t and backends.checked_tactic(t.path, t) is t


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs Triton under its CPU interpreter")
def test_a_tactic_reaches_the_backend_eagerly_and_under_torch_compile(monkeypatch):
    """``tactic`` (an object or its name) is what the backend runs, in eager calls and through the custom ops."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from mhc_cute.triton.configs import TritonTactic

    seen = []
    load = backends.load_entry

    def spy(entry):
        prepare = load(entry)
        return lambda p, t, o: seen.append(t) or prepare(p, t, o)

    monkeypatch.setattr(backends, "load_entry", spy)
    fresh_plans(monkeypatch)
    tactic = TritonTactic(1, 32, 2, 4)
    inp = make_inputs(2, 64)
    want = call(inp, backend="triton", tactic=tactic)
    compiled = torch.compile(lambda i: mhc_fused_hc(**i, backend="triton", tactic=tactic.name), fullgraph=True,
                             backend="eager")
    got = compiled(inp)
    assert seen == [tactic, tactic]
    for a, b in zip(want, got):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", [b for b in KERNEL_BACKENDS if backends.BACKENDS[b].kind == "cute"])
def test_cute_backend_on_cpu_tensors_is_unavailable(backend):
    with pytest.raises(RuntimeError, match=f"backend '{backend}' is unavailable on cpu.*available here"):
        call(make_inputs(2, 64), backend=backend)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_kernel_backend_needs_h_multiple_of_64(backend, monkeypatch):
    """Checked before anything runs (so on any machine: the backend's availability is faked)."""
    monkeypatch.setattr(backends, "unavailable_reason", lambda name, device: None)
    with pytest.raises(ValueError, match=rf"^mhc_fused_hc: backend '{backend}' needs H % 64 == 0; got H = 96"):
        call(make_inputs(2, 96), backend=backend)


def test_misaligned_inputs_are_copied_not_misread():
    inp = make_inputs(4, 64)
    want = call(inp)
    store = torch.empty(inp["x_prev"].numel() + 1, dtype=torch.bfloat16)
    x = store[1:].view(4, 64)  # contiguous, base 2 bytes past a 16-byte boundary
    x.copy_(inp["x_prev"])
    assert x.data_ptr() % 16 != 0
    from mhc_cute.problem import Scalars, validate

    problem, _ = validate(x, *[inp[k] for k in ("residual_prev", "post_mix_prev", "comb_mix_prev", "fn", "hc_scale",
                                                "hc_base")], None, Scalars(), "fp32")
    assert problem.x.data_ptr() % 16 == 0 and torch.equal(problem.x, x)
    for a, b in zip(want, call({**inp, "x_prev": x})):
        assert torch.equal(a, b)


def test_validation_cache_does_not_hide_errors():
    inp = make_inputs(3, 64)
    call(inp)  # caches this signature
    with pytest.raises(ValueError, match="`hc_base`"):
        call({**inp, "hc_base": inp["hc_base"].double()})
    with pytest.raises(ValueError, match="`rms_eps`"):
        call(inp, rms_eps=-1.0)


def test_a_signature_is_checked_and_prepared_once(monkeypatch):
    """Later calls of a signature reuse its plan (the host time of an eager call), with fresh outputs each time; a new
    shape or scalar is a new signature, checked in full."""
    made = fresh_plans(monkeypatch)
    inp = make_inputs(3, 64, seed=12, norm=True)
    first = call(inp)
    again = [call(inp) for _ in range(3)]
    assert len(made) == 1
    for out in again:
        assert all(torch.equal(a, b) and a.data_ptr() != b.data_ptr() for a, b in zip(first, out))
    call(make_inputs(4, 64, seed=12, norm=True))
    call(inp, rms_eps=1e-5)
    call({**inp, "x_prev": inp["x_prev"].t().contiguous().t()})  # not contiguous
    assert len(made) == 4


def test_a_recent_signature_is_found_without_its_key(monkeypatch):
    """A call of a recent signature finds its plan by the C++ check of the tensors' metadata (the key is not built);
    any change of a tensor's shape, dtype, strides, device or presence, of a scalar, the backend or the precision
    is another signature: resolved again (checked in full where it is new)."""
    from mhc_cute import api, signatures

    assert signatures.TensorGuards is not None  # this torch has the check: eager calls take the short path
    made = fresh_plans(monkeypatch)
    inp = make_inputs(3, 64, seed=14)
    first = call(inp)
    api._PLANS.clear()  # only the recent plans remain
    same = call({k: None if v is None else v.clone() for k, v in inp.items()})
    assert len(made) == 1 and all(torch.equal(a, b) for a, b in zip(first, same))
    refused = [  # (a bad call, the argument its error names)
        ({**inp, "x_prev": inp["x_prev"][:2]}, "residual_prev"),  # shape: no longer x_prev's leading dims
        ({**inp, "post_mix_prev": inp["post_mix_prev"].double()}, "post_mix_prev"),  # dtype
        ({**inp, "residual_prev": inp["residual_prev"].to("meta")}, "residual_prev"),  # device
    ]
    for i, (other, name) in enumerate(refused):
        with pytest.raises(ValueError, match=rf"^mhc_fused_hc: `{name}` must be"):
            call(other)
        assert len(made) == 2 + i, i
    accepted = [
        {**inp, "x_prev": inp["x_prev"].t().contiguous().t()},  # strides
        {**inp, "norm_weight": torch.ones(64, dtype=torch.bfloat16)},  # a tensor where None was
    ]
    for i, other in enumerate(accepted):
        check_call(call(other), other)
        assert len(made) == 2 + len(refused) + i, i
    call(inp, rms_eps=1e-5)
    call(inp, precision="tf32")
    call(inp, backend="torch")
    # auto on the CPU is the reference: its plan was made just now
    assert len(made) == 2 + len(refused) + len(accepted) + 2


def test_plans_follow_the_selector(monkeypatch):
    """A plan keeps auto's choice only while the selector does: after a reload (new tables, ``MHC_CUTE_BACKEND``) the
    next call resolves again."""
    from mhc_cute import selector

    inp = make_inputs(2, 64, seed=13)
    call(inp)
    monkeypatch.setenv("MHC_CUTE_BACKEND", "nope")
    try:
        selector.SELECTOR.reload()
        with pytest.raises(ValueError, match="unknown backend 'nope'"):
            call(inp)
    finally:
        monkeypatch.delenv("MHC_CUTE_BACKEND")
        selector.SELECTOR.reload()
    call(inp)


def test_plans_are_bounded(monkeypatch):
    from mhc_cute import api

    fresh_plans(monkeypatch)
    monkeypatch.setattr(api, "MAX_PLANS", 2)
    outs = [call(make_inputs(m, 64)) for m in (1, 2, 3)]
    assert len(api._PLANS) == 2 and [next(iter(key)) for key in api._PLANS] == [(2, 64), (3, 64)]  # x's shape first
    assert [o.layer_input.shape[0] for o in outs] == [1, 2, 3]


@pytest.mark.parametrize("norm", [False, True])
def test_accuracy_check_catches_errors(norm):
    """The contract check fails on a flipped residual bit, a 2-ulp layer_input error, a 1e-4 mix error."""
    problem = problem_of(make_inputs(8, 256, norm=norm, seed=5))
    good = run_backend(problem, "torch")
    check_outputs(good, problem)

    def broken(field, fn):
        out = MhcFusedHcOutput(*(t.clone() for t in good))
        fn(getattr(out, field))
        return out

    def flip_bit(t):
        t.view(torch.int16)[3, 1, 7] ^= 1

    def two_ulps(t):
        i = t.float().abs().argmax()  # a large, well-conditioned element
        v = t.view(-1)[i].float()
        t.view(-1)[i] = (v + 2 * 2.0 ** (torch.floor(torch.log2(v.abs())) - 7) * torch.sign(v)).bfloat16()

    def two_ulps_typical(t):
        flat = t.view(-1)
        i = flat.float().abs().argsort()[flat.numel() // 2]  # a median-sized element
        v = flat[i].float()
        flat[i] = (v + 2 * 2.0 ** (torch.floor(torch.log2(v.abs())) - 7) * torch.sign(v)).bfloat16()

    def mix_err(t):
        t.mul_(1 + 1e-4)

    for field, fn, msg in (("residual_cur", flip_bit, "bitwise"), ("layer_input", two_ulps, "bf16 ulp"),
                           ("layer_input", two_ulps_typical, "bf16 ulp"),
                           ("comb_mix_cur", mix_err, "comb_mix_cur"), ("post_mix_cur", mix_err, "post_mix_cur")):
        with pytest.raises(AssertionError, match=msg):
            check_outputs(broken(field, fn), problem)


@pytest.mark.parametrize("pre", [None, "carried"])
def test_accuracy_check_in_row_chunks(monkeypatch, pre):
    """The contract check runs in chunks of rows (its float64 reference fits any M): in chunks of 3 rows over 8 tokens
    it reports what one pass does (the normwise errors summed over every row) and still fails a flipped residual
    bit, a 2-ulp layer_input error and a 1e-3 post mix error in the last chunk (rows 6 and 7)."""
    from mhc_cute import accuracy

    problem = problem_of(make_inputs(8, 256, norm=True, seed=5, pre=pre))
    good = run_backend(problem, "torch")
    whole = check_outputs(good, problem)
    monkeypatch.setattr(accuracy, "CHECK_ELEMENTS", 3 * 4 * 256)
    chunked = check_outputs(good, problem)
    assert chunked.keys() == whole.keys()
    assert all(math.isclose(chunked[k], whole[k], rel_tol=1e-9) for k in whole), (chunked, whole)

    def last_chunk(field, fn):
        t = getattr(good, field).clone()
        fn(t[6])
        return good._replace(**{field: t})

    def flip_bit(row):
        row.view(torch.int16)[1, 7] ^= 1

    def two_ulps(row):
        i = row.float().abs().argmax()
        v = row[i].float()
        row[i] = (v + 2 * 2.0 ** (torch.floor(torch.log2(v.abs())) - 7) * torch.sign(v)).bfloat16()

    for field, fn, msg in (("residual_cur", flip_bit, "bitwise"), ("layer_input", two_ulps, "bf16 ulp"),
                           ("post_mix_cur", lambda row: row.mul_(1 + 1e-3), "post_mix_cur normwise")):
        with pytest.raises(AssertionError, match=msg):
            check_outputs(last_chunk(field, fn), problem)


@pytest.mark.parametrize("norm", [False, True])
def test_accuracy_check_catches_errors_at_tf32(norm):
    """At ``precision="tf32"`` the check of layer_input is normwise (``tolerances``: ``li_normwise``), not per element:
    it still fails a layer_input 10% off in one token of 8, or with two tokens swapped, an unwritten (NaN) element, and
    a 1e-2 mix error."""
    problem = problem_of(make_inputs(8, 256, norm=norm, seed=5), "tf32")
    tol = tolerances("half_mma", "tf32")
    assert tol.get("li_normwise") == 1e-2
    good = run_backend(problem, "torch")
    check_outputs(good, problem, **tol)
    li = good.layer_input
    one_token = li.clone()
    one_token[3] = (one_token[3].float() * 1.1).bfloat16()
    unwritten = li.clone()
    unwritten[5, 7] = float("nan")
    for bad, msg in ((one_token, "layer_input normwise"), (li[[1, 0, *range(2, 8)]], "layer_input normwise"),
                     (unwritten, "layer_input: non-finite")):
        with pytest.raises(AssertionError, match=msg):
            check_outputs(good._replace(layer_input=bad), problem, **tol)
    with pytest.raises(AssertionError, match="comb_mix_cur normwise"):
        check_outputs(good._replace(comb_mix_cur=good.comb_mix_cur * (1 + 1e-2)), problem, **tol)
