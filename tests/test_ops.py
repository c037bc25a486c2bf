"""The standalone ops (``mhc_post``, ``mhc_collapse``, ``mhc_head``): the shared suite against the float64 reference on
every backend, the API (leading dims, M = 0, out=, torch.compile) and bad input."""

import math

import pytest
import torch
from helpers import OP_CPU_CASES, OP_GPU_CASES, misaligned, skip_unless_op_available

import mhc_cute
from mhc_cute import mhc_collapse, mhc_fused_hc, mhc_head, mhc_post, ops, reference
from mhc_cute.accuracy import (
    STANDALONE_OPS, call_op, check_op, check_op_output, make_inputs, make_op_inputs, op_output_like,
)

GPU_MS = [1, 2, 3, 16, 17, 64, 100, 1000, 4096, 8192, 100_003]
GPU_HS = [512, 4096, 5120, 7168]


def _run_and_check(op, backend, m, h, norm, device, lead=None):
    skip_unless_op_available(op, backend, device)
    inputs = make_op_inputs(op, m, h, seed=m + h, device=device, norm=norm, lead=lead)
    check_op(op, inputs, backend)


# what the contract check reports for an output off by more than it allows
CHECK_FAILURE = {"mhc_post": r"mhc_post: \d+ elements differ bitwise",
                 "mhc_collapse": r"layer_input: \d+ elements beyond", "mhc_head": r"layer_input: \d+ elements beyond"}


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("h", [64, 256])
@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("op,backend", OP_CPU_CASES)
def test_cpu_backends(op, backend, m, h, norm):
    if op == "mhc_post" and norm:
        pytest.skip("mhc_post has no norm")
    _run_and_check(op, backend, m, h, norm, "cpu")


@pytest.mark.parametrize("op,h", [("mhc_head", 1088), ("mhc_collapse", 8256), ("mhc_post", 1088)])
def test_triton_multi_tile_rows(op, h):
    """Rows longer than one tile (the head's and the collapse's H loop with a partial last tile, and the norm's
    second pass over the stored row)."""
    _run_and_check(op, "triton", 2, h, op != "mhc_post", "cpu")


@pytest.mark.parametrize("m,h,norm,split", [(1, 1088, True, (1, 5)), (2, 4160, False, (1, 17)),
                                            (256, 320, True, (8, 2)), (300, 192, False, (8, 1))])
def test_triton_head_splits(m, h, norm, split):
    """The Triton head's two phases at each kind of split (``triton.ops.head_split``: tokens per program, H chunks):
    one token over many chunks, blocks of tokens (the weight read once per block) over one or more; the partials are
    summed in order."""
    from mhc_cute.triton.ops import head_split

    block_t, _, chunks = head_split(m, h)
    assert (block_t, chunks) == split
    _run_and_check("mhc_head", "triton", m, h, norm, "cpu")


def test_check_in_row_chunks(monkeypatch):
    """The check of many rows runs in chunks (any M fits the float64 reference) and still finds a wrong row."""
    import mhc_cute.accuracy as acc

    monkeypatch.setattr(acc, "CHECK_ELEMENTS", 3 * 4 * 64)
    for op in STANDALONE_OPS:
        inputs = make_op_inputs(op, 10, 64, seed=12, norm=op != "mhc_post", lead=(2, 5))
        out = call_op(op, inputs, "torch")
        check_op_output(op, out, inputs)
        out.view(-1)[-1] = out.view(-1)[-1] * 1.5
        with pytest.raises(AssertionError, match=CHECK_FAILURE[op]):
            check_op_output(op, out, inputs)


@pytest.mark.parametrize("op", STANDALONE_OPS)
def test_torch_backend_in_row_chunks(monkeypatch, op):
    """The torch backend of each op runs in chunks of rows (bounded memory at any M): chunks of 3 rows over 10 tokens
    (in leading dims [2, 5]) still meet the contract in every row."""
    monkeypatch.setattr(reference, "ROW_CHUNK_ELEMENTS", 3 * 4 * 64)
    assert len(reference.row_chunks(10, 64)) == 4
    _run_and_check(op, "torch", 10, 64, op != "mhc_post", "cpu", lead=(2, 5))


