"""The correctness suite every backend runs: float64 reference, poisoned outputs, determinism."""

import contextlib

import pytest
import torch
from helpers import CPU_BACKENDS, KERNEL_BACKENDS, SEAM_BACKENDS, skip_unless_available

from mhc_cute.accuracy import call_seam, check_backend, make_inputs, problem_of

GPU_MS = [1, 2, 3, 16, 17, 64, 100, 256, 1000, 4096, 8192]
GPU_HS = [512, 4096, 5120, 7168]


def _run_and_check(backend, m, h, norm, device, precision="fp32", seed=0):
    skip_unless_available(backend, device)
    check_backend(problem_of(make_inputs(m, h, seed=seed + m + h, device=device, norm=norm), precision), backend)


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("h", [256, 4096, 5120, 7168])
@pytest.mark.parametrize("m", [1, 3, 17, 64])
def test_torch_backend_cpu(m, h, norm):
    _run_and_check("torch", m, h, norm, "cpu")


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("h", [64, 256])
@pytest.mark.parametrize("m", [1, 3, 5])
def test_triton_interpreter_cpu(m, h, norm):
    _run_and_check("triton", m, h, norm, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("h", GPU_HS)
@pytest.mark.parametrize("m", GPU_MS)
@pytest.mark.parametrize("backend", SEAM_BACKENDS)
def test_gpu_backend(backend, m, h, norm):
    _run_and_check(backend, m, h, norm, "cuda")


@contextlib.contextmanager
def _global_setting(get, set_, value):
    """A torch-wide setting set to ``value`` for the block, restored after."""
    before = get()
    set_(value)
    try:
        yield
    finally:
        set_(before)


def _check_caller_contexts(backend, h, device, pre=None):
    """The same bits whatever the caller's context: inputs made under ``torch.inference_mode`` (as a serving engine
    may load its weights) called in and out of it; calls under bf16 autocast or with TF32 matmuls allowed (neither may
    lower the projection's precision), and with another default dtype or device (nothing internal may follow them);
    and the float64 contract for the inference tensors. ``pre``: the delayed seam's carried gates ("carried"), or
    None for ``mhc_fused_hc``."""
    skip_unless_available(backend, device)
    inputs = make_inputs(17, h, seed=5, device=device, norm=True, pre=pre)
    with torch.inference_mode():
        frozen = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
    assert frozen["fn"].is_inference()
    expected = call_seam(inputs, backend)
    contexts = {"inference_mode": (frozen, torch.inference_mode), "no_grad": (frozen, torch.no_grad),
                "autocast": (inputs, lambda: torch.autocast(device, dtype=torch.bfloat16)),
                # "high", common in serving code, lets fp32 matmuls run in TF32
                "tf32 matmuls": (inputs, lambda: _global_setting(torch.get_float32_matmul_precision,
                                                                 torch.set_float32_matmul_precision, "high")),
                "float64 default dtype": (inputs, lambda: _global_setting(torch.get_default_dtype,
                                                                          torch.set_default_dtype, torch.float64)),
                "meta default device": (inputs, lambda: torch.device("meta"))}
    for context, (args, enter) in contexts.items():
        with enter():
            got = call_seam(args, backend)
        for name, a, b in zip(got._fields, got, expected):
            assert torch.equal(a, b), (context, name)
    check_backend(problem_of(frozen, "fp32"), backend)


@pytest.mark.parametrize("pre", [None, "carried"], ids=["fused_hc", "fused_hc_delayed"])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_caller_contexts_cpu(backend, pre):
    _check_caller_contexts(backend, 256, "cpu", pre)


@pytest.mark.gpu
@pytest.mark.parametrize("pre", [None, "carried"], ids=["fused_hc", "fused_hc_delayed"])
@pytest.mark.parametrize("backend", SEAM_BACKENDS)
def test_gpu_caller_contexts(backend, pre):
    _check_caller_contexts(backend, 4096, "cuda", pre)


@pytest.mark.gpu
@pytest.mark.parametrize("h", [4096, 7168])
@pytest.mark.parametrize("m", [1, 17, 1000, 8192])
@pytest.mark.parametrize("backend", ["half_mma", "all_mma"])
def test_gpu_tf32(backend, m, h):
    _run_and_check(backend, m, h, True, "cuda", precision="tf32")


def shipped_picks():
    """(H, M, tactic name, norm) of every row of the shipped tables: the tactics ``auto`` runs on their GPU."""
    from mhc_cute import selector

    picks = set()
    for key, rows in selector.load_shipped_tables().items():
        k = selector.TuneKey.parse(key)
        picks |= {(k.hidden, m, choice.tactic, k.norm) for m, choice in rows.items() if choice.tactic}
    return sorted(picks)


@pytest.mark.gpu
@pytest.mark.parametrize("h,m,name,norm", shipped_picks())
def test_gpu_shipped_table_picks(h, m, name, norm):
    """Every tactic of the shipped tables at its bucket's M, called by name (so on any GPU, not only the one the
    table is for), against the float64 contract."""
    from mhc_cute import tactics

    tactic = tactics.parse_tactic(name)
    check_backend(problem_of(make_inputs(m, h, seed=m + h, device="cuda", norm=norm), "fp32"), tactic.path, tactic)


# the big fuse with its Sinkhorn two lanes per token ("latp", "bwp") against its one-lane shape, per H
PAIR_TACTICS = {7168: ["half_fma:k112:t8:n6:w256:s1:b1:f{}", "half_mma:k8:m64:s3:f{}"],
                 4096: ["half_fma:k64:t8:n6:w256:s1:b1:f{}", "half_mma:k8:m64:s3:f{}"]}


@pytest.mark.gpu
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("shape", ["lat", "bw"])
@pytest.mark.parametrize("m,h,which", [(1, 7168, 0), (17, 4096, 0), (333, 7168, 1), (16, 4096, 1)])
def test_gpu_pair_sinkhorn_same_bits(m, h, which, shape, norm):
    """The two-lane Sinkhorn sums in the same order as the one-lane one: same bits, and the float64 contract."""
    from mhc_cute import tactics
    from mhc_cute.accuracy import run_backend

    one, pair = (tactics.parse_tactic(PAIR_TACTICS[h][which].format(s)) for s in (shape, shape + "p"))
    problem = problem_of(make_inputs(m, h, seed=5 * m + h, device="cuda", norm=norm), "fp32")
    check_backend(problem, pair.path, pair)
    want, got = run_backend(problem, one.path, one), run_backend(problem, pair.path, pair)
    for a, b in zip(want, got):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def warp_mma_tactics(path: str, h: int) -> list:
    """Path E/F tactics with the projection on warp-level MMA: one 16- and one 32-token tile (two MMA tiles) with
    a chunk per CTA, 8 tokens (half a tile) over four chunks, pipelined, and 3 tokens in 128-thread CTAs."""
    from mhc_cute.tactics import FmaTactic

    return [FmaTactic(path, h // 64, 16, 6, 256, warp_mma=True), FmaTactic(path, h // 64, 32, 6, 256, warp_mma=True),
            FmaTactic(path, h // 256, 8, 6, 256, 2, 2, warp_mma=True),
            FmaTactic(path, h // 128, 3, 6, 128, warp_mma=True)]


@pytest.mark.gpu
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("h", GPU_HS)
@pytest.mark.parametrize("m", [1, 16, 17, 100, 1000])
@pytest.mark.parametrize("which", range(4))
@pytest.mark.parametrize("path", ["half_fma", "all_fma"])
def test_gpu_fma_warp_mma(path, which, m, h, norm):
    """The FMA paths' tensor-core projection (``warp_mma``) against the float64 contract of the FMA paths."""
    tactic = warp_mma_tactics(path, h)[which]
    problem = problem_of(make_inputs(m, h, seed=7 * m + h + which, device="cuda", norm=norm), "fp32")
    check_backend(problem, path, tactic)


@pytest.mark.gpu
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("backend", SEAM_BACKENDS)
def test_gpu_saturated_gates(backend, norm):
    """Mixes far outside the sigmoid's range (|hc_base| of 100-300): gates of 0 and 1 (in fp32 1 + exp(-x)
    overflows to inf), a one-hot comb softmax; every output finite and within the float64 contract."""
    inputs = make_inputs(17, 4096, seed=11, device="cuda", norm=norm)
    signs = torch.tensor([1.0, -1.0] * 12, device="cuda")
    inputs["hc_base"] = signs * torch.linspace(100.0, 300.0, 24, device="cuda")
    skip_unless_available(backend, "cuda")
    check_backend(problem_of(inputs, "fp32"), backend)


# Row offsets past 2^31 elements: the first row of residual_cur [M, 4H] that a 32-bit element offset cannot reach
# (M = 74,899 at H = 7168), and the first of x_prev / layer_input [M, H] (M = 299,594: 43 GB of operands, slow).
LARGE_H = 7168
LARGE_FIRST_PAST = (2**31 // (4 * LARGE_H) + 1, 2**31 // LARGE_H + 1)
LARGE_ROWS_PAST = 67  # rows after the first one past the boundary
LARGE_CASES = [(LARGE_FIRST_PAST[0], False), (LARGE_FIRST_PAST[0], True),
               pytest.param(LARGE_FIRST_PAST[1], True, marks=pytest.mark.slow)]


def _large_problem(first_past: int, norm: bool, delayed: bool = False):
    """A problem whose rows run ``LARGE_ROWS_PAST`` past ``first_past`` (the first row whose offset passes 2^31
    elements), made on the GPU; the op is row-wise, so any rows of it can be checked against the reference of those
    rows alone. ``delayed``: the delayed seam's, with carried gates."""
    from mhc_cute.problem import Problem, Scalars
    from mhc_cute.reference import sinkhorn

    m, h = first_past + LARGE_ROWS_PAST, LARGE_H
    small = make_inputs(1, h, seed=3, device="cuda", norm=norm)
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16, generator=g)
    residual = torch.randn(m, 4, h, device="cuda", dtype=torch.bfloat16, generator=g)
    post = torch.sigmoid(torch.randn(m, 4, device="cuda", generator=g)) * 2
    comb = sinkhorn(torch.randn(m, 4, 4, device="cuda", generator=g), 1e-6, 20)
    pre = torch.sigmoid(torch.randn(m, 4, device="cuda", generator=g)) + 1e-6 if delayed else None
    return Problem(x, residual, post, comb, small["fn"], small["hc_scale"], small["hc_base"], small["norm_weight"],
                   Scalars(), "fp32", pre, delayed)


@pytest.mark.gpu
@pytest.mark.parametrize("first_past,norm", LARGE_CASES)
@pytest.mark.parametrize("delayed", [False, True], ids=["fused_hc", "fused_hc_delayed"])
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_gpu_offsets_past_int32(backend, delayed, first_past, norm):
    """Rows whose element offsets pass 2^31 are read and written where they belong: every output written (poisoned
    with NaN first), and rows at the start, on both sides of the boundary and at the end within the float64
    contract. A 32-bit offset wraps there (negative addresses: a fault, or another row's data). Both seams: the
    delayed one also reads the carried gates' rows and writes its collapse and ``pre_mix_cur`` per row."""
    from mhc_cute.accuracy import check_outputs, run_backend, tolerances

    skip_unless_available(backend, "cuda")
    # bytes: inputs and outputs (20 per token and H position) and the checks' temporaries
    need = (first_past + LARGE_ROWS_PAST) * LARGE_H * 25
    torch.cuda.empty_cache()  # what earlier tests left in torch's caching allocator counts as used
    if torch.cuda.mem_get_info()[0] < need:
        pytest.skip(f"needs {need / 2**30:.0f} GiB of free GPU memory")
    problem = _large_problem(first_past, norm, delayed)
    out = run_backend(problem, backend)
    for name, t in zip(out._fields, out):
        assert not t.isnan().any().item(), f"{name}: unwritten (NaN-poisoned) elements"
    m = problem.m
    rows = torch.tensor([0, 1, 2, first_past - 2, first_past - 1, first_past, first_past + 1, m - 2, m - 1],
                        device="cuda")
    sub = problem._replace(x=problem.x[rows], residual=problem.residual[rows], post_mix=problem.post_mix[rows],
                           comb_mix=problem.comb_mix[rows], pre_mix=None if problem.pre_mix is None else
                           problem.pre_mix[rows])
    check_outputs(type(out)(*(t[rows] for t in out)), sub, **tolerances(backend, "fp32"))
