"""Tests specific to the tensor-core paths B (half_mma) and D (all_mma), beyond the shared correctness suite.

CPU: the TF32 hi + lo split of the weight, its K permutation and cache, the tactic rules, and the compile report
(every variant compiled for sm_90a; its SASS has HGMMA ... TF32 and no local memory). GPU: kernel 1's split-K
partials against float64, and explicit tactics through both paths.
"""

import glob
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from mhc_cute.accuracy import check_outputs, make_inputs, normwise, problem_of, run_backend
from mhc_cute import reference, tactics

mma = pytest.importorskip("mhc_cute.kernels.mma", reason="needs CuTe DSL")

HS = [512, 4096, 5120, 7168]


# --- the weight: TF32 split, permutation, cache --------------------------------------------------------------

def test_tf32_split_parts_are_tf32_and_sum_to_fn():
    fn = torch.randn(24, 4 * 512, generator=torch.Generator().manual_seed(0)) / 45
    hi, lo = mma.split_tf32(fn)
    for part in (hi, lo):
        assert ((part.view(torch.int32) & 0x1FFF) == 0).all(), "low 13 mantissa bits must be clear (TF32)"
    # hi is the nearest TF32 value: within half a TF32 ulp (2^-11 relative)
    assert ((fn - hi).abs() <= fn.abs() * 2.0**-11).all()
    # hi + lo carries about 22 bits: far below the fp32-precision contract of the projection
    rel = ((hi.double() + lo.double() - fn.double()).abs() / fn.double().abs()).max().item()
    assert rel <= 2.0**-21, rel


def test_tf32_rounding_is_to_nearest_even():
    one = torch.tensor([1.0])
    ulp = 2.0**-10
    cases = torch.tensor([1 + ulp / 2, 1 + 3 * ulp / 2, 1 + ulp / 2 + 2.0**-20, -(1 + 3 * ulp / 2)])
    want = torch.tensor([1.0, 1 + 2 * ulp, 1 + ulp, -(1 + 2 * ulp)])
    assert torch.equal(mma.split_tf32(cases)[0], want)
    assert torch.equal(mma.split_tf32(one)[1], torch.zeros(1))


def test_block_permutation_gives_each_quad_thread_8_contiguous_positions():
    perm = mma.block_permutation()
    assert sorted(perm.tolist()) == list(range(32))
    for t in range(4):
        # wgmma gives quad thread t the K columns t and t + 4 of each of the 4 k8 steps of a block
        cols = [8 * s + c for s in range(4) for c in (t, t + 4)]
        assert sorted(perm[cols].tolist()) == list(range(8 * t, 8 * t + 8))