@pytest.mark.parametrize("op", STANDALONE_OPS)
def test_torch_backend_model_sizes(op):
    for h in (4096, 7168):
        _run_and_check(op, "torch", 3, h, True, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("h", GPU_HS)
@pytest.mark.parametrize("m", GPU_MS)
@pytest.mark.parametrize("op,backend", OP_GPU_CASES)
def test_gpu_backends(op, backend, m, h, norm):
    if op == "mhc_post" and norm:
        pytest.skip("mhc_post has no norm")
    if m * h > 100_003 * 4096:
        pytest.skip("inputs drawn on the host: the largest M at the two small H only (2^31 offsets: their own test)")
    _run_and_check(op, backend, m, h, norm, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("op,backend", [(op, b) for op, b in OP_GPU_CASES if b != "torch"])
def test_gpu_past_2_31_elements(op, backend):
    """Offsets past 2^31 elements (residual [M, 4, H] at M = 74,899, H = 7168): 64-bit row offsets."""
    _run_and_check(op, backend, 75_000, 7168, op != "mhc_post", "cuda")


# --- the ops against the seams ------------------------------------------------------------------------------------

def test_post_same_bits_as_the_seam():
    s = make_inputs(7, 128, seed=3)
    seam = mhc_fused_hc(**s, backend="torch")
    got = mhc_post(s["x_prev"], s["residual_prev"], s["post_mix_prev"], s["comb_mix_prev"])
    assert torch.equal(got.view(torch.int16), seam.residual_cur.view(torch.int16))


def test_head_with_the_seam_weight_is_the_seam_collapse():
    """A head whose weight, scale and base are the pre rows of a seam's: its output is the seam's layer_input on the
    same residual (the same gates, the same collapse), with or without the norm."""
    s = make_inputs(5, 64, seed=9, norm=True)
    seam = mhc_fused_hc(**s, backend="torch")
    got = mhc_head(seam.residual_cur, s["fn"][:4], s["hc_scale"][:1], s["hc_base"][:4], norm_weight=s["norm_weight"],
                   backend="torch")
    ref = mhc_fused_hc(**s, backend="torch")
    assert torch.equal(got, ref.layer_input)


@pytest.mark.parametrize("norm", [False, True])
def test_head_as_a_seam_without_post_is_the_head(norm):
    """mhc_head's "seam" backend, a seam without post on the padded head weight: on the CPU (the seam's torch
    backend) that composition gives the head's reference bits."""
    inputs = make_op_inputs("mhc_head", 5, 64, seed=13, norm=norm)
    out = torch.empty(5, 64, dtype=torch.bfloat16)
    ops._head_as_seam(*(inputs[k] for k in ("residual", "head_fn", "head_scale", "head_base", "norm_weight")),
                      1e-6, 1e-6, 1e-6, out)
    assert torch.equal(out, mhc_head(**inputs, backend="torch"))


def test_collapse_of_one_hot_gates_is_that_stream():
    inputs = make_op_inputs("mhc_collapse", 4, 64, seed=2)
    for j in range(4):
        gates = torch.zeros(4, 4)
        gates[:, j] = 1
        for backend in ops.available("mhc_collapse", torch.device("cpu")):
            got = mhc_collapse(inputs["residual"], gates, backend=backend)
            assert torch.equal(got, inputs["residual"][:, j]), (j, backend)


# --- API: leading dims, M = 0, out=, compile -------------------------------------------------------------------

@pytest.mark.parametrize("op", STANDALONE_OPS)
@pytest.mark.parametrize("lead", [(2, 3), (1, 1, 4)])
def test_leading_dims(op, lead):
    inputs = make_op_inputs(op, 0, 64, seed=4, norm=op != "mhc_post", lead=lead)
    got = call_op(op, inputs)
    flat = {k: (v.reshape(math.prod(lead), *v.shape[len(lead):]) if isinstance(v, torch.Tensor) and v.dim() > 1
                and tuple(v.shape[:len(lead)]) == lead else v) for k, v in inputs.items()}
    want = call_op(op, flat)
    assert got.shape == lead + want.shape[1:]
    assert torch.equal(got.reshape(want.shape), want)


def test_alternative_mix_shapes():
    inputs = make_op_inputs("mhc_post", 3, 64)
    want = mhc_post(**inputs)
    got = mhc_post(inputs["x"], inputs["residual"], inputs["post_mix"].reshape(3, 4),
                   inputs["comb_mix"].reshape(3, 16))
    assert torch.equal(got, want)
    c = make_op_inputs("mhc_collapse", 3, 64)
    assert torch.equal(mhc_collapse(c["residual"], c["pre_mix"][..., None]), mhc_collapse(**c))


@pytest.mark.parametrize("op", STANDALONE_OPS)
def test_zero_tokens(op):
    inputs = make_op_inputs(op, 0, 64, lead=(0, 3))
    got = call_op(op, inputs)
    assert got.shape[:2] == (0, 3) and got.dtype == torch.bfloat16
    buf = op_output_like(op, inputs)
    assert call_op(op, inputs, out=buf) is buf


@pytest.mark.parametrize("op", STANDALONE_OPS)
def test_out_is_written_and_returned(op):
    inputs = make_op_inputs(op, 6, 64, seed=6, norm=op != "mhc_post", lead=(2, 3))
    want = call_op(op, inputs)
    buf = op_output_like(op, inputs)
    assert call_op(op, inputs, out=buf) is buf
    assert torch.equal(buf, want)


@pytest.mark.parametrize("op", STANDALONE_OPS)
def test_outputs_fresh_and_inputs_untouched(op):
    inputs = make_op_inputs(op, 5, 64, norm=op != "mhc_post")
    before = {k: v.clone() for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    out = call_op(op, inputs)
    for k, v in before.items():
        assert torch.equal(inputs[k], v), f"{k} was modified"
        assert out.untyped_storage().data_ptr() != inputs[k].untyped_storage().data_ptr()


@pytest.mark.parametrize("op", STANDALONE_OPS)
def test_non_contiguous_inputs(op):
    inputs = make_op_inputs(op, 4, 64, norm=op != "mhc_post")
    want = call_op(op, inputs)
    nc = dict(inputs, residual=inputs["residual"].transpose(0, 1).contiguous().transpose(0, 1))
    assert not nc["residual"].is_contiguous()
    assert torch.equal(call_op(op, nc), want)


@pytest.mark.parametrize("op", STANDALONE_OPS)
def test_torch_compile_fullgraph(op):
    inputs = make_op_inputs(op, 6, 64, seed=7, norm=op != "mhc_post", lead=(2, 3))
    want = call_op(op, inputs)
    got = torch.compile(lambda i: call_op(op, i) * 2, fullgraph=True)(inputs)
    assert torch.equal(got, want * 2)
    buf = op_output_like(op, inputs)
    got = torch.compile(lambda i, o: call_op(op, i, out=o), fullgraph=True, backend="eager")(inputs, buf)
    assert torch.equal(buf, want)


def test_exported():
    for name in ("mhc_post", "mhc_head", "mhc_collapse"):
        assert name in mhc_cute.__all__ and callable(getattr(mhc_cute, name))


# --- bad input --------------------------------------------------------------------------------------------------

BAD_INPUTS = {
    "mhc_post": {
        "x not a tensor": (lambda i: dict(i, x=1.0), "x"),
        "x dtype": (lambda i: dict(i, x=i["x"].float()), "x"),
        "residual shape": (lambda i: dict(i, residual=i["residual"][:, :3]), "residual"),
        "residual tokens": (lambda i: dict(i, residual=i["residual"][:2]), "residual"),
        "post_mix dtype": (lambda i: dict(i, post_mix=i["post_mix"].double()), "post_mix"),
        "post_mix shape": (lambda i: dict(i, post_mix=i["post_mix"].reshape(3, 2, 2)), "post_mix"),
        "comb_mix shape": (lambda i: dict(i, comb_mix=i["comb_mix"][:, :3]), "comb_mix"),
        "comb_mix device": (lambda i: dict(i, comb_mix=torch.empty(3, 4, 4, device="meta")), "comb_mix"),
        "residual not a tensor": (lambda i: dict(i, residual=None), "residual"),
    },
    "mhc_collapse": {
        "residual 1-D": (lambda i: dict(i, residual=i["residual"][0, 0]), "residual"),
        "residual dtype": (lambda i: dict(i, residual=i["residual"].float()), "residual"),
        "pre_mix shape": (lambda i: dict(i, pre_mix=i["pre_mix"][:, :3]), "pre_mix"),
        "pre_mix dtype": (lambda i: dict(i, pre_mix=i["pre_mix"].bfloat16()), "pre_mix"),
        "norm_weight shape": (lambda i: dict(i, norm_weight=i["norm_weight"][:32]), "norm_weight"),
        "norm_eps": (lambda i: dict(i, norm_eps=0.0), "norm_eps"),
        "pre_mix not a tensor": (lambda i: dict(i, pre_mix=None), "pre_mix"),
        "pre_mix device": (lambda i: dict(i, pre_mix=torch.empty(3, 4, device="meta")), "pre_mix"),
        "norm_weight device": (lambda i: dict(i, norm_weight=torch.ones(64, device="meta")), "norm_weight"),
    },
    "mhc_head": {
        "residual shape": (lambda i: dict(i, residual=i["residual"][:, :2]), "residual"),
        "head_fn shape": (lambda i: dict(i, head_fn=i["head_fn"][:, :64]), "head_fn"),
        "head_fn dtype": (lambda i: dict(i, head_fn=i["head_fn"].bfloat16()), "head_fn"),
        "head_scale shape": (lambda i: dict(i, head_scale=torch.ones(3)), "head_scale"),
        "head_base shape": (lambda i: dict(i, head_base=torch.ones(24)), "head_base"),
        "norm_weight dtype": (lambda i: dict(i, norm_weight=i["norm_weight"].half()), "norm_weight"),
        "rms_eps": (lambda i: dict(i, rms_eps=-1.0), "rms_eps"),
        "hc_eps": (lambda i: dict(i, hc_eps=float("nan")), "hc_eps"),
        "head_fn not a tensor": (lambda i: dict(i, head_fn=None), "head_fn"),
        "head_base device": (lambda i: dict(i, head_base=torch.ones(4, device="meta")), "head_base"),
    },
}
BAD_CASES = [(op, case) for op, cases in BAD_INPUTS.items() for case in cases]


@pytest.mark.parametrize("op,case", BAD_CASES)
def test_bad_input_names_the_argument(op, case):
    make_bad, name = BAD_INPUTS[op][case]
    inputs = make_bad(make_op_inputs(op, 3, 64, norm=True if op != "mhc_post" else False))
    with pytest.raises(ValueError, match=f"^{op}: `{name}` must be"):
        call_op(op, inputs)


BAD_OUT = {
    "not a tensor": lambda o, i: (o,),
    "dtype": lambda o, i: o.float(),
    "shape": lambda o, i: o[..., :32],
    "device": lambda o, i: torch.empty(o.shape, dtype=o.dtype, device="meta"),
    "non-contiguous": lambda o, i: o.transpose(0, -1).contiguous().transpose(0, -1),
    "misaligned": lambda o, i: misaligned(o),
    "overlaps an input": lambda o, i: i["residual"].view(-1)[:o.numel()].view(o.shape),
}


@pytest.mark.parametrize("case", list(BAD_OUT))
@pytest.mark.parametrize("op", STANDALONE_OPS)
def test_bad_out_is_refused(op, case):
    inputs = make_op_inputs(op, 3, 64, seed=8)
    bad = BAD_OUT[case](op_output_like(op, inputs), inputs)
    before = {k: v.clone() for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(ValueError, match=f"{op}: `out`"):
        call_op(op, inputs, out=bad)
    for k, v in before.items():
        assert torch.equal(inputs[k], v)


@pytest.mark.parametrize("op", STANDALONE_OPS)
def test_inputs_requiring_grad_are_refused(op):
    inputs = make_op_inputs(op, 3, 64)
    name = "residual"
    inputs[name] = inputs[name].float().requires_grad_().bfloat16()
    with pytest.raises(ValueError, match=f"`{name}`.*inference-only"):
        call_op(op, inputs)
    with torch.no_grad():
        call_op(op, inputs)


def test_unknown_and_unavailable_backends(monkeypatch):
    inputs = make_op_inputs("mhc_head", 2, 64)
    with pytest.raises(ValueError, match="unknown backend 'half_fma'"):
        mhc_head(**inputs, backend="half_fma")
    monkeypatch.setattr(ops, "unavailable_reason", lambda op, name, device: "no GPU here" if name == "cute" else None)
    with pytest.raises(RuntimeError, match=r"^mhc_post: backend 'cute' is unavailable on cpu \(no GPU here\); "
                                           r"available here: \['auto', 'triton', 'torch'\]"):
        mhc_post(**make_op_inputs("mhc_post", 2, 64), backend="cute")


@pytest.mark.parametrize("op,backend", [(op, b) for op, b in OP_GPU_CASES if ops.OP_BACKENDS[op][b].h_multiple > 1])
def test_backend_h_multiple(op, backend, monkeypatch):
    """A backend that tiles H refuses another H before anything runs (so on any machine: availability faked)."""
    monkeypatch.setattr(ops, "unavailable_reason", lambda op, name, device: None)
    mult = ops.OP_BACKENDS[op][backend].h_multiple
    h = 64 + mult // 2
    with pytest.raises(ValueError, match=rf"^{op}: backend '{backend}' needs H % {mult} == 0; got H = {h}"):
        call_op(op, make_op_inputs(op, 2, h), backend)


# --- the checker can fail ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("op", STANDALONE_OPS)
def test_checker_catches_a_one_ulp_error(op):
    inputs = make_op_inputs(op, 4, 64, seed=11, norm=op != "mhc_post")
    out = call_op(op, inputs, "torch")
    check_op_output(op, out, inputs)
    bad = out.clone()
    bits = bad.view(torch.int16).view(-1)
    bits[5] += 2  # two bf16 ulps off in one element
    with pytest.raises(AssertionError, match=CHECK_FAILURE[op]):
        check_op_output(op, bad, inputs)
    bad = out.clone()
    bad.view(-1)[0] = float("nan")
    with pytest.raises(AssertionError, match="non-finite"):
        check_op_output(op, bad, inputs)


def test_norm_check_allows_the_row_shift_of_an_outlier_flip():
    """An fp32 collapse within its bound may round an outlier channel to the other side of a bf16 midpoint; the norm's
    rms, taken over that row, then moves every element of the row (seen on the soak's outlier draws at large M). Such an
    output is within the contract; a larger shift of the row is not."""
    h = 64
    residual = torch.randn(1, 4, h, generator=torch.Generator().manual_seed(3)).bfloat16()
    residual[0, :, 0] = torch.tensor([-145.0, 6.75, -160.0, 145.0])  # the collapse is -305.00002: a bf16 midpoint
    pre_mix = torch.tensor([[1.0000009380655794, 1.883955589174338e-05, 1.000001, 1e-06]])
    weight = torch.ones(h, dtype=torch.bfloat16)
    inputs = dict(residual=residual, pre_mix=pre_mix, norm_weight=weight)
    collapse = (pre_mix.double()[:, :, None] * residual.double()).sum(1)
    assert collapse[0, 0].bfloat16().item() == -306.0
    collapse[0, 0] = -304.99998  # 2e-5 off: well within 8 fp32 ulps of the terms' magnitude
    x = collapse.bfloat16().double()
    assert x[0, 0].item() == -304.0
    valid = (x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-20)).bfloat16()
    check_op_output("mhc_collapse", valid, inputs)
    with pytest.raises(AssertionError, match=CHECK_FAILURE["mhc_collapse"]):
        check_op_output("mhc_collapse", (valid.double() * 1.03).bfloat16(), inputs)


def test_head_auto_takes_the_seam_form_on_a_gpu(monkeypatch):
    """mhc_head's auto: the seam form on a GPU, at every M (as measured), the reference on the CPU."""
    monkeypatch.setattr(ops, "unavailable_reason", lambda op, name, device: None)
    cuda = torch.device("cuda")
    assert ops._resolve("mhc_head", "auto", cuda, 7168) is ops.OP_BACKENDS["mhc_head"]["seam"]
    assert ops._resolve("mhc_head", "auto", torch.device("cpu"), 64) is ops.OP_BACKENDS["mhc_head"]["torch"]


@pytest.mark.parametrize("op", STANDALONE_OPS)
def test_a_recent_signature_skips_the_full_checks(op, monkeypatch):
    """A call of a recent signature runs its plan without the full checks (same bits, a fresh output, the leading
    dims); a misaligned input of that signature is copied as on the full path; after a good call every bad input of
    ``BAD_INPUTS`` is still refused by name."""
    from mhc_cute.signatures import RecentSignatures

    checks = []
    init = ops._Checker.__init__
    monkeypatch.setattr(ops, "_RECENT", {o: RecentSignatures() for o in ops.OP_BACKENDS})
    monkeypatch.setattr(ops._Checker, "__init__", lambda self, *a: checks.append(a) or init(self, *a))
    inputs = make_op_inputs(op, 6, 64, seed=9, norm=op != "mhc_post", lead=(2, 3))
    first = call_op(op, inputs)
    again = call_op(op, {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()})
    assert len(checks) == 1
    assert torch.equal(first, again) and first.data_ptr() != again.data_ptr() and again.shape == first.shape
    first_arg = "x" if op == "mhc_post" else "residual"
    moved = misaligned(inputs[first_arg])
    moved.copy_(inputs[first_arg])
    assert torch.equal(call_op(op, dict(inputs, **{first_arg: moved})), first) and len(checks) == 1
    good = make_op_inputs(op, 3, 64, norm=op != "mhc_post")
    for case, (make_bad, name) in BAD_INPUTS[op].items():
        call_op(op, good)
        with pytest.raises(ValueError, match=f"{op}: `{name}`"):
            call_op(op, make_bad(good))
