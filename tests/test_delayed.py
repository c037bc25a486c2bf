"""The delayed seam (``mhc_fused_hc_delayed``) and the entry forms of both seams (no post, broadcast entry) on the
CPU: the float64 contract per backend and variant, the API's promises, validation."""

import pytest
import torch
from helpers import (
    SEAM_BACKENDS, SEAM_VARIANTS, backend_params, compile_outside_interpreter, fresh_plans, skip_unless_available,
    variant_id,
)

from mhc_cute import backends, mhc_fused_hc, mhc_fused_hc_delayed, reference
from mhc_cute.accuracy import (
    call_seam, check_backend, check_call, check_outputs, make_inputs, normwise, poisoned_outputs,
    problem_of, run_backend,
)

# (op, form, pre): every seam variant (helpers.SEAM_VARIANTS) but mhc_fused_hc's regular form, which has the suites
# of tests/test_correctness.py and test_api.py
VARIANTS = [v for v in SEAM_VARIANTS if v[:2] != ("fused_hc", "regular")]
VARIANT_IDS = [variant_id(v) for v in VARIANTS]


def check_variant(backend, m, h, form, pre, norm, device="cpu", seed=0):
    skip_unless_available(backend, device)
    inputs = make_inputs(m, h, seed=seed + m + h, device=device, norm=norm, form=form, pre=pre)
    check_backend(problem_of(inputs), backend)


def test_variants_are_every_form_of_both_seams():
    assert len(VARIANTS) == len(set(VARIANTS)) == 2 + 3 * 2
    for op, form, pre in VARIANTS:
        problem = problem_of(make_inputs(2, 64, form=form, pre=pre))
        assert (problem.op, problem.form, problem.delayed and problem.pre_mix is None) == (op, form, pre == "identity")


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("h", [64, 256])
@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("op,form,pre", VARIANTS, ids=VARIANT_IDS)
def test_torch_backend_variants_cpu(op, form, pre, m, h, norm):
    check_variant("torch", m, h, form, pre, norm)


@pytest.mark.parametrize("op,form,pre", SEAM_VARIANTS, ids=[variant_id(v) for v in SEAM_VARIANTS])
def test_torch_backend_in_row_chunks(monkeypatch, op, form, pre):
    """The torch backend runs a call in chunks of rows (its float64 temporaries bounded at any M): in chunks of 3
    rows over 10 tokens every output (poisoned first) meets the contract, so no chunk is left unwritten or
    misplaced."""
    monkeypatch.setattr(reference, "ROW_CHUNK_ELEMENTS", 3 * 4 * 64)
    assert reference.row_chunks(10, 64) == [slice(0, 3), slice(3, 6), slice(6, 9), slice(9, 12)]
    check_variant("torch", 10, 64, form, pre, True)


@pytest.mark.parametrize("form,pre", [("regular", "carried"), ("broadcast", "identity")])
def test_torch_backend_delayed_v41_width_cpu(form, pre):
    check_variant("torch", 5, 5120, form, pre, True)


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("form", ["regular", "broadcast"])
@pytest.mark.parametrize("backend,device", backend_params())
def test_residual_and_gates_match_the_v4_seam(backend, device, form, norm):
    """On each backend the delayed seam's residual_cur is bit-identical to mhc_fused_hc's, and both seams' gates
    (the delayed seam's post and comb the V4 seam's at V4.1's scalars, its pre_mix_cur the V4 seam's pre gate) and
    layer_input meet the float64 contract."""
    skip_unless_available(backend, device)
    inputs = make_inputs(5, 64 if device == "cpu" else 512, seed=4, device=device, norm=norm, form=form,
                         pre="carried" if form == "regular" else "identity")
    v4_inputs = {k: v for k, v in inputs.items() if k != "pre_mix_prev"}
    v41 = dict(rms_eps=1e-20, norm_eps=1e-20)
    v4 = mhc_fused_hc(**v4_inputs, backend=backend, **v41)
    d = mhc_fused_hc_delayed(**inputs, backend=backend)
    assert torch.equal(v4.residual_cur.view(torch.int16), d.residual_cur.view(torch.int16))
    check_call(v4, v4_inputs, backend, **v41)
    check_call(d, inputs, backend)