@pytest.mark.parametrize("precision", ["fp32", "tf32"])
def test_prepared_weight_computes_the_projection(precision):
    h = 256
    g = torch.Generator().manual_seed(1)
    fn = torch.randn(24, 4 * h, generator=g) / 32
    xf = torch.randn(5, 4 * h, generator=g).bfloat16().double()
    w = mma.prepare_weight(fn, precision)  # [H/32, 4, n, 32]
    n = 48 if precision == "fp32" else 24
    assert w.shape == (h // 32, 4, n, 32) and w.is_contiguous()
    # the kernel's A in the same K order: block, stream, permuted position
    perm = mma.block_permutation()
    a = xf.view(5, 4, h // 32, 32)[..., perm].permute(0, 2, 1, 3).reshape(5, -1)
    b = w.double().reshape(-1, n, 32).permute(1, 0, 2).reshape(n, -1)
    dots = a @ b.t()
    if precision == "fp32":
        dots = dots[:, :24] + dots[:, 24:]
    ref = xf @ fn.double().t()
    tol = 2.0**-20 if precision == "fp32" else 2.0**-10
    assert normwise(dots, ref) < tol


def test_weight_cache_keys_on_precision():
    fn = torch.randn(24, 4 * 64)
    a = mma.cached_weight(fn, "fp32")
    assert mma.cached_weight(fn, "fp32") is a
    assert mma.cached_weight(fn, "tf32") is not a
    assert torch.equal(a, mma.prepare_weight(fn, "fp32"))


# --- tactics ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["half_mma", "all_mma"])
@pytest.mark.parametrize("h", HS + [64, 128, 192])
def test_default_tactics_are_valid(path, h):
    for m in [1, 3, 17, 64, 100, 1000, 4096, 8192, 100000]:
        t = tactics.default_mma_tactic(path, m, h)
        assert t.path == path and t.invalid_reason(h) is None, (m, t)
        assert tactics.parse_tactic(t.name) == t


def test_tactic_validity_rules():
    ok = tactics.MmaTactic("half_mma", 2, 128, 3)
    assert ok.invalid_reason(7168) is None
    assert "multiple of 64" in tactics.MmaTactic("half_mma", 1, 64, 2).invalid_reason(96)
    assert "split_k" in tactics.MmaTactic("half_mma", 17, 64, 2).invalid_reason(512)
    assert "tile_m" in tactics.MmaTactic("half_mma", 1, 96, 2).invalid_reason(512)
    assert "shared memory" in tactics.MmaTactic("half_mma", 1, 128, 4).invalid_reason(512)
    assert "path" in tactics.MmaTactic("half_fma", 1, 64, 2).invalid_reason(512)
    with pytest.raises(ValueError, match="unknown tactic name 'half_mma:k2'"):
        tactics.parse_tactic("half_mma:k2")


# --- compile report: every variant compiles for sm_90a, HGMMA TF32 in the SASS, no local memory ----------------

VARIANTS = [
    (path, precision, norm, tile_m)
    for path in ("half_mma", "all_mma")
    for precision in ("fp32", "tf32")
    for norm in (None, "bfloat16", "float32")
    for tile_m in (64, 128)
    if not (path == "all_mma" and tile_m == 128)  # the one-launch path's big fuse needs the 64-token tile
]
REPORT_H = 7168


def _variant_tactic(path, tile_m, h):
    return tactics.default_mma_tactic(path, 1, h) if tile_m == 64 else tactics.MmaTactic(path, 2, 128, 3)


def _compile_variants(out_dir: str, h: int, indices) -> None:
    """Subprocess body: compile each variant with CUTE_DSL_KEEP=ptx,cubin, moving its files to ``out_dir/<i>``."""
    dump = os.environ["CUTE_DSL_DUMP_DIR"]
    for i in indices:
        path, precision, norm, tile_m = VARIANTS[i]
        problem = mma.spec_problem(h, precision, norm)
        mma.compile_mma(_variant_tactic(path, tile_m, h), problem, problem.empty_outputs())
        dest = os.path.join(out_dir, str(i))
        os.makedirs(dest)
        for f in glob.glob(os.path.join(dump, "*")):
            shutil.move(f, dest)


@pytest.fixture(scope="module")
def compile_report(tmp_path_factory, dump_env):
    """Every variant compiled for sm_90a with its PTX and cubin kept, in parallel worker processes."""
    out = tmp_path_factory.mktemp("mma_report")
    workers = max(1, min(os.cpu_count() or 1, 8))
    procs = []
    for w in range(workers):
        dump = out / f"dump{w}"
        dump.mkdir()
        indices = list(range(w, len(VARIANTS), workers))
        procs.append(subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "compile", str(out), str(REPORT_H), json.dumps(indices)],
            env=dump_env(dump), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        ))
    for p in procs:
        _, err = p.communicate(timeout=1800)
        assert p.returncode == 0, err[-4000:]
    return out


