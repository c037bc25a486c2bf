"""CI (no GPU): every supported variant of the FMA paths compiles for sm_90a, the small-M load order holds in
the SASS of path E and its warp-MMA projection compiles to TF32 HMMA without spills (checked with Triton's bundled
cuobjdump), and the grid-barrier and publication probes of bench/ compile.

Variants cover each compile-time branch: both paths, no norm / bf16 / fp32 norm weight, the default tactic of
every M bucket, token tiles 1..24, tile_n 3..24, 128/256/512 threads, one or two pipeline stages, the projection
on FFMA or on warp-level MMA, splits that do and do not divide evenly among the big fuse's warps, and a small and a
large H. Compiles run in worker processes (CuTe DSL compilation is not thread-safe and is CPU-bound).
"""

import importlib
import os
import re
import subprocess
import sys

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

pytest.importorskip("cutlass.cute")
pytest.importorskip("tvm_ffi")

from mhc_cute import tactics as tac  # noqa: E402
from mhc_cute.tactics import FUSE_SHAPES, FmaTactic  # noqa: E402

NORMS = (None, "torch.bfloat16", "torch.float32")


def variants() -> list:
    specs = []
    for path in tac.FMA_PATHS:
        for i, (bucket_m, *_) in enumerate(tac.FMA_BUCKETS):  # every bucket, H and norm flag in turn
            h = (7168, 512)[i % 2]
            specs.append((tac.default_fma_tactic(path, min(bucket_m, 1 << 20), h).name, h, NORMS[i % 3]))
        extra = [
            (FmaTactic(path, 7, 16, 3, 256, 2, 4), 7168),  # 16 tokens, tile_n 3, pipelined, burst, split 7 (uneven)
            (FmaTactic(path, 28, 1, 12, 256), 7168),  # tile_n 12: chunk 128
            (FmaTactic(path, 5, 2, 6, 128, 2), 5120),  # 128 threads: chunk 32
            (FmaTactic(path, 4, 2, 24, 512), 4096),  # tile_n 24: one column group
            (FmaTactic(path, 1, 8, 6, 256, 2), 256),  # split 1
            (FmaTactic(path, 112, 16, 6, 256, warp_mma=True), 7168),  # tensor-core projection, one MMA tile
            (FmaTactic(path, 4, 24, 6, 128, 2, 2, warp_mma=True), 512),  # two MMA tiles (one partial), pipelined
        ]
        if path == "half_fma":  # CTAs one to an SM (a launch with reserved shared memory)
            extra += [(FmaTactic(path, 112, 32, 6, 256, fuse="lat", warp_mma=True, one_per_sm=True), 7168),
                      (FmaTactic(path, 64, 8, 6, 256, one_per_sm=True), 4096)]
        specs += [(t.name, h, NORMS[i % 2]) for i, (t, h) in enumerate(extra)]
    return specs


@pytest.mark.slow
def test_every_fma_variant_compiles(tmp_path, monkeypatch):
    from mhc_cute.kernels import KERNEL_CACHE_ENV, fma

    specs = variants()
    for name, h, _ in specs:
        assert tac.parse_tactic(name).invalid_reason(h) is None, (name, h)
    monkeypatch.setenv(KERNEL_CACHE_ENV, str(tmp_path))  # workers persist: proves export works too
    done = fma.precompile(specs, processes=os.cpu_count())
    assert sorted(done) == sorted(n for n, _, _ in dict.fromkeys(specs))
    assert len(list(tmp_path.glob("*.o"))) == len(set(specs))


@pytest.mark.parametrize("fuse", FUSE_SHAPES)
@pytest.mark.parametrize("norm", [None, torch.float32])
def test_standalone_big_fuse_shapes_compile(norm, fuse):
    """Path E with each shape of its big-fuse kernel, at an H whose 8-vectors do not fill the last batch."""
    from mhc_cute.kernels import fma, spec_problem
    from mhc_cute.tactics import FmaTactic

    problem = spec_problem(1088, "fp32", None if norm is None else "float32")
    tactic = FmaTactic("half_fma", 17, 2, 6, 256, fuse=fuse)
    assert fma.compile_fma(tactic, problem, problem.empty_outputs()) is not None  # running needs a GPU


@pytest.mark.parametrize("hidden", [256, 1088, 4096, 7168, 16384])
def test_latency_big_fuse_shape(hidden):
    """The "lat" big fuse: one batch of loads per thread covers the token (one memory round trip), and the last
    warp is the Sinkhorn's alone (no collapse work, so none waits behind that chain)."""
    from mhc_cute.kernels.big_fuse import standalone_big_fuse

    phase = standalone_big_fuse(hidden, 8, None, "lat").phase
    assert phase.sinkhorn_warp and phase.tokens == 1 and phase.groups == 1
    assert phase.threads == phase.group_threads + 32 <= 1024
    assert phase.batches == 1 and phase.slots * phase.group_threads >= hidden // 8
    bw = standalone_big_fuse(hidden, 8, None, "bw").phase
    assert not bw.sinkhorn_warp and bw.group_threads == bw.threads == 128


_COMPILE = """
import sys
from mhc_cute import tactics
from mhc_cute.kernels import collapse, fma, mma, post, spec_problem
kind, hidden = sys.argv[1], int(sys.argv[2])
norm = sys.argv[3] if len(sys.argv) > 3 and sys.argv[3] != "none" else None
delayed = sys.argv[4] if len(sys.argv) > 4 else None
if kind == "collapse":
    collapse.compile_collapse(*collapse.spec_operands(hidden, norm))
elif kind == "post":
    post.compile_post(hidden, *post.spec_operands(hidden))
else:
    problem = spec_problem(hidden, "fp32", norm, delayed)
    compile_fn = mma.compile_mma if kind.split(":")[0].endswith("_mma") else fma.compile_fma
    compile_fn(tactics.parse_tactic(kind), problem, problem.empty_outputs())
"""  # argv: a tactic name (paths B/D/E/F), "collapse" or "post"; H; the norm dtype name or "none" (default); the
# delayed seam's gates ("carried", "identity"; default: mhc_fused_hc)

def compiled_variant(tmp_path, dump_env, cuobjdump, *args) -> tuple[str, str]:
    """One variant compiled for sm_90a by ``_COMPILE`` (``args``: its argv) in a subprocess, its cubin kept in
    ``tmp_path``: (``cuobjdump -sass`` text, ``--dump-resource-usage`` text)."""
    subprocess.run([sys.executable, "-c", _COMPILE, *args], env=dump_env(tmp_path, "cubin"), check=True,
                   timeout=1800, capture_output=True)
    (cubin,) = tmp_path.glob("*.cubin")
    sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    usage = subprocess.run([cuobjdump, "--dump-resource-usage", str(cubin)], capture_output=True, text=True).stdout
    return sass, usage


def sass_functions(sass: str) -> dict:
    """``cuobjdump -sass`` text -> {kernel name: [opcode of each instruction, predicates dropped]}."""
    return {name: [[t for t in line.split() if not t.startswith("@")][0].rstrip(";") for line in lines]
            for name, lines in sass_lines(sass).items()}


def sass_lines(sass: str) -> dict:
    """``cuobjdump -sass`` text -> {kernel name: [instruction text]}."""
    out, name = {}, None
    for line in sass.splitlines():
        if "Function : " in line:
            name = line.split("Function : ")[1].strip()
            out[name] = []
        elif name and re.match(r"\s+/\*[0-9a-f]{4}\*/", line):
            out[name].append(line.split("*/", 1)[1].split("/*")[0].strip())
    return out