@pytest.mark.parametrize("backend,device", backend_params())
def test_identity_pre_collapses_to_stream_zero(backend, device):
    skip_unless_available(backend, device)
    inputs = make_inputs(7, 64 if device == "cpu" else 512, seed=2, device=device, pre="identity")
    out = mhc_fused_hc_delayed(**inputs, backend=backend)
    check_call(out, inputs, backend)
    assert torch.equal(out.layer_input.view(torch.int16), out.residual_cur[:, 0].view(torch.int16))
    one_hot = torch.tensor([1.0, 0.0, 0.0, 0.0], device=device).expand(7, 4).contiguous()
    explicit = mhc_fused_hc_delayed(**{**inputs, "pre_mix_prev": one_hot}, backend=backend)
    assert torch.equal(explicit.layer_input.view(torch.int16), out.layer_input.view(torch.int16))


@pytest.mark.parametrize("backend,device", backend_params())
def test_collapse_uses_the_carried_gates_not_its_own(backend, device):
    """layer_input (no norm) is the fp32 FMA chain of the collapse of residual_cur with pre_mix_prev, bit for bit
    (``check_call``), which the collapse with the seam's own gates is not."""
    skip_unless_available(backend, device)
    inputs = make_inputs(5, 64 if device == "cpu" else 512, seed=3, device=device, pre="carried")
    out = mhc_fused_hc_delayed(**inputs, backend=backend)
    check_call(out, inputs, backend)
    own = reference.collapse_carried(out.residual_cur, out.pre_mix_cur)
    assert not torch.equal(out.layer_input, own)


def test_collapse_hand_checked():
    # one token, H = 2: x1 = bf16(((p0 r0 + p1 r1) + p2 r2) + p3 r3), each step one fp32 rounding
    res = torch.tensor([[[1.0, 3.0], [2.0, -1.0], [0.5, 0.25], [4.0, 8.0]]]).bfloat16()
    pre = torch.tensor([[0.5, 0.25, 2.0, 0.125]])
    want = torch.tensor([[0.5 + 0.5 + 1.0 + 0.5, 1.5 - 0.25 + 0.5 + 1.0]]).bfloat16()
    assert torch.equal(reference.collapse_carried(res, pre), want)


def test_no_post_returns_residual_prev_itself():
    for fn, pre in ((mhc_fused_hc, None), (mhc_fused_hc_delayed, "carried")):
        inputs = make_inputs(2, 64, seed=1, form="no_post", pre=pre, lead=(2, 3))
        out = fn(**inputs)
        assert out.residual_cur is inputs["residual_prev"]
        assert out.layer_input.shape == (2, 3, 64) and out.post_mix_cur.shape == (2, 3, 4, 1)


def test_broadcast_entry_writes_four_copies_and_projects_over_h():
    inputs = make_inputs(3, 64, seed=6, form="broadcast", pre="identity", lead=(3,))
    out = mhc_fused_hc_delayed(**inputs)
    e = inputs["residual_prev"]
    assert out.residual_cur.shape == (3, 4, 64)
    assert all(torch.equal(out.residual_cur[:, j], e) for j in range(4))
    assert out.residual_cur.data_ptr() != e.data_ptr()
    # the same seam on the 4 copies given as streams (no post): the same gates up to the fp32 rounding of fn_b
    streams = mhc_fused_hc_delayed(**{**inputs, "residual_prev": e[:, None].expand(-1, 4, -1).contiguous()})
    for a, b in zip(out[1:], streams[1:]):
        assert normwise(a, b) <= 1e-6
    # identity pre with the norm: layer_input is RMSNorm(e) itself
    w = torch.ones(64).bfloat16()
    normed = mhc_fused_hc_delayed(**{**inputs, "norm_weight": w})
    assert torch.equal(normed.layer_input, reference.rms_norm(e, w, 1e-20, torch.float32))


def test_broadcast_fn_sums_streams_in_order():
    fn = torch.randn(24, 4 * 8)
    f = fn.view(24, 4, 8)
    assert torch.equal(reference.broadcast_fn(fn), ((f[:, 0] + f[:, 1]) + f[:, 2]) + f[:, 3])


