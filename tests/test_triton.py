"""Triton backend: configuration table, device selection (AMD mocked), and interpreter runs with explicit tactics.

The shared grid in test_correctness.py runs the default tactics; here explicit tactics reach the paths the
defaults do not at small H: several K blocks per split, uneven splits, the dot projection, token blocks with a
tail, multi-tile reduce (two-pass norm).
"""

import math
import types

import pytest
import torch
from helpers import compile_outside_interpreter

from mhc_cute.accuracy import check_call, check_outputs, make_inputs, poisoned_outputs, problem_of, run_backend
from mhc_cute import backends
from mhc_cute.api import mhc_fused_hc
from mhc_cute.triton import configs
from mhc_cute.triton.configs import TritonTactic

HS = [64, 512, 4096, 5120, 7168, 8192, 14336]
MS = [1, 2, 3, 8, 16, 17, 64, 100, 256, 1000, 2048, 4096, 8192, 100000]


def _props(arch: str, cus: int):
    if arch.startswith("gfx"):
        return types.SimpleNamespace(gcnArchName=f"{arch}:sramecc+:xnack-", major=9, minor=5,
                                     multi_processor_count=cus)
    return types.SimpleNamespace(gcnArchName="", major=int(arch[2]), minor=int(arch[3:]), multi_processor_count=cus)


# --- the table ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("table", configs.TABLES + (configs.FALLBACK,), ids=lambda t: t.arch)
def test_table_is_well_formed(table):
    limits = [max_m for max_m, _ in table.buckets]
    assert limits == sorted(limits) and len(set(limits)) == len(limits)
    assert limits[-1] >= 1 << 40, "the last bucket must cover every M"
    for _, t in table.buckets:
        assert isinstance(t, TritonTactic)


def test_tables_cover_the_issue_architectures():
    keys = {(t.arch, t.compute_units) for t in configs.TABLES}
    assert {("gfx950", 256), ("gfx942", 304), ("sm90", 132)} <= keys


@pytest.mark.parametrize("arch,cus", [("sm90", 132), ("sm90", 114), ("gfx950", 256), ("gfx942", 304),
                                      ("gfx942", 228), ("sm80", 108), ("gfx1100", 48), ("interpreter", 4)])
@pytest.mark.parametrize("h", HS)
def test_selected_tactic_fits_h(arch, cus, h):
    for m in MS:
        t = configs.select_tactic(arch, cus, m, h)
        n_blocks = h // t.block_h
        assert h % t.block_h == 0 and 1 <= t.split_k <= n_blocks
        per_split = -(-n_blocks // t.split_k)
        assert (t.split_k - 1) * per_split < n_blocks, "a K split would own no H block"
        assert t.reduce_block_h <= max(h, 1 << (h - 1).bit_length())


def test_m_buckets_pick_the_first_that_fits():
    table = configs.table_for("sm90")
    for max_m, tactic in table.buckets[:-1]:
        assert configs.select_tactic("sm90", 132, max_m, 7168) == configs.fit(tactic, 7168)
    assert configs.select_tactic("sm90", 132, 1 << 30, 7168) == configs.fit(table.buckets[-1][1], 7168)


def test_splits_rescale_with_the_cu_count():
    full = configs.select_tactic("gfx950", 256, 1, 7168)
    half = configs.select_tactic("gfx950", 128, 1, 7168)
    assert half.block_m == full.block_m and half.split_k < full.split_k
    assert configs.select_tactic("gfx950", 256, 1, 7168).split_k >= 100  # small M spreads H over the CUs


def test_unknown_gpu_uses_the_fallback():
    assert configs.table_for("gfx1201") is configs.FALLBACK
    assert configs.table_for("sm120") is configs.FALLBACK
    t = configs.select_tactic("sm120", 188, 4096, 7168)
    assert t.block_m == configs.FALLBACK.buckets[-1][1].block_m


def test_fit_clamps_to_h():
    t = configs.fit(TritonTactic(4, 256, 1000, 4, reduce_block_h=8192), 192)
    assert (t.block_h, t.split_k, t.reduce_block_h) == (64, 3, 256)
    assert configs.fit(TritonTactic(4, 64, 5, 4), 512).split_k == 4  # 8 blocks: 2 per split, so 4 splits


@pytest.mark.parametrize("bad", [dict(block_m=3), dict(block_h=8), dict(split_k=0), dict(reduce_block_h=1000)])
def test_tactic_validation(bad):
    kw = dict(block_m=4, block_h=64, split_k=2, num_warps=4) | bad
    (field,) = bad
    with pytest.raises(ValueError, match=rf"^TritonTactic\b.*\b{field}\b"):
        TritonTactic(**kw)


# --- device detection and ROCm selection (AMD properties mocked; nothing here runs on AMD) ---------------------

@pytest.mark.parametrize("arch,cus", [("gfx950", 256), ("gfx942", 304), ("sm90", 132)])
def test_arch_of_device_properties(arch, cus):
    assert configs.arch_of(_props(arch, cus)) == arch


def test_default_tactic_from_mocked_device(monkeypatch):
    from mhc_cute.triton import fused_hc

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: _props("gfx950", 256))
    fused_hc.device_key.cache_clear()
    fused_hc._default_tactic.cache_clear()
    try:
        dev = torch.device("cuda", 0)
        assert fused_hc.device_key(dev) == ("gfx950", 256)
        assert fused_hc._default_tactic(dev, 32, 7168) == configs.select_tactic("gfx950", 256, 32, 7168)
    finally:
        fused_hc.device_key.cache_clear()
        fused_hc._default_tactic.cache_clear()