def loads_issued_together(functions: dict, collapse: bool = True) -> list:
    """What breaks the small-M load order in path E's two kernels (empty: nothing). Kernel 1 must issue every
    global load before its first FMA; the big fuse's collapse warps must issue every load of the partials before
    they start summing them (FADD), and (``collapse``: the V4 seam's big fuse) before their first barrier the 16-byte
    loads of their first collapse batch too. Their path to that barrier is the first stretch of code between
    barriers and exits that has those loads and ends at a barrier (in the "lat" shape the Sinkhorn warp's branch,
    which exits, comes first); the partials' loads (4-byte) are the stretch that has the most of them."""
    problems = []
    for name, ops in functions.items():
        if "FmaFusedHc" in name:
            first = next(i for i, op in enumerate(ops) if op.startswith("FFMA"))
            late = sum(op.startswith("LDG") for op in ops[first:])
            if late:
                problems.append(f"kernel 1: {late} global loads after the first FFMA")
        elif "BigFuseKernel" in name:
            stretches, stretch = [], []
            for op in ops:
                stretch.append(op)
                if op in ("BAR.SYNC.DEFER_BLOCKING", "EXIT"):
                    stretches.append(stretch)
                    stretch = []
            if collapse:
                head = next((s for s in stretches if s[-1] != "EXIT" and "LDG.E.128" in s), [])
                first_add = next((i for i, op in enumerate(head) if op == "FADD"), len(head))
                late = sum(op == "LDG.E.128" for op in head[first_add:])
                if late or not head:
                    problems.append(f"big fuse: {late} collapse-batch loads after the partial sums start"
                                    + ("" if head else " (no collapse-batch loads before a barrier)"))
            sums = max(stretches, key=lambda s: s.count("LDG.E"))
            first_add = next((i for i, op in enumerate(sums) if op == "FADD"), len(sums))
            late = sums[first_add:].count("LDG.E")
            if late:
                problems.append(f"big fuse: {late} of {sums.count('LDG.E')} partial loads after the sum starts")
    return problems


@pytest.mark.slow
@pytest.mark.parametrize("norm, delayed", [("none", None), ("bfloat16", "carried")])
def test_small_m_loads_in_flight_together(tmp_path, cuobjdump, dump_env, norm, delayed):
    """The small-M load-order fix (commit 2dfa9bd), kept by the compiled code: path E at M = 1, H = 7168 (the shipped
    pick) issues its loads so that each kernel waits for one memory round trip before computing (the compiler had put up
    to five in series; on the H200 the fix took 0.7-1.1 µs off a call at M <= 16). Also the delayed seam with the norm,
    whose big fuse summed the partials while most of their loads were still to be issued (docs/experiments.md,
    2026-12-05)."""
    tactic = "half_fma:k112:t1:n6:w256:s1:b1:flat"
    args = [tactic, "7168", norm] + ([delayed] if delayed else [])
    sass, _ = compiled_variant(tmp_path, dump_env, cuobjdump, *args)
    functions = sass_functions(sass)
    assert sum("FmaFusedHc" in n or "BigFuseKernel" in n for n in functions) == 2, list(functions)
    assert loads_issued_together(functions, collapse=delayed is None) == []


@pytest.mark.slow
def test_warp_mma_projection_sass(tmp_path, cuobjdump, dump_env):
    """Path E's projection on warp MMA (the shipped pick at M = 32, H = 7168: two 16-row tiles, two 16-wide K
    vectors per warp) compiles to TF32 HMMA, 3 column tiles x 2 k8 steps x 2 vectors x 2 row tiles x (hi, lo) = 48
    per warp, and spills nothing."""
    tactic = "half_fma:k112:t32:n6:w256:s1:b1:flat:mma"
    sass, usage = compiled_variant(tmp_path, dump_env, cuobjdump, tactic, "7168")
    (kernel1,) = [ops for name, ops in sass_functions(sass).items() if "FmaFusedHc" in name]
    assert kernel1.count("HMMA.1688.F32.TF32") == 48
    spills = re.findall(r"STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", usage)
    assert spills and all(s == ("0", "0") for s in spills), usage


@pytest.mark.slow
@pytest.mark.parametrize("norm, delayed", [("none", None), ("none", "carried"), ("bfloat16", "carried")])
def test_mma_kernel1_spills_nothing(tmp_path, cuobjdump, dump_env, norm, delayed):
    """Path B's kernel 1 at `auto`'s M = 256 pick (H = 7168, two MMA warpgroups), both seams: nothing spilled at the
    168 registers a 288-thread CTA gets (before the widening and the two-``if`` role split, the delayed seam's main loop spilled:
    docs/experiments.md, 2026-12-05)."""
    args = ["half_mma:k64:m128:s3:flat", "7168", norm] + ([delayed] if delayed else [])
    _, usage = compiled_variant(tmp_path, dump_env, cuobjdump, *args)
    spills = re.findall(r"STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", usage)
    assert len(spills) == 2 and all(s == ("0", "0") for s in spills), usage


@pytest.mark.slow
@pytest.mark.parametrize("tactic, norm, delayed, in_flight", [
    ("half_mma:k8:m64:s3:fbw", "none", "carried", True), ("half_mma:k2:m64:s3:fbw", "bfloat16", "carried", True),
    ("half_mma:k8:m64:s3:fbw", "none", "identity", True), ("half_mma:k8:m64:s3:fbw", "none", None, False),
])
def test_mma_kernel1_mma_in_flight(tmp_path, cuobjdump, dump_env, tactic, norm, delayed, in_flight):
    """The delayed seam's kernel 1 on path B with one MMA warpgroup issues a block's 16 wgmma back to back and waits
    for them once, under the next block's post-map (``MmaFusedHcKernel.mma_in_flight``), with nothing spilled: a read
    of the accumulator the compiler moved above the wait would make ptxas serialise them (a wait after each, C7514).
    The V4 seam waits right after its MMAs, as before."""
    args = [tactic, "7168", norm] + ([delayed] if delayed else [])
    sass, usage = compiled_variant(tmp_path, dump_env, cuobjdump, *args)
    (ops,) = [ops for name, ops in sass_functions(sass).items() if "MmaFusedHcKernel" in name]
    hgmma = [i for i, op in enumerate(ops) if op.startswith("HGMMA")]
    waits = [i for i, op in enumerate(ops) if op.startswith("WARPGROUP.DEPBAR")]
    assert len(hgmma) == 16 and len(waits) == (2 if in_flight else 1), (len(hgmma), len(waits))
    # in flight: the loop's wait comes before its MMAs (the previous block's), the second one after the loop
    assert (waits[0] < hgmma[0] < hgmma[-1] < waits[1]) if in_flight else (hgmma[-1] < waits[0])
    spills = re.findall(r"STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", usage)
    assert len(spills) == 2 and all(s == ("0", "0") for s in spills), usage


@pytest.mark.slow
def test_delayed_big_fuse_loads_a_block_of_tokens_at_once(tmp_path, cuobjdump, dump_env):
    """The delayed seam's standalone big fuse without the norm (fuse shape "bw") takes 16 tokens a CTA and issues the
    partial-row loads of all of them (2 splits a warp at split_k = 8) before it stores the first sum: one memory round
    trip for the block, where a round trip per token would put 16 in series (``BigFusePhase.token_chunks``)."""
    args = ["half_mma:k8:m64:s3:fbw", "7168", "none", "carried"]
    sass, _ = compiled_variant(tmp_path, dump_env, cuobjdump, *args)
    (ops,) = [ops for name, ops in sass_functions(sass).items() if "BigFuseKernel" in name]
    loads = [i for i, op in enumerate(ops) if op.startswith("LDG")]
    assert len(loads) == 2 + 16 * 2, len(loads)  # hc_base and hc_scale, then 16 tokens x 2 splits
    first_sum_store = next(i for i, op in enumerate(ops) if op.startswith("STS") and i > loads[2])
    assert loads[-1] < first_sum_store, (loads, first_sum_store)