@pytest.mark.parametrize("norm", [False, True])
def test_chained_seams_carry_pre_mix_cur(norm):
    """A V4.1 forward in miniature: the broadcast entry (identity pre), then seams each carrying the previous
    seam's pre_mix_cur, post_mix_cur and comb_mix_cur, with a no-post (Engram) seam in the chain; every seam
    against the float64 contract."""
    lead, h = (2, 3), 128
    g = torch.Generator().manual_seed(9)
    weights = [make_inputs(1, h, seed=20 + i, norm=norm) for i in range(4)]
    emb = torch.randn(*lead, h, generator=g).bfloat16()
    prev = None
    for i, w in enumerate(weights):
        kw = dict(fn=w["fn"], hc_scale=w["hc_scale"], hc_base=w["hc_base"], norm_weight=w["norm_weight"])
        if prev is None:
            args = dict(x_prev=None, residual_prev=emb, post_mix_prev=None, comb_mix_prev=None, pre_mix_prev=None)
        elif i == 2:  # Engram seam: the post ran on its own, the streams come as they are
            args = dict(x_prev=None, residual_prev=prev.residual_cur, post_mix_prev=None, comb_mix_prev=None,
                        pre_mix_prev=prev.pre_mix_cur)
        else:  # the sublayer's output stands in as a function of its input
            args = dict(x_prev=(prev.layer_input.float() * 0.5).bfloat16(), residual_prev=prev.residual_cur,
                        post_mix_prev=prev.post_mix_cur, comb_mix_prev=prev.comb_mix_cur,
                        pre_mix_prev=prev.pre_mix_cur)
        out = mhc_fused_hc_delayed(**args, **kw)
        assert out.pre_mix_cur.shape == (*lead, 4) and out.layer_input.shape == (*lead, h)
        check_call(out, {**args, **kw})
        prev = out