@pytest.fixture
def rocm(monkeypatch):
    """A ROCm build of torch with one AMD GPU (as torch reports it: device type "cuda", version.hip set)."""
    monkeypatch.setattr(torch.version, "hip", "6.4.43482")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (9, 5))
    monkeypatch.delenv("MHC_CUTE_BACKEND", raising=False)
    backends._unavailable_reason.cache_clear()  # availability is cached per device; the mock changes it
    yield torch.device("cuda", 0)
    backends._unavailable_reason.cache_clear()


def test_rocm_cute_backends_unavailable(rocm):
    for name in ("half_fma", "all_fma", "half_mma", "all_mma"):
        assert backends.unavailable_reason(name, rocm) == "needs an NVIDIA GPU"
    assert backends.unavailable_reason("triton", rocm) is None


def test_rocm_auto_picks_triton(rocm):
    for m in (1, 64, 8192):
        assert backends.pick_auto(rocm, m, 7168) == "triton"
    assert backends.pick_auto(rocm, 4, 96) == "torch"  # H % 64 != 0: no kernel backend


def test_nvidia_auto_prefers_cute_but_triton_is_selectable(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.delenv("MHC_CUTE_BACKEND", raising=False)
    dev = torch.device("cuda", 0)
    monkeypatch.setattr(backends, "unavailable_reason", lambda name, d: None)
    assert backends.pick_auto(dev, 16, 7168) != "triton"
    # without a table: the ranking tuned on the H200 (E up to M = 128, B above)
    assert [backends.pick_auto(dev, m, 6144) for m in (1, 16, 17, 128, 129, 512, 8192)] == \
        ["half_fma", "half_fma", "half_fma", "half_fma", "half_mma", "half_mma", "half_mma"]
    monkeypatch.setattr(backends, "unavailable_reason", lambda name, d: None if name == "triton" else "no")
    assert backends.pick_auto(dev, 16, 7168) == "triton"


def test_forced_backend(rocm, monkeypatch):
    from mhc_cute.selector import Selector

    monkeypatch.setenv("MHC_CUTE_BACKEND", "torch")
    assert Selector().resolve(rocm, 16, 7168, "fp32", False) == ("torch", None)


# --- interpreter runs (CPU) -----------------------------------------------------------------------------------

interpreter = pytest.mark.skipif(backends.unavailable_reason("triton", torch.device("cpu")) is not None,
                                 reason="needs TRITON_INTERPRET=1 and triton")

TACTICS = {
    # 2 token blocks with a tail (M=5), 8 K blocks in 3 uneven splits, reduce: 2 tokens x 4 tiles (two-pass norm)
    "uneven-splits": TritonTactic(4, 32, 3, 4, reduce_block_t=2, reduce_block_h=64),
    # one split walks all of H; tokens one per program
    "one-split": TritonTactic(2, 64, 1, 4, reduce_block_h=128),
    # the dot projection (block_m >= 16)
    "dot": TritonTactic(16, 64, 2, 4, reduce_block_t=4, reduce_block_h=256),
    # the two kernels per chunk of 2 tokens (2 + 2 + 1)
    "chunks": TritonTactic(2, 64, 2, 4, chunk_m=2),
}


@interpreter
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("name", list(TACTICS))
def test_interpreter_tactics(name, norm):
    m, h = (5, 256) if name != "dot" else (17, 128)
    problem = problem_of(make_inputs(m, h, seed=7 + m, norm=norm))
    out = run_backend(problem, "triton", TACTICS[name])
    check_outputs(out, problem)


@interpreter
def test_interpreter_tactics_agree():
    problem = problem_of(make_inputs(5, 256, seed=3, norm=True))
    outs = [run_backend(problem, "triton", t) for t in TACTICS.values()]
    for o in outs[1:]:
        assert torch.equal(o.residual_cur.view(torch.int16), outs[0].residual_cur.view(torch.int16))
        torch.testing.assert_close(o.comb_mix_cur, outs[0].comb_mix_cur, rtol=1e-5, atol=1e-6)


@interpreter
@pytest.mark.parametrize("m", [2, 7])
def test_interpreter_fp32_norm_weight_and_odd_m(m):
    inputs = make_inputs(m, 128, seed=11, norm=True)
    inputs["norm_weight"] = inputs["norm_weight"].float() * 1.01
    problem = problem_of(inputs)
    check_outputs(run_backend(problem, "triton"), problem)


@interpreter
def test_interpreter_other_scalars():
    scalars = dict(rms_eps=1e-5, hc_pre_eps=1e-3, hc_sinkhorn_eps=0.0, hc_post_mult_value=1.0, sinkhorn_repeat=1,
                   norm_eps=1e-5)
    problem = problem_of(make_inputs(3, 64, seed=5, norm=True), **scalars)
    check_outputs(run_backend(problem, "triton"), problem)


@interpreter
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("lead", [(5,), (2, 3)])
def test_interpreter_through_the_api(lead, norm):
    """Every output of a public call on the Triton backend against the float64 contract."""
    inputs = make_inputs(math.prod(lead), 64, seed=1, lead=lead, norm=norm)
    out = mhc_fused_hc(**inputs, backend="triton")
    assert out.residual_cur.shape == (*lead, 4, 64) and out.layer_input.shape == (*lead, 64)
    check_call(out, inputs, "triton")


@interpreter
@pytest.mark.parametrize("lead", [(0,), (2, 0)])
def test_interpreter_through_the_api_without_tokens(lead):
    out = mhc_fused_hc(**make_inputs(0, 64, seed=1, lead=lead), backend="triton")
    assert [tuple(t.shape) for t in out] == [(*lead, 4, 64), (*lead, 4, 1), (*lead, 4, 4), (*lead, 64)]


@interpreter
def test_interpreter_writes_the_callers_buffers():
    inputs = make_inputs(6, 64, seed=2, norm=True, lead=(2, 3))
    want = mhc_fused_hc(**inputs, backend="triton")
    bufs = poisoned_outputs(problem_of(inputs), (2, 3))
    got = mhc_fused_hc(**inputs, backend="triton", out=bufs)
    for g, b, w in zip(got, bufs, want):
        assert g is b and torch.equal(b, w)


# --- ahead-of-time compilation for the target GPUs (no GPU needed) ---------------------------------------------

_COMPILE_SCRIPT = r"""
import re
from mhc_cute.triton import aot, configs

for arch, fma in (("sm90", r"fma\.rn\.f32"), ("gfx950", r"v_(pk_)?fmac?_f32"), ("gfx942", r"v_(pk_)?fmac?_f32")):
    target = aot.TARGETS[arch]
    table = configs.table_for(arch)
    for m in (1, 1 << 20):
        t = configs.select_tactic(arch, table.compute_units, m, 7168)
        k = aot.compile_main(t, target)
        asm = k.asm["ptx" if target.backend == "cuda" else "amdgcn"]
        assert re.search(fma, asm), (arch, m, "no fp32 FMA in the main kernel")
        if target.backend == "cuda":  # compile options reach the PTX (bench/probes/triton_registers.py's register caps)
            assert ".maxnreg 168" in aot.compile_main(t, target, maxnreg=168).asm["ptx"]
        aot.compile_reduce(t, 7168, True, target)
print("compiled")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests compile and run the kernels")
def test_kernels_compile_for_hopper_and_amd():
    """Compile the smallest- and largest-M tactics for sm90, gfx950 and gfx942 on this CPU (Triton's own
    compilers), outside the interpreter; the FMA chain must reach the ISA as fused multiply-adds."""
    compile_outside_interpreter(_COMPILE_SCRIPT)


# --- the prepared weight ----------------------------------------------------------------------------------------

def test_split_bf16x3_is_exact_and_stream_interleaved():
    from mhc_cute.triton.fused_hc import split_bf16x3

    h = 64
    # exact while every term is a normal bf16: |fn| from about 2^-100 up to bf16's largest finite value
    fn = torch.randn(24, 4 * h) * torch.logspace(-25, 25, 24)[:, None]
    fn[0, :2] = torch.tensor([0.0, -0.0])
    terms = split_bf16x3(fn)
    assert terms.shape == (3, 24, 4 * h) and terms.dtype == torch.bfloat16
    total = terms.double().sum(0)  # K order 4 h + j
    assert torch.equal(total, fn.double().view(24, 4, h).transpose(1, 2).reshape(24, 4 * h))


# --- bench/probes/probe_l2_reread.py's kernel, under the interpreter -------------------------------------------

@interpreter
@pytest.mark.parametrize("ratio", [0, 0.25, 1])
def test_l2_reread_probe_copies_and_reads_its_windows(ratio):
    """The probe's copy is exact and its extra reads are the windows it claims (the sums in ``sink``), wrapping
    around the weight, at a ratio below, at and above one extra block per step."""
    from conftest import bench_script

    with bench_script("probes/probe_l2_reread.py") as probe:
        _check_l2_reread_probe(probe, ratio)


def _check_l2_reread_probe(probe, ratio):
    block, per_program = 16, 128
    src = torch.randn(5 * per_program)
    weight = torch.randn(3 * block)
    dst, sink = torch.empty_like(src), torch.full((5,), float("nan"))
    probe.launch(src, dst, weight, sink, per_program, block, ratio)
    assert torch.equal(dst, src)
    expected = probe.expected_sink(src, weight, per_program, block, ratio)
    assert torch.allclose(sink.double(), expected, rtol=1e-5, atol=1e-4)
    assert ratio == 0 or expected.abs().sum() > 0


# --- bench/probes/probe_reread_bound.py's delayed-seam kernels, under the interpreter ------------------------------

@interpreter
@pytest.mark.parametrize("chunk", [3, 5])
def test_reread_bound_probe_moves_the_delayed_seams_bytes(chunk):
    """``--delayed``'s streaming kernels write what the delayed seam writes: ``residual_cur`` per stream, the collapse
    with the carried gates, and the norm pass scales it in place (in chunks of tokens too)."""
    from conftest import bench_script

    m, h = 5, 64
    g = torch.Generator().manual_seed(0)
    s = {"x_prev": torch.randn(m, h, generator=g).bfloat16(),
         "residual_prev": torch.randn(m, 4, h, generator=g).bfloat16(),
         "pre_mix_prev": torch.rand(m, 4, generator=g)}
    with bench_script("probes/probe_reread_bound.py") as probe:
        one_pass = probe.stream_call("delayed one-pass", m, h, 32, chunk, torch.device("cpu"))
        one_pass(s)
        with_norm = probe.stream_call("delayed one-pass + norm", m, h, 32, chunk, torch.device("cpu"))
        with_norm(s)
    rc = (s["x_prev"].float()[:, None] + s["residual_prev"].float()).bfloat16()
    for out in (one_pass, with_norm):  # the interpreter's bf16 rounding may differ by an ulp: bytes are the point
        assert torch.allclose(out.residual_cur.float(), rc.float(), rtol=2**-7, atol=0)
    x1 = (s["pre_mix_prev"][:, :, None] * rc.float()).sum(1).bfloat16()
    assert torch.allclose(one_pass.layer_input.float(), x1.float(), rtol=1e-2, atol=1e-2)
    assert torch.allclose(with_norm.layer_input.float(), (0.5 * one_pass.layer_input.float()).bfloat16().float())