@pytest.mark.slow
@pytest.mark.xdist_group("mma_compile_report")  # one xdist worker builds the module's report, not each of them
@pytest.mark.parametrize("i", range(len(VARIANTS)), ids=["-".join(map(str, v)) for v in VARIANTS])
def test_compile_report(compile_report, cuobjdump, i):
    path, precision, norm, tile_m = VARIANTS[i]
    n = 48 if precision == "fp32" else 24
    files = os.listdir(compile_report / str(i))
    ptx = [f for f in files if f.endswith(".ptx")]
    cubin = [f for f in files if f.endswith(".cubin")]
    assert ptx and cubin, files
    text = (compile_report / str(i) / ptx[0]).read_text()
    assert ".target sm_90a" in text
    assert f"wgmma.mma_async.sync.aligned.m64n{n}k8.f32.tf32.tf32" in text
    cubin_path = str(compile_report / str(i) / cubin[0])
    sass = subprocess.run([cuobjdump, "-sass", cubin_path], capture_output=True, text=True).stdout
    assert re.search(rf"HGMMA\.64x{n}x8\.F32\.TF32", sass), "no TF32 HGMMA in the SASS"
    usage = subprocess.run([cuobjdump, "--dump-resource-usage", cubin_path], capture_output=True, text=True).stdout
    kernels = re.findall(r"Function (\S+):\s*\n\s*REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", usage)
    assert kernels, usage
    for name, reg, stack, local in kernels:
        assert int(local) == 0 and int(stack) == 0, f"{name}: local memory (spills) {local} B, stack {stack} B"
        # one CTA per SM (shared memory bounds it), so registers cost no occupancy up to the 255 cap; the bound
        # catches growth before it turns into spills
        assert int(reg) <= 240, f"{name}: {reg} registers"


# --- GPU: kernel 1's partials against float64, explicit tactics through both paths --------------------------

def _cuda_problem(m, h, norm=False, precision="fp32", seed=0):
    return problem_of(make_inputs(m, h, seed=seed, device="cuda", norm=norm), precision)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "tf32"])
@pytest.mark.parametrize("m,h,tactic", [
    (1, 512, "half_mma:k16:m64:s2:flat"),
    (77, 4096, "half_mma:k5:m64:s4:fbw"),
    (300, 7168, "half_mma:k3:m128:s3:fbw"),
    (130, 5120, "half_mma:k1:m128:s2:flat"),
])
def test_gpu_partials_against_float64(m, h, tactic, precision):
    problem = _cuda_problem(m, h, precision=precision, seed=m)
    t = tactics.parse_tactic(tactic)
    out = run_backend(problem, "half_mma", t)
    rc = reference.post(problem.x, problem.residual, problem.post_mix, problem.comb_mix)
    assert torch.equal(out.residual_cur.view(torch.int16), rc.view(torch.int16))
    from mhc_cute.workspace import get_workspace

    partials = get_workspace(problem.x.device).partials(0)[: t.split_k * m * 32].view(t.split_k, m, 32)
    total = partials.double().sum(0)
    xf = rc.reshape(m, -1).double()
    dots = xf @ problem.fn.double().t()
    err = normwise(total[:, :24], dots)
    assert err < (5e-5 if precision == "fp32" else 2e-3), err
    sumsq = (xf * xf).sum(-1)
    assert ((total[:, 24] - sumsq).abs() / sumsq).max().item() < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("tactic", [
    "half_mma:k7:m128:s3:fbw", "half_mma:k28:m64:s5:flat", "all_mma:k1:m64:s2:fbw", "all_mma:k9:m64:s4:fbw",
    "all_mma:k56:m64:s3:fbw",
])
@pytest.mark.parametrize("m", [1, 65, 333])
def test_gpu_explicit_tactics(m, tactic, norm):
    t = tactics.parse_tactic(tactic)
    problem = _cuda_problem(m, 7168, norm=norm, seed=3 * m)
    out = run_backend(problem, t.path, t)
    check_outputs(out, problem, mix_tol=2e-5)
    again = run_backend(problem, t.path, t)
    for a, b in zip(out, again):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), "not deterministic"


if __name__ == "__main__" and sys.argv[1:2] == ["compile"]:
    _compile_variants(sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4]))