@pytest.mark.slow
@pytest.mark.parametrize("tactic, kernel, rows", [
    ("all_fma:k28:t8:n6:w256:s1:b1:fbw", "FmaFusedHc", 8 * 4),  # 8 tokens x 4 splits a warp (28 over 8 warps)
    ("all_mma:k4:m64:s3:fbw", "MmaFusedHcKernel", 16),  # 16 of the tile's 64 tokens x 1 split a warp
])
def test_last_cta_loads_a_block_of_partial_rows_at_once(tmp_path, cuobjdump, dump_env, tactic, kernel, rows):
    """Paths F and D: the CTA that completes a tile (after the election's fence) issues the partial-row loads of a
    block of tokens (``big_fuse.TOKEN_LOADS``) before it adds any, as the standalone big fuse does; one token at a
    time put a memory round trip per token in series (path D 0.71-0.97, path F 0.86-1.00 of the time,
    docs/experiments.md 2026-12-06). ``rows``: those loads, besides hc_base and hc_scale."""
    sass, _ = compiled_variant(tmp_path, dump_env, cuobjdump, tactic, "7168", "none", "carried")
    (ops,) = [ops for name, ops in sass_functions(sass).items() if kernel in name]
    phase = ops[ops.index("MEMBAR.ALL.GPU"):]
    loads = phase[:phase.index("FADD")].count("LDG.E")
    assert loads >= 2 + rows, loads


def _bench_module(name: str):
    """Import a script of bench/probes/ (not a package) as a module."""
    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "probes")
    sys.path.insert(0, bench)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(bench)  # by value: the probes put the repository root in front of it on import


@pytest.mark.parametrize("vectors, barriers, kind, lag", [(0, 2, "atomic", 0), (13, 1, "red", 1)])
def test_grid_barrier_probe_compiles(vectors, barriers, kind, lag):
    """bench/probes/probe_grid_barrier.py (the cooperative-launch probe behind the persistent design in
    docs/experiments.md) keeps compiling for sm_90a: blocking barriers of either kind and the split-phase one, alone
    and in the streaming copy."""
    assert callable(_bench_module("probe_grid_barrier").compiled(132, 256, vectors, barriers, kind, lag))


@pytest.mark.parametrize("cluster, tokens", [(8, 24), (16, 32)])
def test_cluster_probe_compiles(cluster, tokens):
    """bench/probes/probe_cluster.py (the cluster tail of the on-chip-collapse design in docs/experiments.md:
    clusters of 8 and 16 CTAs with the design's shared memory, distributed shared-memory loads and stores) compiles
    for sm_90a."""
    assert callable(_bench_module("probe_cluster").compiled(cluster, tokens, 215))


@pytest.mark.parametrize("sync", ["none", "all", "warp", "async"])
def test_onchip_skeleton_probe_compiles(sync):
    """bench/probes/probe_onchip_skeleton.py (the on-chip-collapse design's data movement with its cluster tail, four
    ways to sync) compiles for sm_90a."""
    assert callable(_bench_module("probe_onchip_skeleton").compiled(8, 8, 7168, 15, sync))


@pytest.mark.parametrize("cluster, tokens, clusters", [(8, 8, 15), (16, 16, 7)])
def test_onchip_skeleton_kmajor_compiles(cluster, tokens, clusters):
    """The skeleton's data movement with residual_cur K-major in shared memory (the wgmma ring's B layout, to time
    the layout alone) compiles for sm_90a."""
    probe = _bench_module("probe_onchip_skeleton")
    assert callable(probe.compiled(cluster, tokens, 7168, clusters, "async", kmajor=True))


@pytest.mark.parametrize("cluster, hidden, threads", [(16, 7168, 224), (8, 4096, 256)])
def test_onchip_skeleton_projection_compiles(cluster, hidden, threads):
    """The skeleton with the design's projection (warp-MMA TF32 hi + lo over the CTA's K slice, 16-token tiles)
    compiles for sm_90a at both H of the bench."""
    assert callable(_bench_module("probe_onchip_skeleton").compiled(cluster, 16, hidden, 7, "project", threads))


@pytest.mark.parametrize("mma_warps, mma_regs, lookahead, ring", [
    (4, 152, 2, "registers"), (4, 152, 7, "cp.async"), (0, 152, 4, "cp.async"), (4, 136, 7, "bulk"),
    (8, 88, 3, "bulk"), (4, 152, 2, "synthetic"), (4, 96, 4, "wgmma"), (4, 96, 2, "wgmma"), (8, 88, 2, "wgmma")])
def test_onchip_skeleton_weight_rings_compile(mma_warps, mma_regs, lookahead, ring):
    """The skeleton's projection variants compile for sm_90a: on MMA warps of their own (one or two warpgroups after
    the loaders and the tail warp, registers moved to the loaders with setmaxnreg) or on the loaders, with the
    weight blocks in flight in registers, in shared memory (cp.async, or whole blocks by bulk copy), or made up in
    registers (timing only)."""
    probe = _bench_module("probe_onchip_skeleton")
    if mma_warps:  # setmaxnreg only moves the launch's registers: asking for more in all hangs the kernel
        skeleton = probe.OnchipSkeleton(16, 16, 7168, 7, "project", 224, lookahead, True, "trunc", mma_warps, mma_regs,
                                        ring)
        loaders = skeleton.threads + 32  # with the tail warp
        assert (skeleton.loader_regs * loaders + mma_regs * 32 * mma_warps
                <= skeleton.even_registers() * (loaders + 32 * mma_warps))
    assert callable(probe.compiled(16, 16, 7168, 7, "project", 224, lookahead, True, "trunc", mma_warps, mma_regs,
                                   ring))


@pytest.mark.parametrize("sync, terms, slots, reserve, free, tokens_m, collapse_from", [
    ("async", 2, 3, 0, False, False, "shared"), ("project", 3, 3, 0, False, False, "shared"),
    ("async", 2, 2, 32, False, False, "shared"), ("project", 2, 2, 0, True, False, "shared"),
    ("project", 3, 2, 0, False, True, "shared"), ("async", 2, 2, 0, False, False, "global"),
    ("project", 3, 2, 0, False, True, "global")])
def test_onchip_skeleton_handoff_variants_compile(sync, terms, slots, reserve, free, tokens_m, collapse_from):
    """The skeleton with a third tile in flight (the collapse two tiles behind the post-map), with shared memory
    reserved and unused (to time the L1 cache it takes), with the wgmma ring's copies left out (timing only), with
    the tokens as the MMAs' M or with the collapse reading residual_cur from global memory compiles for sm_90a, alone
    and with the wgmma projection."""
    probe = _bench_module("probe_onchip_skeleton")
    mma = (4, 152 if tokens_m else 96, "wgmma") if sync == "project" else (0, 152, "registers")
    assert callable(probe.compiled(16, 16, 7168, 7, sync, 224, 2, True, "trunc", mma[0], mma[1], mma[2], 1, 1, terms,
                                   True, slots, reserve, free, tokens_m, collapse_from))


@pytest.mark.parametrize("hidden, threads, tokens, collapse_warps", [(7168, 224, 16, 4), (4096, 256, 32, 8)])
def test_onchip_skeleton_collapse_warps_compile(hidden, threads, tokens, collapse_warps):
    """The skeleton's data movement with the collapse from global memory by warps of their own (a warpgroup or two
    after the loaders' and the tail warp's, idle warps filling the tail warp's when the loaders are whole warpgroups)
    compiles for sm_90a, and the roles' registers fit the launch's."""
    probe = _bench_module("probe_onchip_skeleton")
    skeleton = probe.OnchipSkeleton(16, tokens, hidden, 7, "async", threads, collapse_from="global",
                                    collapse_warps=collapse_warps)
    tail_group = skeleton.collapse_first - threads  # the tail warp and any idle warps
    used = (skeleton.loader_regs * threads + skeleton.tail_regs * tail_group
            + skeleton.collapse_regs * 32 * collapse_warps)
    assert used <= skeleton.even_registers() * skeleton.block_threads
    assert callable(probe.compiled(16, tokens, hidden, 7, "async", threads, collapse_from="global",
                                   collapse_warps=collapse_warps))