@pytest.mark.parametrize("op,form,pre", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("lead", [(0,), (2, 0), (0, 3)])
def test_zero_tokens(op, form, pre, lead):
    inputs = make_inputs(1, 64, lead=lead, form=form, pre=pre)
    out = call_seam(inputs)
    assert out.layer_input.shape == (*lead, 64) and out.comb_mix_cur.shape == (*lead, 4, 4)
    if form == "no_post":
        assert out.residual_cur is inputs["residual_prev"]
    else:
        assert out.residual_cur.shape == (*lead, 4, 64)


@pytest.mark.parametrize("op,form,pre", VARIANTS, ids=VARIANT_IDS)
def test_leading_dims_match_flat_calls(op, form, pre):
    inputs = make_inputs(1, 64, lead=(2, 3), seed=8, form=form, pre=pre, norm=True)
    got = call_seam(inputs)
    flat = {k: (v.reshape(6, *v.shape[2:]) if isinstance(v, torch.Tensor) and k not in ("fn", "hc_scale", "hc_base",
            "norm_weight") else v) for k, v in inputs.items()}
    want = call_seam(flat)
    for name, a, b in zip(got._fields, got, want):
        assert torch.equal(a.reshape(b.shape), b), name


@pytest.mark.parametrize("op,form,pre", VARIANTS, ids=VARIANT_IDS)
def test_out_buffers_are_written_and_returned(op, form, pre):
    inputs = make_inputs(5, 64, seed=10, form=form, pre=pre, norm=True)
    want = call_seam(inputs)
    bufs = poisoned_outputs(problem_of(inputs), (5,))
    got = call_seam(inputs, out=bufs)
    for name, a, b, buf in zip(got._fields, got, want, bufs):
        assert torch.equal(a, b), name
        if buf is not None:
            assert a is buf, name
    if form == "no_post":
        assert got.residual_cur is inputs["residual_prev"]


def test_out_without_post_refuses_a_residual_buffer():
    inputs = make_inputs(5, 64, form="no_post", pre="carried")
    bufs = poisoned_outputs(problem_of(make_inputs(5, 64, pre="carried")), (5,))
    assert bufs.residual_cur is not None
    with pytest.raises(ValueError, match=r"mhc_fused_hc_delayed: `out.residual_cur` must be None"):
        mhc_fused_hc_delayed(**inputs, out=bufs)


def test_delayed_out_needs_five_buffers():
    inputs = make_inputs(5, 64, pre="carried")
    bufs = poisoned_outputs(problem_of(inputs), (5,))
    with pytest.raises(ValueError, match=r"`out` must be a tuple of 5 tensors"):
        mhc_fused_hc_delayed(**inputs, out=bufs[:4])
    with pytest.raises(ValueError, match=r"`out.pre_mix_cur` must be of shape \[5, 4\] or \[5, 4, 1\]"):
        mhc_fused_hc_delayed(**inputs, out=bufs._replace(pre_mix_cur=torch.empty(5, 3)))
    with pytest.raises(ValueError, match=r"`out.pre_mix_cur` must be a buffer that shares no memory with pre_mix"):
        mhc_fused_hc_delayed(**inputs, out=bufs._replace(pre_mix_cur=inputs["pre_mix_prev"]))


@pytest.mark.parametrize("op,form,pre", VARIANTS, ids=VARIANT_IDS)
def test_torch_compile_fullgraph(op, form, pre):
    inputs = make_inputs(3, 64, seed=11, form=form, pre=pre, norm=True, lead=(3,))
    want = call_seam(inputs)
    got = torch.compile(lambda **kw: call_seam(kw), fullgraph=True, backend="eager")(**inputs)
    for name, a, b in zip(want._fields, got, want):
        assert torch.equal(a, b), name
    bufs = poisoned_outputs(problem_of(inputs), (3,))
    got = torch.compile(lambda i, o: call_seam(i, out=o), fullgraph=True, backend="eager")(inputs, bufs)
    for name, a, b in zip(want._fields, got, want):
        assert torch.equal(a, b), name


@pytest.mark.slow
def test_torch_compile_inductor_delayed():
    inputs = make_inputs(3, 64, seed=12, pre="carried", norm=True)
    want = mhc_fused_hc_delayed(**inputs)
    got = torch.compile(lambda **kw: mhc_fused_hc_delayed(**kw).layer_input * 2, fullgraph=True)(**inputs)
    assert torch.equal(got, want.layer_input * 2)


def test_inference_tensors_and_no_grad():
    inputs = make_inputs(4, 64, seed=13, pre="carried", norm=True)
    want = mhc_fused_hc_delayed(**inputs)
    with torch.inference_mode():
        frozen = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
        got = mhc_fused_hc_delayed(**frozen)
    for name, a, b in zip(want._fields, got, want):
        assert torch.equal(a, b), name
    pre = inputs["pre_mix_prev"].clone().requires_grad_()
    with pytest.raises(ValueError, match=r"mhc_fused_hc_delayed: `pre_mix_prev` must be a tensor that does not req"):
        mhc_fused_hc_delayed(**{**inputs, "pre_mix_prev": pre})
    with torch.no_grad():
        mhc_fused_hc_delayed(**{**inputs, "pre_mix_prev": pre})


def test_run_backend_writes_every_element():
    for form, pre in (("regular", "carried"), ("broadcast", "identity"), ("no_post", "carried")):
        problem = problem_of(make_inputs(6, 64, seed=14, form=form, pre=pre, norm=True))
        out = run_backend(problem, "torch")
        assert all(t is None or torch.isfinite(t.float()).all() for t in out)


def test_accuracy_check_catches_delayed_errors():
    problem = problem_of(make_inputs(6, 64, seed=15, pre="carried", norm=False))
    good = run_backend(problem, "torch")
    check_outputs(good, problem)
    li = good.layer_input.clone()
    li.view(torch.int16)[0, 0] += 1  # one bf16 ulp in one element
    with pytest.raises(AssertionError, match="layer_input"):
        check_outputs(good._replace(layer_input=li), problem)
    with pytest.raises(AssertionError, match="pre_mix_cur"):
        check_outputs(good._replace(pre_mix_cur=good.pre_mix_cur * (1 + 1e-4)), problem)
    normed = problem._replace(norm_weight=torch.ones(64).bfloat16())
    out = run_backend(normed, "torch")
    check_outputs(out, normed)
    li = out.layer_input.clone()
    li.view(torch.int16)[2, 5] += 2
    with pytest.raises(AssertionError, match="layer_input"):
        check_outputs(out._replace(layer_input=li), normed)


BAD = [
    ("post_mix without x", dict(x_prev=None), "post_mix_prev", "None when x_prev is None"),
    ("pre_mix shape", dict(pre_mix_prev=torch.ones(5, 3)), "pre_mix_prev", r"of shape \[5, 4\] or \[5, 4, 1\]"),
    ("pre_mix dtype", dict(pre_mix_prev=torch.ones(5, 4, dtype=torch.float64)), "pre_mix_prev", "torch.float32"),
    ("pre_mix type", dict(pre_mix_prev=[1.0, 0, 0, 0]), "pre_mix_prev", "a torch.Tensor"),
    ("residual dtype", dict(x_prev=None, post_mix_prev=None, comb_mix_prev=None,
                            residual_prev=torch.ones(5, 4, 64)), "residual_prev", "torch.bfloat16"),
    ("broadcast fn width", dict(x_prev=None, post_mix_prev=None, comb_mix_prev=None,
                                residual_prev=torch.ones(5, 32, dtype=torch.bfloat16)), "fn", r"of shape \[24, 128\]"),
    ("pre_mix lead", dict(x_prev=None, post_mix_prev=None, comb_mix_prev=None,
                          residual_prev=torch.ones(6, 4, 64, dtype=torch.bfloat16)), "pre_mix_prev", r"\[6, 4\]"),
    ("residual not a tensor", dict(x_prev=None, post_mix_prev=None, comb_mix_prev=None, residual_prev=[1.0]),
     "residual_prev", "a torch.Tensor"),
    ("fn shape", dict(fn=torch.ones(24, 255)), "fn", r"of shape \[24, 256\]"),
    ("fn dtype", dict(fn=torch.ones(24, 256, dtype=torch.bfloat16)), "fn", "torch.float32"),
    ("hc_scale shape", dict(hc_scale=torch.ones(4)), "hc_scale", r"of shape \[3\]"),
    ("hc_base dtype", dict(hc_base=torch.ones(24, dtype=torch.float64)), "hc_base", "torch.float32"),
    ("hc_base device", dict(hc_base=torch.ones(24, device="meta")), "hc_base", r"on the same device as x_prev"),
    ("norm_weight shape", dict(norm_weight=torch.ones(63, dtype=torch.bfloat16)), "norm_weight", r"of shape \[64\]"),
    ("norm_weight dtype", dict(norm_weight=torch.ones(64, dtype=torch.float16)), "norm_weight", "torch.bfloat16"),
    ("rms_eps", dict(rms_eps=0.0), "rms_eps", "> 0"),
    ("hc_pre_eps", dict(hc_pre_eps=float("nan")), "hc_pre_eps", "a finite float"),
    ("hc_sinkhorn_eps", dict(hc_sinkhorn_eps=-1.0), "hc_sinkhorn_eps", ">= 0"),
    ("norm_eps", dict(norm_eps=float("inf")), "norm_eps", "a finite float"),
    ("sinkhorn_repeat", dict(sinkhorn_repeat=0), "sinkhorn_repeat", "an int >= 1"),
    ("precision", dict(precision="bf16"), "precision", "one of"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_names_the_argument(case):
    _, change, name, expected = case
    inputs = {**make_inputs(5, 64, pre="carried"), **change}
    with pytest.raises(ValueError, match=rf"^mhc_fused_hc_delayed: `{name}` must be .*{expected}"):
        mhc_fused_hc_delayed(**inputs)


def test_v4_seam_refuses_carried_gates_and_half_posts():
    inputs = make_inputs(5, 64)
    with pytest.raises(TypeError, match="unexpected keyword argument 'pre_mix_prev'"):
        mhc_fused_hc(**inputs, pre_mix_prev=torch.ones(5, 4))
    with pytest.raises(ValueError, match=r"^mhc_fused_hc: `comb_mix_prev` must be None when x_prev is None"):
        mhc_fused_hc(**{**inputs, "x_prev": None, "post_mix_prev": None})


@pytest.mark.parametrize("backend", ["half_fma", "all_fma"])
def test_the_fma_paths_broadcast_entry_needs_whole_chunks_in_a_quarter_of_h(monkeypatch, backend):
    """Paths E/F walk the embedding as four quarters of H / 4 in 64-position chunks: H % 256 != 0 is refused
    with the reason (checked before anything runs, so on any machine)."""
    monkeypatch.setattr(backends, "unavailable_reason", lambda name, d: None)
    inputs = make_inputs(3, 320, form="broadcast", pre="identity")
    want = rf"backend '{backend}' needs H % 256 == 0 for the broadcast entry; got H = 320"
    with pytest.raises(ValueError, match=want):
        mhc_fused_hc_delayed(**inputs, backend=backend)
    from mhc_cute import tactics

    with pytest.raises(ValueError, match="needs H a multiple of 256"):
        tactics.fma_broadcast_tactic(tactics.default_fma_tactic(backend, 3, 320), 320)
    # a burst wider than a quarter holds is narrowed: every seam tactic valid at H % 256 == 0 runs the entry
    wide = tactics.parse_tactic(f"{backend}:k4:t8:n6:w256:s2:b4:fbw")  # 4352 / 4 = 1088 = 17 chunks
    assert tactics.fma_broadcast_tactic(wide, 4352).burst == 1


def test_fma_broadcast_tactic_keeps_the_k_of_a_cta():
    """The broadcast entry's tactic on paths E/F: a quarter of the splits over H / 4, so each CTA projects as many
    K elements as in the seam; where a quarter does not divide, the largest split that gives whole chunks."""
    from dataclasses import replace

    from mhc_cute import tactics

    t = tactics.parse_tactic("half_fma:k112:t1:n6:w256:s1:b1:flat")
    b = tactics.fma_broadcast_tactic(t, 7168)
    assert b == replace(t, split_k=28) and 7168 // 4 // b.split_k == 7168 // t.split_k
    odd = tactics.parse_tactic("all_fma:k7:t8:n6:w256:s1:b1:fbw")  # 7168 / 7 = 1024 per CTA
    assert tactics.fma_broadcast_tactic(odd, 7168).split_k == 1  # 1792 / 64 = 28 chunks in one CTA
    from mhc_cute import autotune

    for h in (512, 4096, 4352, 5120, 7168):
        for m in (1, 16, 100, 300, 4096):
            for path in ("half_fma", "all_fma"):
                for seam in autotune.candidate_tactics(path, m, h, 132):  # the defaults and what the tuner tries
                    if seam.invalid_reason(h) is None:
                        tactics.fma_broadcast_tactic(seam, h)  # valid: check() passes


def test_auto_asks_the_selector_for_the_delayed_seams_pick(monkeypatch):
    """``auto`` asks the selector for the delayed seam's pick (its own tuned tables, else the V4 seam's: the same
    kernels with a flag); where that pick cannot run the form at this H (paths E/F's broadcast entry at
    H % 256 != 0), ``pick_auto_for``: path B on a GPU, Triton where it cannot run, else the reference."""
    from mhc_cute import api, selector

    asked = []

    def resolve(dev, m, h, precision, norm, seam):
        asked.append((m, h, precision, norm, seam))
        return "half_fma", "half_fma:k80:t1:n6:w256:s1:b1:flat"

    monkeypatch.setattr(selector.SELECTOR, "resolve", resolve)
    monkeypatch.setattr(backends, "unavailable_reason", lambda name, d: None)
    problem = problem_of(make_inputs(3, 5120, pre="carried", norm=True))
    b, tactic = api._resolve(problem, "auto", None)
    assert b is backends.BACKENDS["half_fma"] and tactic == "half_fma:k80:t1:n6:w256:s1:b1:flat"
    assert asked == [(3, 5120, "fp32", True, "delayed")]
    api._resolve(problem_of(make_inputs(3, 5120, norm=True)), "auto", None)
    assert asked[-1] == (3, 5120, "fp32", True, "v4")
    dev = torch.device("cuda", 0)
    assert backends.pick_auto_for(dev, "broadcast", 320) == "half_mma"
    monkeypatch.setattr(backends, "unavailable_reason", lambda name, d: "no sm_90" if "mma" in name else None)
    assert backends.pick_auto_for(dev, "broadcast", 320) == "triton"
    assert backends.pick_auto_for(dev, "broadcast", 100) == "torch"  # no kernel backend tiles H = 100
    assert backends.pick_auto_for(torch.device("cpu"), "broadcast", 320) == "torch"


@pytest.mark.parametrize("pre", [None, "carried"])
def test_out_under_torch_compile_with_changing_m(pre):
    """A compiled caller that passes out= at several M: torch.compile makes M symbolic from the second size on,
    and the out= checks must still accept the buffers."""
    compiled = torch.compile(lambda i, o: call_seam(i, out=o), fullgraph=True, backend="eager")
    for m in (3, 5, 7):
        inputs = make_inputs(m, 64, seed=m, pre=pre)
        got = compiled(inputs, poisoned_outputs(problem_of(inputs), (m,)))
        assert torch.equal(got.layer_input, call_seam(inputs).layer_input)


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("h", [64])
@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("op,form,pre", VARIANTS, ids=VARIANT_IDS)
def test_triton_interpreter_variants_cpu(op, form, pre, m, h, norm):
    check_variant("triton", m, h, form, pre, norm)


# with the norm, every flag of the kernels at least once (the interpreter takes seconds per case)
DOT_VARIANTS = [("fused_hc", "no_post", None), ("fused_hc", "broadcast", None),
                ("fused_hc_delayed", "regular", "carried"), ("fused_hc_delayed", "broadcast", "identity")]


@pytest.mark.parametrize("op,form,pre,norm", [(*v, True) for v in DOT_VARIANTS],
                         ids=[variant_id(v) for v in DOT_VARIANTS])
def test_triton_interpreter_dot_and_chunks_cpu(op, form, pre, norm):
    """The tensor-core projection (16-token blocks, over H for the broadcast entry) and the per-chunk launches."""
    from mhc_cute.triton.configs import TritonTactic

    skip_unless_available("triton")
    problem = problem_of(make_inputs(17, 128, seed=31, norm=norm, form=form, pre=pre))
    for tactic in (TritonTactic(16, 64, 2, 4, reduce_block_t=4, reduce_block_h=64),
                   TritonTactic(2, 32, 3, 4, reduce_block_t=2, reduce_block_h=64, chunk_m=8)):
        check_outputs(run_backend(problem, "triton", tactic), problem)


_TRITON_COMPILE = r"""
from mhc_cute.triton import aot, configs

target = aot.TARGETS["sm90"]
for m in (1, 1 << 20):
    t = configs.select_tactic("sm90", 132, m, 5120)
    for form in (dict(DELAYED=True, HAS_NORM=True), dict(DELAYED=True, IDENTITY=True), dict(HAS_POST=False),
                 dict(HAS_POST=False, DELAYED=True, IDENTITY=True), dict(HAS_POST=False, BROADCAST=True, DELAYED=True),
                 dict(HAS_POST=False, BROADCAST=True, DELAYED=True, IDENTITY=True, HAS_NORM=True)):
        aot.compile_main(t, target, form)
    aot.compile_reduce(t, 5120, True, target, delayed=True)
    aot.compile_reduce(t, 5120, False, target, broadcast=True)
print("compiled")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests compile and run the kernels")
def test_triton_variants_compile_for_hopper():
    """The delayed seam's and the entry forms' kernels compile for sm90 outside the interpreter."""
    compile_outside_interpreter(_TRITON_COMPILE)


# --- on the GPU: every backend of the delayed seam and the entry forms ------------------------------------------

GPU_MS = [1, 2, 3, 16, 17, 64, 100, 1000, 8192]
GPU_HS = [512, 4096, 5120, 7168]


GPU_CASES = [(backend, op, form, pre) for op, form, pre in VARIANTS for backend in SEAM_BACKENDS]


@pytest.mark.gpu
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("h", GPU_HS)
@pytest.mark.parametrize("m", GPU_MS)
@pytest.mark.parametrize("backend,op,form,pre", GPU_CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}-{c[3]}" for c in GPU_CASES])
def test_gpu_variants(backend, op, form, pre, m, h, norm):
    check_variant(backend, m, h, form, pre, norm, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("m", [1, 17, 4096])
@pytest.mark.parametrize("backend", SEAM_BACKENDS + ["auto"])
def test_gpu_residual_bitwise_equal_to_the_v4_seam(backend, m, norm):
    inputs = make_inputs(m, 5120, seed=m, device="cuda", norm=norm, pre="carried")
    skip_unless_available(backend, "cuda")
    d = mhc_fused_hc_delayed(**inputs, backend=backend)
    v4 = mhc_fused_hc(**{k: v for k, v in inputs.items() if k != "pre_mix_prev"})
    assert torch.equal(d.residual_cur.view(torch.int16), v4.residual_cur.view(torch.int16))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", SEAM_BACKENDS + ["auto"])
@pytest.mark.parametrize("op,form,pre", VARIANTS, ids=VARIANT_IDS)
def test_gpu_graph_capture_and_side_stream(backend, op, form, pre):
    """Captured in a CUDA graph with static out= buffers, replayed on new inputs copied in place, and run on a
    side stream: the same bits as eager calls."""
    skip_unless_available(backend, "cuda")
    static = make_inputs(33, 4096, seed=1, device="cuda", norm=True, form=form, pre=pre)
    bufs = poisoned_outputs(problem_of(static), (33,))
    call_seam(static, backend=backend, out=bufs)  # warm (compile, prepare the weight) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call_seam(static, backend=backend, out=bufs)
    fresh = make_inputs(33, 4096, seed=2, device="cuda", norm=True, form=form, pre=pre)
    for k, v in fresh.items():
        if isinstance(v, torch.Tensor) and k not in ("fn", "hc_scale", "hc_base", "norm_weight"):
            static[k].copy_(v)
    graph.replay()
    want = call_seam(static, backend=backend)
    for name, a, b in zip(want._fields, bufs, want):
        if a is not None:
            assert torch.equal(a, b), name
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = call_seam(static, backend=backend)
    torch.cuda.current_stream().wait_stream(side)
    for name, a, b in zip(want._fields, got, want):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("op,form,pre", VARIANTS, ids=VARIANT_IDS)
def test_every_variant_is_planned_once(op, form, pre, monkeypatch):
    """Every op and form goes through the API's plans: later calls of a signature reuse its plan (same results, fresh
    outputs; without a post residual_cur stays residual_prev itself)."""
    made = fresh_plans(monkeypatch)
    inputs = make_inputs(3, 64, seed=21, form=form, pre=pre)
    first, again = call_seam(inputs), call_seam(inputs)
    assert len(made) == 1
    for a, b in zip(first, again):
        if form == "no_post" and a is first.residual_cur:
            assert a is b is inputs["residual_prev"]
        else:
            assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()


@pytest.mark.parametrize("seam_mode", [None, "carried", "identity"])
def test_kernel_launch_passes_the_seam_arguments(seam_mode):
    """A CuTe path's prepared launch calls its compiled kernels in their compiled order: inputs (the prepared weight
    in fn's place), the four outputs, scratch, then the delayed seam's pre_mix_prev and pre_mix_cur (None, None for
    mhc_fused_hc), then the scalars."""
    from mhc_cute import tactics
    from mhc_cute.kernels import scalar_args, spec_problem
    from mhc_cute.kernels.launch import KernelLaunch

    calls = []
    p = spec_problem(64, "fp32", None, seam_mode)
    out = p.empty_outputs()
    tactic = tactics.default_fma_tactic("all_fma", p.m, p.hidden)
    weight = torch.zeros(1)
    KernelLaunch(lambda *args: calls.append(args), p, tactic, counters=1, weight=lambda fn: weight)(p.inputs, out)
    (args,) = calls
    assert len(args) == 8 + 4 + 2 + 2 + 6
    expected_inputs = (*p.inputs[:4], weight, *p.inputs[5:8])
    assert all(a is b for a, b in zip(args[:8], expected_inputs))
    assert all(a is b for a, b in zip(args[8:12], out[:4]))
    seam_args = (p.pre_mix, out.pre_mix_cur) if seam_mode else (None, None)
    assert all(a is b for a, b in zip(args[14:16], seam_args))
    assert args[16:] == tuple(scalar_args(p.scalars))



@pytest.mark.parametrize("op", ["fused_hc", "fused_hc_delayed"])
def test_auto_without_post_takes_its_seams_pick_where_it_has_the_form(monkeypatch, op):
    """An entry seam's ``auto``: its seam's tuned pick with its tactic, as every CuTe path runs both entry forms;
    where the pick cannot run the broadcast entry at this H (paths E/F at H % 256 != 0), ``pick_auto_for`` (here,
    on the CPU, the reference)."""
    from mhc_cute import api, selector

    picks = {1: ("half_fma", "half_fma:k80:t1:n6:w256:s1:b1:flat"), 4096: ("half_mma", "half_mma:k64:m128:s3:flat")}
    seam = "delayed" if op == "fused_hc_delayed" else "v4"

    def resolve(dev, m, h, precision, norm, asked_seam):
        assert asked_seam == seam
        return picks[m]
    monkeypatch.setattr(selector.SELECTOR, "resolve", resolve)
    monkeypatch.setattr(backends, "unavailable_reason", lambda name, d: None)
    pre = "carried" if op == "fused_hc_delayed" else None
    for m in (1, 4096):
        problem = problem_of(make_inputs(m, 512, form="no_post", pre=pre))
        assert problem.op == op and problem.form == "no_post"
        b, tactic = api._resolve(problem, "auto", None)
        assert (b.name, tactic) == picks[m]
    for m, h, want in ((1, 512, picks[1]), (4096, 512, picks[4096]), (1, 320, ("torch", None)),
                       (4096, 320, picks[4096])):
        problem = problem_of(make_inputs(m, h, form="broadcast", pre="identity" if pre else None))
        b, tactic = api._resolve(problem, "auto", None)
        assert (b.name, tactic) == want