def test_onchip_skeleton_blocked_weight():
    """The bulk ring's weight copy: CTA rank r's block b, lane (g, q), column tile nt, half h holds the weight row
    8 nt + g at the K positions of the lane's octet in that block (what the register ring loads for the lane)."""
    probe = _bench_module("probe_onchip_skeleton")
    torch = pytest.importorskip("torch")
    hidden, cluster = 512, 8
    fn = torch.randn(probe.MIXES, 4 * hidden)
    blocked = probe.blocked_weight(fn, cluster).view(cluster, -1, 6, 32, 4)
    per_stream = hidden // cluster // 8 // 4
    for r, b, lane in [(0, 0, 0), (3, 5, 17), (7, blocked.shape[1] - 1, 31)]:
        j, o = b // per_stream, (b % per_stream) * 4 + lane % 4
        for nt in range(3):
            k = j * hidden + r * (hidden // cluster) + o * 8
            row = fn[8 * nt + lane // 4, k:k + 8]
            assert torch.equal(blocked[r, b, 2 * nt, lane], row[:4]) and torch.equal(blocked[r, b, 2 * nt + 1, lane],
                                                                                      row[4:])


def test_onchip_skeleton_reference():
    """The probe's float64 reference: residual_cur is SPEC's post-map chain with its coefficients, layer_input the
    gate-weighted sum of the rounded streams."""
    probe = _bench_module("probe_onchip_skeleton")
    torch = pytest.importorskip("torch")
    x, res = torch.randn(6, 16).bfloat16(), torch.randn(6, 4, 16).bfloat16()
    rows = torch.tensor([1, 4])
    rc, li = probe.reference(x, res, rows, 8, "none")
    j = 2
    expect = x[4].double() * probe.post_coef(j) + sum(probe.comb_coef(k, j) * res[4, k].double() for k in range(4))
    assert torch.allclose(rc[1, j], expect)
    assert torch.allclose(li[0], 0.5 * rc[0].bfloat16().double().sum(0))
    fn = torch.randn(24, 4 * 16)
    rc, li = probe.reference(x, res, rows, 8, "project", fn)
    flat = rc[1].bfloat16().double().flatten()
    gates = torch.sigmoid(fn[:4].double() @ flat / (flat.square().mean() + probe.RMS_EPS).sqrt())
    assert torch.allclose(li[1], (gates[:, None] * rc[1].bfloat16().double()).sum(0))


def test_cluster_probe_host_model():
    """The probe's float64 model of its gates: a fixed point the seeds set, which reading the CTA's own partials
    instead of its peers' (a wrong mapping) would move."""
    probe = _bench_module("probe_cluster")
    torch = pytest.importorskip("torch")
    seeds = 0.05 * torch.randn(8 * probe.ROW, generator=torch.Generator().manual_seed(0))
    gate = probe.expected_gate(seeds, 8, 16, 128, 200)
    own_only = probe.expected_gate(seeds[:probe.ROW].repeat(8), 8, 16, 128, 200)
    assert 0.3 < gate < 0.7 and abs(gate - own_only) > 1e-2


@pytest.mark.parametrize("block_h, group, stages", [(32, 1, 8), (32, 4, 8), (128, 1, 2)])
def test_box_copy_probe_compiles(block_h, group, stages):
    """bench/probes/probe_box_copy.py (kernel 1's traffic as a copy: stage width, and with ``group`` the stores of
    several stages written together) compiles for sm_90a."""
    probe = _bench_module("probe_box_copy")
    hidden = 7168
    sets = [{"x_prev": torch.empty(8, hidden, dtype=torch.bfloat16),
             "residual_prev": torch.empty(8, 4, hidden, dtype=torch.bfloat16)}]
    assert callable(probe.compiled(hidden, 64, block_h, 2, stages, sets, group))


@pytest.mark.parametrize("mode", ["one", "signal", "warps"])
def test_publish_probe_compiles(mode):
    """bench/probes/probe_publish.py (does one release arrival publish every warp's stores to other CTAs?) keeps
    compiling for sm_90a, in the modes that exercise a writer barrier, a signal warp and per-warp arrivals."""
    assert callable(_bench_module("probe_publish").compiled(128, 8, mode))


@pytest.mark.parametrize("busy_warps", [0, 7])
def test_sinkhorn_probe_compiles(busy_warps):
    """bench/probes/probe_sinkhorn.py (cycles per Sinkhorn iteration behind the small-M analysis of
    docs/experiments.md) keeps compiling for sm_90a, alone and beside streaming warps."""
    probe = _bench_module("probe_sinkhorn")
    assert callable(probe.compile_probe(probe.SinkhornProbe(busy_warps)))


def _wgmma_offset(m, k):
    """Element (m, k) of a "wgmma" A tile set in its ring stage (8 x 8 core matrices, K first)."""
    return (m // 8) * 1024 + (k // 8) * 64 + (m % 8) * 8 + k % 8


@pytest.mark.parametrize("terms, tokens_m", [(2, False), (3, False), (3, True)])
def test_onchip_skeleton_wgmma_weight(terms, tokens_m):
    """The "wgmma" ring's stages as the bulk copies bring them: per CTA rank r and group G (128 K positions of the
    rank's slice), element (m, k) of an MMA's A at (m // 8) 1024 + (k // 8) 64 + (m % 8) 8 + k % 8, term t of column
    c in row ``weight_row(terms, t, c)``; two terms: bf16 hi and lo in rows 0-47 (rows 48-63 not copied); three terms:
    the second MMA's rows 0-23 (lo) first, then the first MMA's 48 (hi, mid; hi + mid + lo within 2^-24 of the
    weight); with the tokens as the MMAs' M, the terms' rows one after another."""
    probe = _bench_module("probe_onchip_skeleton")
    torch = pytest.importorskip("torch")
    hidden, cluster = 512, 8
    fn = torch.randn(probe.MIXES, 4 * hidden)
    per = hidden // cluster
    groups = 4 * per // 128
    staged = probe.wgmma_weight(fn, cluster, terms, tokens_m).view(torch.bfloat16).view(cluster, groups, -1)
    hi = fn.to(torch.bfloat16)
    mid = (fn - hi.float()).to(torch.bfloat16)
    lo = (fn - hi.float() - mid.float()).to(torch.bfloat16)
    assert staged.shape[2] == (48 if terms == 2 else 72) * 128
    if terms == 3:
        assert (hi.double() + mid.double() + lo.double() - fn.double()).abs().max() <= 2**-24 * fn.abs().max()
    parts = (hi, mid, lo)[:terms]
    for r, g, c, k in [(0, 0, 0, 0), (3, 1, 7, 9), (7, groups - 1, 23, 127), (5, 0, 16, 64), (6, 1, 12, 77)]:
        kk = 128 * g + k
        gk = kk // per * hidden + r * per + kk % per
        for term, part in enumerate(parts):
            row = probe.weight_row(terms, term, c, tokens_m)
            # three terms: the second MMA's rows (64 on) are the stage's first three slabs, the first MMA's after them
            if tokens_m or terms == 2:
                at = _wgmma_offset(row, k)
            else:
                at = _wgmma_offset(row - 64, k) if row >= 64 else 3072 + _wgmma_offset(row, k)
            assert torch.equal(staged[r, g, at], part[c, gk]), (term, c)


@pytest.mark.parametrize("terms, tokens_m", [(2, False), (3, False), (3, True)])
def test_onchip_skeleton_wgmma_rows(terms, tokens_m):
    """What the "wgmma" epilogue sums, emulated on the CPU from a stage's bytes read through ``a_layout``'s offsets
    (the second MMA's rows 24-63 reading into the first MMA's tiles, as on the device): per column c, its terms' rows
    (``weight_row``) give the weight's column over the group's 128 K positions, to 2^-17 with two terms and 2^-24 with
    three."""
    probe = _bench_module("probe_onchip_skeleton")
    torch = pytest.importorskip("torch")
    hidden, cluster, r, g = 512, 8, 3, 1
    fn = torch.randn(probe.MIXES, 4 * hidden)
    per = hidden // cluster
    staged = probe.wgmma_weight(fn, cluster, terms, tokens_m).view(torch.bfloat16)
    stage = staged.view(cluster, 4 * per // 128, -1)[r, g]
    if tokens_m:  # the stage is the MMAs' N rows, all read
        rows = stage[_wgmma_offset(torch.arange(24 * terms)[:, None], torch.arange(128)[None, :])].double()
    else:
        reach = (3072 if terms == 3 else 0) + 64 * 128  # the first MMA's rows 48-63 read past the stage
        stage = torch.cat([stage, torch.zeros(reach - stage.numel(), dtype=torch.bfloat16)]).double()
        offset = _wgmma_offset(torch.arange(64)[:, None], torch.arange(128)[None, :])
        rows = torch.cat([stage[offset + 3072], stage[offset]] if terms == 3 else [stage[offset]])  # MMA after MMA
    dots = sum(rows[[probe.weight_row(terms, term, c, tokens_m) for c in range(probe.MIXES)]] for term in range(terms))
    kk = 128 * g + torch.arange(128)
    want = fn[:, kk // per * hidden + r * per + kk % per].double()
    assert (dots - want).abs().max() <= (2**-17 if terms == 2 else 2**-24) * want.abs().max()


_COMPILE_SKELETON_WGMMA = (
    "import os, sys; sys.path.insert(0, os.path.join(sys.argv[1], 'bench', 'probes')); "
    "import probe_onchip_skeleton as p; "
    "p.compiled(16, 16, 7168, 7, 'project', 224, 4, True, 'trunc', 4, int(sys.argv[2]), 'wgmma', 1, 1, 3, True, 2, 0, "
    "False, sys.argv[3] == '1')")


@pytest.mark.slow
@pytest.mark.parametrize("tokens_m, regs, hgmma", [(False, 96, "HGMMA.64x16x16.F32.BF16"),
                                                   (True, 152, "HGMMA.64x72x16.F32.BF16")])
def test_onchip_skeleton_wgmma_sass(tmp_path, cuobjdump, dump_env, tokens_m, regs, hgmma):
    """The skeleton's "wgmma" projection with three bf16 terms (the weight as M: two m64n16 MMAs per step; the tokens
    as M: one m64n72) compiles to bf16 HGMMA issued back to back for a pair of commit groups (no WARPGROUP.DEPBAR
    between them: ptxas serialises the MMAs when it cannot prove an accumulator safe, which cost the probe's first
    version 5x) and spills nothing."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, "-c", _COMPILE_SKELETON_WGMMA, root, str(regs), str(int(tokens_m))],
                   env=dump_env(tmp_path, "cubin"), check=True, timeout=1800, capture_output=True)
    (cubin,) = tmp_path.glob("*.cubin")
    sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    ops = re.findall(r"(HGMMA\.\S+|WARPGROUP\.DEPBAR)", sass)
    first = ops.index(next(op for op in ops if op.startswith("HGMMA")))
    pair = 2 * 8 * (1 if tokens_m else 2)  # two groups of eight steps, one or two MMAs a step
    assert ops[first:first + pair + 1] == [hgmma] * pair + ["WARPGROUP.DEPBAR"], ops[:pair + 4]
    usage = subprocess.run([cuobjdump, "--dump-resource-usage", str(cubin)], capture_output=True, text=True).stdout
    spills = re.findall(r"STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", usage)
    assert spills and all(sp == ("0", "0") for sp in spills), usage


@pytest.mark.parametrize("box, raw, tactic, precision", [(4, 2, "half_mma:k2:m64:s2:fbw", "fp32"),
                                                         (2, 3, "half_mma:k8:m64:s3:fbw", "fp32"),
                                                         (4, 2, "half_mma:k2:m64:s4:fbw", "tf32")])
def test_k1_wide_probe_compiles(box, raw, tactic, precision):
    """bench/probes/probe_k1_wide.py (path B's kernel 1 with its activations in wider TMA boxes, a ring and a producer
    warp of their own) compiles for sm_90a; a variant whose rings exceed shared memory is refused."""
    from mhc_cute.kernels import spec_problem

    probe, k1_copy = _bench_module("probe_k1_wide"), _bench_module("probe_k1_copy")
    t = tac.parse_tactic(tactic)
    problem = spec_problem(7168, precision, None)
    assert callable(k1_copy.compile_variant(lambda: probe.WideBoxKernel(7168, t, precision, None, box, raw), problem,
                                            problem.empty_outputs()))
    with pytest.raises(AssertionError, match="shared memory"):
        probe.WideBoxKernel(7168, tac.parse_tactic("half_mma:k2:m64:s3:fbw"), "fp32", None, 4, 2)


def test_k1_copy_probe_compiles():
    """bench/probes/probe_k1_copy.py's copy-only kernel 1 (its consumers only copy each stage's residual tile out)
    compiles for sm_90a through the probes' shared ``compile_variant``."""
    from mhc_cute.kernels import spec_problem

    k1_copy = _bench_module("probe_k1_copy")
    t = tac.parse_tactic("half_mma:k2:m64:s3:fbw")
    problem = spec_problem(7168, "fp32", None)
    assert callable(k1_copy.compile_variant(lambda: k1_copy.CopyOnlyKernel(7168, t, "fp32", None), problem,
                                            problem.empty_outputs()))


class _Unloadable:
    """A stand-in for a compiled kernel whose exported object file cannot be loaded."""

    def export_to_c(self, path, function_name):
        with open(path, "wb") as f:
            f.write(b"not an object file")


def test_kernel_cache_rebuilds_a_corrupt_file_once(tmp_path, monkeypatch):
    """A corrupt object file in ``$MHC_CUTE_KERNEL_CACHE`` is removed and the kernel built again; if the fresh file
    cannot be loaded either, the kernel built in memory is used (a warning each time), never a loop of rebuilds."""
    from mhc_cute.kernels import KERNEL_CACHE_ENV, CompiledKernels

    monkeypatch.setenv(KERNEL_CACHE_ENV, str(tmp_path))
    kernels = CompiledKernels("test")
    path = kernels.file_of(("k",), tmp_path)
    path.write_bytes(b"truncated")
    built = []

    def build():
        built.append(_Unloadable())
        return built[-1]

    with pytest.warns(UserWarning) as warned:
        fn = kernels.get(("k",), build)
    assert len(built) == 1 and fn is built[0]
    assert ["recompiling" in str(w.message) for w in warned] == [True, False]
    assert not path.exists()
    assert kernels.get(("k",), build) is fn  # kept in memory


def test_kernel_file_names_follow_the_modules_that_shape_a_kernel(monkeypatch):
    """Persisted kernels are named by a digest of the kernel sources and of the modules outside the kernels package
    whose code shapes a compiled kernel (a stale object file must never be loaded after one of them changes); a
    family's digest leaves out the other families' modules only."""
    from pathlib import Path

    from mhc_cute import kernels

    def read_by(family):
        read = []
        real = Path.read_bytes
        monkeypatch.setattr(Path, "read_bytes", lambda self: read.append(self.name) or real(self))
        kernels._sources_digest.cache_clear()
        try:
            kernels._sources_digest(family)
        finally:
            kernels._sources_digest.cache_clear()
            monkeypatch.setattr(Path, "read_bytes", real)
        return set(read)

    shared = {"__init__.py", "big_fuse.py", "device_utils.py", "wgmma_tf32.py", *kernels.KERNEL_INPUT_MODULES}
    assert read_by(None) == shared | set(kernels.FAMILY_MODULES)
    for family in kernels.FAMILY_MODULES:
        assert read_by(family) == shared | {family}


def test_each_kernel_family_is_one_module_that_imports_no_other():
    """What lets a family's file names skip the other families' modules: no family module imports another, and
    each of the package's ``CompiledKernels`` names its own module as its family."""
    import ast
    from pathlib import Path

    from mhc_cute import kernels

    here = Path(kernels.__file__).parent
    stems = {name.removesuffix(".py") for name in kernels.FAMILY_MODULES}
    for name in kernels.FAMILY_MODULES:
        tree = ast.parse((here / name).read_text())
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                imported |= {node.module} if node.module else {a.name for a in node.names}
        assert not imported & stems, f"{name} imports {imported & stems}"
        families = [node.args[1].value for node in ast.walk(tree) if isinstance(node, ast.Call)
                    and getattr(node.func, "id", None) == "CompiledKernels"]
        assert families == [name]


@pytest.mark.parametrize("fuse", ["lat", "latp"])
def test_big_fuse_barriers_count_the_threads_that_reach_them(tmp_path, cuobjdump, dump_env, fuse):
    """The standalone big fuse with a Sinkhorn warp: no CTA-wide barrier (barrier 0), which that warp's own branch
    would reach at another instruction than the collapse warps (synccheck: "Divergent thread(s) in block"). The
    collapse warps sum the partials and collapse behind named barrier 1, which counts them only, then arrive on
    barrier 2, on which the Sinkhorn warp waits: that barrier counts the whole CTA."""
    from mhc_cute.kernels.big_fuse import standalone_big_fuse

    threads = standalone_big_fuse(4096, 64, None, fuse).phase.threads
    tactic = f"half_fma:k64:t1:n6:w256:s1:b1:f{fuse}"
    subprocess.run([sys.executable, "-c", _COMPILE, tactic, "4096", "float32"], env=dump_env(tmp_path, "cubin"),
                   check=True, timeout=1800, capture_output=True)
    (cubin,) = tmp_path.glob("*.cubin")
    sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    lines = next(body for name, body in sass_lines(sass).items() if "BigFuseKernel" in name)
    barriers = [line for line in lines if line.startswith("BAR.")]
    assert not [b for b in barriers if re.search(r" 0x0 ;", b)], barriers
    assert {b for b in barriers if " 0x1, " in b} == {f"BAR.SYNC.DEFER_BLOCKING 0x1, {hex(threads - 32)} ;"}, barriers
    assert sorted(b for b in barriers if " 0x2, " in b) == [f"BAR.ARV 0x2, {hex(threads)} ;",
                                                              f"BAR.SYNC.DEFER_BLOCKING 0x2, {hex(threads)} ;"]


def lane_divergent_collectives(ptx: str) -> list:
    """Warp- or CTA-collective instructions (``shfl.sync``, ``vote.sync``, ``bar.sync``, ...) that PTX reaches only
    on a branch taken by some lanes of a warp: the code after ``@p bra L`` up to ``L``, where ``p`` compares the lane
    index (``%laneid``, or ``%tid.x`` & 31). Such an instruction waits for lanes that never come (a hang: the CuTe
    collapse with the norm, 2026-12-04, on ``cute.arch.warp_idx()``, itself a shuffle, under ``lane == 0``)."""
    lane_regs, lane_preds, found = set(), set(), []
    lines = [line.strip() for line in ptx.splitlines()]
    for i, line in enumerate(lines):
        if m := re.match(r"mov\.u32\s+(%r\d+),\s*%laneid;", line):
            lane_regs.add(m[1])
        elif m := re.match(r"and\.b32\s+(%r\d+),\s*%r\d+,\s*31;", line):
            lane_regs.add(m[1])  # tid & 31 (conservative: any value masked to a lane index)
        elif (m := re.match(r"setp\.\w+\.[a-z]+\d+\s+(%p\d+),\s*(%r\d+),\s*(%r\d+|-?\d+);", line)) and (
                m[2] in lane_regs or m[3] in lane_regs):
            lane_preds.add(m[1])
        elif (m := re.match(r"@!?(%p\d+)\s+bra(?:\.uni)?\s+(\$\w+);", line)) and m[1] in lane_preds:
            if f"{m[2]}:" not in lines[i:]:  # a backward branch (a loop): no skipped region to read
                continue
            end = lines.index(f"{m[2]}:", i)
            found += [f"{m[1]} -> {m[2]}: {inner}" for inner in lines[i + 1:end]
                      if re.match(r"(shfl|vote|match|redux|bar\.warp|bar|barrier)\.(\S*\.)?sync", inner)]
    return found


def test_lane_divergent_collectives_finds_a_shuffle_under_the_lane_test():
    ptx = """
	mov.u32 	%r386, %laneid;
	setp.ne.b32 	%p2, %r386, 0;
	@%p2 bra 	$L__BB0_10;
	shr.u32 	%r388, %r387, 5;
	shfl.sync.idx.b32 	%r389, %r388, 0, 31, -1;
	st.shared.b32 	[%r391], %r72;
$L__BB0_10:
	bar.sync 	0;
"""
    assert lane_divergent_collectives(ptx) == ["%p2 -> $L__BB0_10: shfl.sync.idx.b32 	%r389, %r388, 0, 31, -1;"]
    assert lane_divergent_collectives(ptx.replace("%laneid", "%tid.x")) == []


# every kernel body with a lane test: the collapse (norm on/off), the post, paths E/F with each big-fuse shape and
# the warp-MMA projection, and paths B/D
PTX_KERNELS = [
    ("collapse", 7168, "bfloat16"), ("collapse", 1088, "float32"), ("collapse", 512, "none"), ("post", 7168, "none"),
    ("half_fma:k64:t1:n6:w256:s1:b1:flat", 4096, "float32"), ("half_fma:k64:t1:n6:w256:s1:b1:flatp", 4096, "none"),
    ("half_fma:k56:t8:n6:w256:s1:b1:fbw", 7168, "bfloat16"), ("half_fma:k56:t8:n6:w256:s1:b1:fbwp", 7168, "none"),
    ("half_fma:k112:t32:n6:w256:s1:b1:flat:mma", 7168, "float32"), ("all_fma:k8:t8:n6:w256:s1:b1:fbw", 512, "float32"),
    ("all_mma:k2:m64:s4:fbw", 512, "float32"), ("half_mma:k16:m64:s5:flat", 4096, "bfloat16"),
]


@pytest.mark.slow
@pytest.mark.parametrize("kind, hidden, norm", PTX_KERNELS, ids=[f"{k}-{h}-{n}" for k, h, n in PTX_KERNELS])
def test_no_collective_under_a_lane_test(tmp_path, dump_env, kind, hidden, norm):
    """No kernel reaches a warp shuffle or a barrier on a branch that only some lanes take (the PTX of each)."""
    subprocess.run([sys.executable, "-c", _COMPILE, kind, str(hidden), norm], env=dump_env(tmp_path, "ptx"),
                   check=True, timeout=1800, capture_output=True)
    ptx = [p.read_text() for p in tmp_path.glob("*.ptx")]
    assert ptx
    assert [f for text in ptx for f in lane_divergent_collectives(text)] == []


# --- the standalone ops' kernels (mhc_post, mhc_collapse) ------------------------------------------------------

OP_HIDDENS = (64, 512, 1088, 4096, 5120, 7168, 16384)


@pytest.mark.parametrize("hidden", [512, 7168])
def test_post_kernel_compiles(hidden):
    from mhc_cute.kernels import post

    assert post.compile_post(hidden, *post.spec_operands(hidden)) is not None  # running needs a GPU


@pytest.mark.parametrize("hidden,norm,prefetch", [(512, None, True), (7168, "bfloat16", True),
                                                   (7168, "bfloat16", False), (1088, "float32", False)])
def test_collapse_kernel_compiles(hidden, norm, prefetch):
    from mhc_cute.kernels import collapse

    assert collapse.compile_collapse(*collapse.spec_operands(hidden, norm), prefetch) is not None


def test_collapse_prefetches_the_norm_weight_up_to_its_largest_h(monkeypatch):
    """``run_collapse`` holds the norm weight in registers from the start up to ``PREFETCH_NORM_MAX_H`` (measured:
    faster there at every M, slower above), at every M; without a norm it is moot."""
    import torch

    from mhc_cute.kernels import collapse

    asked = []
    monkeypatch.setattr(collapse._compiled, "get", lambda key, build: asked.append(key) or (lambda *a: None))
    bf16 = torch.bfloat16
    for h in (collapse.PREFETCH_NORM_MAX_H, collapse.PREFETCH_NORM_MAX_H + 64):
        for m in (1, 8192):
            res, pre, w, out = collapse.spec_operands(h, "bfloat16")
            collapse.run_collapse(res.expand(m, -1, -1), pre.expand(m, -1), w, 1e-20, out.expand(m, -1))
    res, pre, _, out = collapse.spec_operands(512, None)
    collapse.run_collapse(res, pre, None, 1e-20, out)
    h = collapse.PREFETCH_NORM_MAX_H
    assert asked == [(h, bf16, True)] * 2 + [(h + 64, bf16, False)] * 2 + [(512, None, False)]


@pytest.mark.slow
def test_every_op_kernel_variant_compiles(tmp_path, monkeypatch):
    from mhc_cute.kernels import KERNEL_CACHE_ENV, collapse, post

    monkeypatch.setenv(KERNEL_CACHE_ENV, str(tmp_path))
    assert sorted(post.precompile(OP_HIDDENS, processes=os.cpu_count())) == sorted(OP_HIDDENS)
    specs = [(h, n, prefetch) for h in OP_HIDDENS for n in NORMS for prefetch in (True, False)]
    assert len(collapse.precompile(specs, processes=os.cpu_count())) == len(specs)
    collapse_variants = len(OP_HIDDENS) * (2 * len(NORMS) - NORMS.count(None))  # prefetching is moot without a norm
    assert len(list(tmp_path.glob("*.o"))) == len(OP_HIDDENS) + collapse_variants


@pytest.mark.parametrize("hidden", OP_HIDDENS)
def test_collapse_shape_covers_the_row_in_one_batch(hidden):
    """Each thread's 8-vectors of the row fit one batch of loads (one memory round trip), and the rounded row stays in
    registers for the norm."""
    from mhc_cute.kernels.collapse import BATCH, CollapseKernel

    phase = CollapseKernel(hidden, None).phase
    assert phase.batches == 1 and phase.slots <= BATCH and phase.keep_rounded
    assert phase.threads * phase.slots * 8 >= hidden


# --- the delayed seam (mhc_fused_hc_delayed): the same kernels with its compile-time flag -------------------------

# (family, tactic, H, norm, seam): both families, one- and two-launch paths, norm on and off, carried and identity
# gates, the FFMA and warp-MMA projections and both big-fuse shapes of the two-launch paths
DELAYED_VARIANTS = [
    ("fma", "half_fma:k8:t32:n6:w256:s1:b1:flat:mma:o1", 512, "bfloat16", "carried"),
    ("fma", "all_fma:k8:t8:n6:w256:s1:b1:fbw", 512, None, "identity"),
    ("mma", "all_mma:k2:m64:s4:fbw", 512, "float32", "carried"),
    ("mma", "half_mma:k16:m64:s5:flat", 512, None, "identity"),
]


@pytest.mark.parametrize("family, tactic, hidden, norm, seam", DELAYED_VARIANTS,
                         ids=[f"{v[1].split(':')[0]}-{v[3]}-{v[4]}" for v in DELAYED_VARIANTS])
def test_delayed_variants_compile(family, tactic, hidden, norm, seam):
    from mhc_cute.kernels import fma, mma, spec_problem

    problem = spec_problem(hidden, "fp32", norm, seam)
    assert problem.op == "fused_hc_delayed" and (problem.pre_mix is None) == (seam == "identity")
    compile_fn = fma.compile_fma if family == "fma" else mma.compile_mma
    assert compile_fn(tac.parse_tactic(tactic), problem, problem.empty_outputs()) is not None  # running needs a GPU


def test_compiled_kernels_are_keyed_by_the_seam(monkeypatch):
    """mhc_fused_hc and the delayed seam's carried and identity gates are three compiled kernels of one tactic."""
    from mhc_cute.kernels import KERNEL_CACHE_ENV, fma, mma, spec_problem

    monkeypatch.delenv(KERNEL_CACHE_ENV, raising=False)  # the stand-in compiles cannot be persisted
    for module, compile_name, compiled, tactic in (
            (fma, "compile_fma", fma.compiled_fma, tac.parse_tactic("all_fma:k8:t8:n6:w256:s1:b1:fbw")),
            (mma, "compile_mma", mma.compiled_mma, tac.parse_tactic("all_mma:k2:m64:s4:fbw"))):
        monkeypatch.setattr(module, "_compiled", type(module._compiled)("test"))
        monkeypatch.setattr(module, compile_name, lambda tactic, problem, out: object())
        fns = [compiled(tactic, p, p.empty_outputs()) for seam in (None, "carried", "identity")
               for p in [spec_problem(512, "fp32", None, seam)]]
        assert len({id(f) for f in fns}) == 3
        p = spec_problem(512, "fp32", None, "carried")
        assert compiled(tactic, p, p.empty_outputs()) is fns[1]


# --- the seams without post on paths E and F: residual_prev read as the streams, nothing written to residual_cur ---

NO_POST_VARIANTS = [
    ("half_fma:k112:t1:n6:w256:s1:b1:flat", 7168, "bfloat16", None),
    ("half_fma:k64:t16:n12:w128:s1:b1:flat:mma:o1", 4096, None, "carried"),
    ("all_fma:k8:t8:n6:w256:s1:b1:fbw", 512, "float32", None),
    ("all_fma:k28:t8:n6:w256:s1:b1:fbw", 7168, None, "identity"),
    ("half_mma:k64:m128:s3:flat", 7168, None, None),
    ("half_mma:k16:m128:s3:fbw", 5120, "bfloat16", "carried"),
    ("all_mma:k64:m64:s4:fbw", 4096, "float32", None),
    ("all_mma:k8:m64:s4:fbw", 512, None, "identity"),
]


@pytest.mark.parametrize("tactic, hidden, norm, seam", NO_POST_VARIANTS,
                         ids=[f"{v[0].split(':')[0]}-{v[2]}-{v[3]}" for v in NO_POST_VARIANTS])
def test_no_post_variants_compile(tactic, hidden, norm, seam):
    from mhc_cute.kernels import fma, mma, spec_problem

    problem = spec_problem(hidden, "fp32", norm, seam, "no_post")
    assert problem.form == "no_post" and problem.x is None
    compile_fn = mma.compile_mma if tactic.split(":")[0] in tac.MMA_PATHS else fma.compile_fma
    assert compile_fn(tac.parse_tactic(tactic), problem, problem.empty_outputs()) is not None  # running needs a GPU


@pytest.mark.parametrize("tactic", ["half_fma:k8:t8:n6:w256:s1:b1:flat", "half_mma:k16:m128:s3:fbw"])
def test_no_post_is_its_own_compiled_kernel(monkeypatch, tactic):
    """A seam without post and the regular seam of one tactic are two compiled kernels (per seam flag)."""
    from mhc_cute.kernels import KERNEL_CACHE_ENV, fma, mma, spec_problem

    module, name = (mma, "mma") if tactic.startswith("half_mma") else (fma, "fma")
    monkeypatch.delenv(KERNEL_CACHE_ENV, raising=False)
    monkeypatch.setattr(module, "_compiled", type(module._compiled)("test"))
    monkeypatch.setattr(module, f"compile_{name}", lambda tactic, problem, out: object())
    compiled = getattr(module, f"compiled_{name}")
    t = tac.parse_tactic(tactic)
    forms = ("regular", "no_post", "broadcast")
    fns = [compiled(t, p, p.empty_outputs()) for seam in (None, "carried") for form in forms
           for p in [spec_problem(512, "fp32", None, seam, form)]]
    assert len({id(f) for f in fns}) == 2 * len(forms)


def test_the_kernel_paths_broadcast_h_multiples():
    """Every CuTe path runs the broadcast entry: paths E/F at H % 256 == 0, paths B/D at H % 64 == 0."""
    from mhc_cute import backends

    for name in tac.FMA_PATHS + tac.MMA_PATHS:
        b = backends.BACKENDS[name]
        assert b.h_multiple_for("broadcast") == (256 if name in tac.FMA_PATHS else 64)
        assert b.h_multiple_for("regular") == b.h_multiple_for("no_post") == 64


BROADCAST_VARIANTS = [
    ("half_mma:k64:m128:s3:flat", 7168, None, None),
    ("half_mma:k16:m128:s3:fbw", 5120, "bfloat16", "identity"),
    ("all_mma:k8:m64:s4:fbw", 512, "float32", None),
    ("all_mma:k64:m64:s4:fbw", 4096, None, "carried"),
    ("half_fma:k112:t1:n6:w256:s1:b1:flat", 7168, None, None),  # the seam's tactic (the launch quarters the split)
    ("half_fma:k80:t16:n6:w256:s1:b1:flat:mma:o1", 5120, "bfloat16", "identity"),
    ("all_fma:k16:t8:n6:w256:s2:b2:fbw", 4096, "float32", "carried"),
    ("half_fma:k8:t8:n6:w256:s1:b1:flat", 512, None, "carried"),
]


@pytest.mark.parametrize("tactic, hidden, norm, seam", BROADCAST_VARIANTS,
                         ids=[f"{v[0].split(':')[0]}-{v[2]}-{v[3]}" for v in BROADCAST_VARIANTS])
def test_broadcast_variants_compile(tactic, hidden, norm, seam):
    from mhc_cute.kernels import fma, mma, spec_problem

    problem = spec_problem(hidden, "fp32", norm, seam, "broadcast")
    assert problem.form == "broadcast" and problem.residual.shape == (1, hidden)
    t = tac.parse_tactic(tactic)
    if t.path in tac.FMA_PATHS:
        compiled = fma.compile_fma(tac.fma_broadcast_tactic(t, hidden), problem, problem.empty_outputs())
    else:
        compiled = mma.compile_mma(t, problem, problem.empty_outputs())
    assert compiled is not None  # running it needs a GPU (tests/test_delayed.py, -m gpu)


def test_the_fma_broadcast_launch_passes_the_summed_weight_and_the_quartered_tactic(monkeypatch):
    """Paths E/F's broadcast launch: the compiled kernel of ``fma_broadcast_tactic`` (a quarter of the splits),
    handed ``broadcast_fn(fn)`` (prepared once per weight) where the seam's launch hands ``fn``."""
    import torch

    from mhc_cute import kernels
    from mhc_cute.kernels import fma, spec_problem
    from mhc_cute.reference import broadcast_fn

    seen = []
    monkeypatch.setattr(fma, "compiled_fma", lambda tactic, problem, out: seen.append(tactic) or (lambda *a: None))
    monkeypatch.setattr(kernels, "sm_count", lambda index: 132)
    problem = spec_problem(7168, "fp32", None, None, "broadcast")
    launch = fma.prepare_half_fma(problem, tac.parse_tactic("half_fma:k112:t1:n6:w256:s1:b1:flat"),
                                    problem.empty_outputs())
    assert seen == [tac.parse_tactic("half_fma:k28:t1:n6:w256:s1:b1:flat")]
    fn = torch.randn(24, 4 * 7168)
    assert torch.equal(launch.weight(fn), broadcast_fn(fn)) and launch.weight(fn) is launch.weight(fn)


def test_the_broadcast_weight_is_the_summed_weight_over_one_stream():
    """Paths B/D's broadcast weight: ``reference.broadcast_fn`` (the SPEC's fn_b) in the B-tile layout of one
    stream, kept apart from the regular weight of the same tensor."""
    import torch

    from mhc_cute.kernels import mma
    from mhc_cute.reference import broadcast_fn

    fn = torch.randn(24, 4 * 64)
    for precision in ("fp32", "tf32"):
        b = mma.weight_of(precision, True)(fn)
        assert b.shape == (2, 1, 48 if precision == "fp32" else 24, 32)
        assert torch.equal(b, mma.prepare_weight(broadcast_fn(fn), precision, 1))
        assert mma.weight_of(precision)(fn).shape[1] == 4


def test_a_launch_without_post_passes_residual_prev_as_residual_cur():
    """The compiled call gets ``residual_prev`` where ``residual_cur`` goes (the big fuse collapses it), and the
    regular form its own output buffer."""
    from mhc_cute.kernels import spec_problem
    from mhc_cute.kernels.launch import KernelLaunch

    tactic = tac.parse_tactic("half_fma:k8:t8:n6:w256:s1:b1:flat")
    for form in ("regular", "no_post"):
        problem = spec_problem(512, "fp32", None, None, form)
        out = problem.empty_outputs()
        calls = []
        KernelLaunch(lambda *args: calls.append(args), problem, tactic, None)(problem.inputs, out)
        (args,) = calls
        assert args[8] is (problem.residual if form == "no_post" else out.residual_cur)
        assert args[9:12] == tuple(out[1:4])


def test_the_default_tactic_of_a_seam_without_post(monkeypatch):
    """A seam without post has no ``x``: its default tactic is looked up for ``residual_prev``'s device (the H200
    soak and sanitizer sweep of 2026-12-04 failed there with an AttributeError)."""
    from mhc_cute import kernels
    from mhc_cute.kernels import fma, spec_problem

    monkeypatch.setattr(kernels, "sm_count", lambda index: 132)
    for form in ("regular", "no_post"):
        problem = spec_problem(512, "fp32", None, None, form)
        tactic = kernels.resolve_tactic("half_fma", None, problem, fma._default_tactic)
        assert tactic.path == "half_fma"


def test_gpu_suite_specs_cover_the_forms_of_every_kernel_path():
    """``bench/precompile.py --gpu-suite`` lists both entry forms of every CuTe path beside the regular form, and every
    spec it lists names a problem its compile worker builds."""
    from conftest import bench_script

    from mhc_cute.kernels import spec_problem

    with bench_script("precompile.py") as precompile:
        fma, mma = precompile.gpu_suite_specs(132)
        delayed_fma, delayed_mma = precompile.delayed_gpu_suite_specs(132)
    fma, mma = fma + delayed_fma, mma + delayed_mma
    for specs, paths in ((fma, tac.FMA_PATHS), (mma, tac.MMA_PATHS)):
        for form in ("no_post", "broadcast"):
            assert {tac.parse_tactic(s[0]).path for s in specs if s[-1] == form} == set(paths)
    problems = ([(spec_problem(hidden, "fp32", norm, *seam), seam) for _, hidden, norm, *seam in fma]
                + [(spec_problem(hidden, precision, norm, *seam), seam) for _, hidden, precision, norm, *seam in mma])
    for problem, seam in problems:
        assert problem.form == (seam[-1] if seam and seam[-1] in ("no_post", "broadcast") else "regular")


def test_tune_specs_of_the_delayed_seam_are_what_its_tuner_compiles():
    """``bench/precompile.py --tune --delayed`` lists the kernels ``mhc-cute tune --delayed`` compiles before timing
    (``autotune.precompile_candidates`` with carried gates): every candidate, each in the carried-gates form."""
    from conftest import bench_script

    from mhc_cute import autotune
    from mhc_cute.selector import bucket_of

    with bench_script("precompile.py") as precompile:
        fma, mma = precompile.tune_specs(["half_fma", "half_mma"], [32, 2048], [7168], [None], ["fp32"], 132,
                                         ("carried",))
    want_fma = [(t.name, 7168, None, "carried") for m in (32, 2048)
                for t in autotune.candidate_tactics("half_fma", bucket_of(m), 7168, 132)]
    want_mma = [(t.name, 7168, "fp32", None, "carried") for m in (32, 2048)
                for t in autotune.candidate_tactics("half_mma", bucket_of(m), 7168, 132)]
    assert fma and mma
    assert sorted(set(fma)) == sorted(set(want_fma))
    assert sorted(set(mma)) == sorted(set(want_mma))
