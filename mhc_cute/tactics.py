"""Tactics as data: what each kernel path can be configured with, which configurations are valid, and the
default per problem size.

A tactic is a frozen dataclass, so it is hashable (the compiled-kernel caches key on it) and printable (the
benchmark and the autotuner log it). ``FmaTactic`` describes paths E (``half_fma``) and F (``all_fma``); the
tensor-core paths B and D ``MmaTactic``, and
``parse_tactic`` turns a tactic's ``name`` back into the object.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from .reference import HC_MULT, N_MIXES

PARTIAL_COLS = 32  # a split-K partial row: 24 dots, the sum of squares, 7 unused (one 128-byte line)
SUMSQ_COL = N_MIXES  # a partial row's column of the sum of squares
MAX_SMEM_BYTES = 48 * 1024  # static smem budget per CTA (no opt-in carve-out needed)
MAX_ACCUMULATORS = 64  # fp32 accumulators per thread (tokens_per_cta * tile_n) before register spills
MMA_TILE_ROWS = 16  # tokens per warp-level MMA tile (m16n8k8)
# shared memory a CTA asks for to run alone on its SM (``FmaTactic.one_per_sm``): more than half of the 228 KB an
# sm_90 SM has, so the CTA scheduler cannot place a second one beside it
ONE_PER_SM_SMEM_BYTES = 120 * 1024

FMA_PATHS = ("half_fma", "all_fma")
MMA_PATHS = ("half_mma", "all_mma")
MMA_BLOCK_H = 32  # H positions per pipeline stage (per stream): one 128-byte swizzle row of fp32 weight
MMA_WG_THREADS = 128
MMA_SMEM_LIMIT = 227 * 1024  # opt-in shared memory per CTA on sm_90
# Shapes of the standalone big-fuse kernel of the two-launch paths (E, B), ``fuse`` in a tactic: "lat" gives a
# token enough threads that the collapse is one memory round trip, and the Sinkhorn a warp of its own (fastest
# when a few CTAs run: small M); "bw" keeps CTAs small so that many share an SM (fastest when the kernel streams:
# large M). "latp" and "bwp": the same shapes with the Sinkhorn on two lanes per token (same bits), kept as tuner
# candidates. Measurements: docs/experiments.md.
FUSE_SHAPES = ("lat", "bw", "latp", "bwp")
LATENCY_FUSE_MAX_M = 32
ONE_LAUNCH_PATHS = ("all_fma", "all_mma")


def big_fuse_smem_bytes(tokens: int, threads: int) -> int:
    """Shared memory of the big-fuse phase for ``tokens`` tokens run by ``threads`` threads: what
    ``kernels.big_fuse.BigFusePhase.allocate`` takes (per-warp partial sums, the summed rows, the norm's per-warp
    scratch, 32 constants; 16-byte aligned each)."""
    warps = threads // 32
    return 4 * (warps * tokens * PARTIAL_COLS + tokens * PARTIAL_COLS + warps + 32) + 64


def default_fuse(path: str, m: int) -> str:
    return "lat" if m <= LATENCY_FUSE_MAX_M and path not in ONE_LAUNCH_PATHS else "bw"


def fuse_invalid_reason(path: str, fuse: str) -> str | None:
    if fuse not in FUSE_SHAPES:
        return f"fuse must be one of {FUSE_SHAPES}"
    if path in ONE_LAUNCH_PATHS and fuse != "bw":
        return "fuse (the standalone big fuse's shape) applies to the two-launch paths only"
    return None


@dataclass(frozen=True)
class FmaTactic:
    """One configuration of the CUDA-core (FFMA) projection kernel.

    The grid is ``(ceil(M / tokens_per_cta), split_k)``: each CTA owns ``tokens_per_cta`` tokens and
    ``H / split_k`` hidden positions of all 4 streams. The CTA walks its H range in chunks of ``chunk_h``
    positions (``4 * chunk_h`` K elements). Its threads form ``24 / tile_n`` column groups; in each group a
    thread owns one 4-wide K vector of the chunk and ``tile_n`` mix columns for every token, so the
    register tile is ``tokens_per_cta x tile_n`` accumulators and ``chunk_h = threads * tile_n / 24``.
    ``stages`` is the depth of the weight pipeline: with 2, the weights of chunk c + 1 are in flight while
    chunk c is computed. ``burst`` chunks are post-mapped at once (activations of ``burst * chunk_h``
    positions loaded in one step).

    ``warp_mma`` (a trailing ``:mma`` in the name): the projection runs on the tensor cores instead (warp-level
    TF32 ``mma.sync`` m16n8k8, the weight split into hi + lo in registers, so it stays fp32-accurate): each warp
    owns a K range of the chunk for all 24 columns and up to 32 tokens (16-row tiles), so the register tile is
    small and the CTA reduces over its warps only. ``tile_n`` then only sets ``chunk_h``.

    ``one_per_sm`` (a trailing ``:o1``): the projection CTA reserves ``ONE_PER_SM_SMEM_BYTES`` of shared memory,
    so that no two of its CTAs share an SM. For a grid of at most one wave: when the kernel launches early
    (programmatic dependent launch) beside a previous kernel's CTAs, the scheduler could otherwise stack its CTAs
    two to an SM while other SMs stay idle.
    """

    path: str  # "half_fma" (projection + big-fuse kernel) | "all_fma" (one launch, last CTA runs the big fuse)
    split_k: int
    tokens_per_cta: int
    tile_n: int
    threads: int
    stages: int = 1
    burst: int = 1
    fuse: str = "bw"
    warp_mma: bool = False
    one_per_sm: bool = False

    @property
    def chunk_h(self) -> int:
        return self.threads * self.tile_n // N_MIXES

    @property
    def name(self) -> str:
        return (f"{self.path}:k{self.split_k}:t{self.tokens_per_cta}:n{self.tile_n}:"
                f"w{self.threads}:s{self.stages}:b{self.burst}:f{self.fuse}" + (":mma" if self.warp_mma else "")
                + (":o1" if self.one_per_sm else ""))

    @property
    def mma_rows(self) -> int:
        """Token rows of the shared-memory activations with ``warp_mma``: whole 16-row MMA tiles."""
        return -(-self.tokens_per_cta // MMA_TILE_ROWS) * MMA_TILE_ROWS

    @property
    def mma_warp_k(self) -> int:
        """K elements of a chunk per warp with ``warp_mma`` (4 * chunk_h over the warps)."""
        return HC_MULT * self.chunk_h // (self.threads // 32)

    def smem_bytes(self) -> int:
        """Shared memory of the projection phase: the fp32 chunk of the post-map output plus the reduction
        (with ``warp_mma`` the reduction reuses the activations' buffer once the last chunk is projected)."""
        warps = self.threads // 32
        if self.warp_mma:
            activations = self.mma_rows * HC_MULT * self.chunk_h * self.burst * 4
            return max(activations, warps * self.mma_rows * (N_MIXES + 1) * 4)
        activations = self.tokens_per_cta * HC_MULT * self.chunk_h * self.burst * 4
        reduction = warps * self.tokens_per_cta * (self.tile_n + 1) * 4
        return activations + reduction

    def invalid_reason(self, hidden: int) -> str | None:
        """None if this tactic can run at hidden size ``hidden``, else why not."""
        if self.path not in FMA_PATHS:
            return f"path must be one of {FMA_PATHS}"
        if why := fuse_invalid_reason(self.path, self.fuse):
            return why
        if N_MIXES % self.tile_n:
            return "tile_n must divide 24"
        if self.threads % 32 or not 64 <= self.threads <= 1024:
            return "threads must be a multiple of 32 in [64, 1024]"
        if (self.threads * self.tile_n) % N_MIXES:
            return "threads * tile_n must be a multiple of 24"
        if (self.threads // (N_MIXES // self.tile_n)) % 32:
            return "each column group must be whole warps (threads * tile_n / 24 % 32 == 0)"
        if self.split_k < 1 or hidden % self.split_k:
            return f"split_k must divide H = {hidden}"
        if (hidden // self.split_k) % self.chunk_h:
            return f"H / split_k = {hidden // self.split_k} must be a multiple of chunk_h = {self.chunk_h}"
        if self.warp_mma:
            if not 1 <= self.tokens_per_cta <= 2 * MMA_TILE_ROWS:
                return f"tokens_per_cta must be in [1, {2 * MMA_TILE_ROWS}] with warp_mma"
            if (HC_MULT * self.chunk_h) % (self.threads // 32) or self.mma_warp_k % 16 or \
                    self.chunk_h % self.mma_warp_k:
                return "with warp_mma each warp's K range (4 chunk_h / warps) must be a multiple of 16 in one stream"
        elif self.tokens_per_cta < 1 or self.tokens_per_cta * self.tile_n > MAX_ACCUMULATORS:
            return f"tokens_per_cta * tile_n must be in [1, {MAX_ACCUMULATORS}]"
        if self.stages not in (1, 2):
            return "stages must be 1 or 2"
        if self.stages == 2 and hidden // self.split_k == self.chunk_h:
            return "stages = 2 needs at least two chunks per CTA"
        if self.burst < 1 or (hidden // self.split_k) % (self.chunk_h * self.burst):
            return "burst must divide the chunks of a CTA"
        budget = ONE_PER_SM_SMEM_BYTES if self.one_per_sm else MAX_SMEM_BYTES  # what the launch reserves
        if self.smem_bytes() > budget:
            return f"shared memory {self.smem_bytes()} B > {budget} B"
        if self.one_per_sm and self.path != "half_fma":
            return "one_per_sm applies to half_fma (path F's CTAs also hold the big fuse's shared memory)"
        return None

    def check(self, hidden: int) -> "FmaTactic":
        why = self.invalid_reason(hidden)
        if why is not None:
            raise ValueError(f"invalid tactic {self.name} for H = {hidden}: {why}")
        return self


def fits_one_wave(tactic: FmaTactic, m: int, sm_count: int) -> bool:
    """Whether the projection grid of ``tactic`` at M = ``m`` has at most one CTA per SM."""
    return -(-m // tactic.tokens_per_cta) * tactic.split_k <= sm_count


_FMA_NAME = re.compile(
    rf"^(half_fma|all_fma):k(\d+):t(\d+):n(\d+):w(\d+):s(\d+):b(\d+):f({'|'.join(FUSE_SHAPES)})(:mma)?(:o1)?$")


def default_tactic(path: str, m: int, hidden: int, sm_count: int = 132):
    """A CuTe path's default tactic at M = ``m`` (``default_fma_tactic`` or ``default_mma_tactic``)."""
    default = default_fma_tactic if path in FMA_PATHS else default_mma_tactic
    return default(path, m, hidden, sm_count)


def parse_tactic(name: str):
    """The tactic object whose ``name`` is ``name``."""
    match = _FMA_NAME.match(name)
    if match:
        path, *nums, fuse, mma, one_per_sm = match.groups()
        return FmaTactic(path, *map(int, nums), fuse, mma is not None, one_per_sm is not None)
    match = _MMA_NAME.match(name)
    if match:
        path, *nums, fuse = match.groups()
        return MmaTactic(path, *map(int, nums), fuse)
    raise ValueError(f"unknown tactic name {name!r}")


def largest_split(hidden: int, chunk_h: int, target: int) -> int:
    """The largest split_k <= target that divides H into whole chunks (1 if none larger)."""
    best = 1
    for k in range(1, target + 1):
        if hidden % k == 0 and (hidden // k) % chunk_h == 0:
            best = k
    return best


def fma_broadcast_tactic(tactic: FmaTactic, hidden: int) -> FmaTactic:
    """``tactic`` as paths E/F run the broadcast entry: the embedding's H walked as four quarters of H / 4 (K is H,
    a quarter of a seam's), with a quarter of the splits where that leaves whole bursts of chunks (the same K per
    CTA as the seam's), else the largest split that does, the burst halved until a quarter holds whole bursts.
    Needs H / 4 to hold whole chunks."""
    quarter = hidden // HC_MULT
    if hidden % HC_MULT or quarter % tactic.chunk_h:
        raise ValueError(f"the broadcast entry of {tactic.path} needs H a multiple of {HC_MULT * tactic.chunk_h} "
                         f"with tactic {tactic.name}; got H = {hidden}")
    burst = tactic.burst
    while quarter % (tactic.chunk_h * burst):
        burst //= 2
    split_k = largest_split(quarter, tactic.chunk_h * burst, max(1, tactic.split_k // HC_MULT))
    return replace(tactic, split_k=split_k, burst=burst).check(quarter)


FMA_THREADS, FMA_TILE_N = 256, 6  # chunk_h = 64: every H % 64 == 0 works
# M buckets of the FMA tactics: (largest M of the bucket, tokens per CTA of the FFMA projection, tokens per CTA of
# path E's default where it is the warp-MMA projection, else 0); the split is a function of the bucket too (see
# ffma_tactic), so there is one compiled variant per bucket. The FFMA tokens come from an H200 sweep at H = 7168
# (bench/bench_fma.py); the warp-MMA shape (9 <= M <= 128) is what `mhc-cute tune` picked at most of those buckets
# at H = 4096, 5120 and 7168 (mhc_cute/tuned/nvidia_h200.json).
FMA_BUCKETS = ((2, 1, 0), (4, 4, 0), (8, 8, 0), (16, 8, 16), (32, 8, 16), (128, 8, 32), (256, 8, 0), (1 << 30, 8, 0))
FMA_SPLIT_M = 512  # the largest bucket sizes its split for this many tokens


def ffma_tactic(path: str, m: int, hidden: int, sm_count: int = 132) -> FmaTactic:
    """The FFMA-projection tactic for M tokens at hidden size H: up to 16 tokens the op is latency bound, so one
    chunk per CTA spreads the weight read over as many CTAs as possible; beyond, each token block of 8 gets about
    one wave's share of splits."""
    bucket_m, tokens, _ = next(b for b in FMA_BUCKETS if m <= b[0])
    chunk_h = FMA_THREADS * FMA_TILE_N // N_MIXES
    if bucket_m <= 16:
        target = hidden // chunk_h
    else:
        target = max(1, sm_count // -(-min(bucket_m, FMA_SPLIT_M) // tokens))
    split_k = largest_split(hidden, chunk_h, target)
    return FmaTactic(path, split_k, tokens, FMA_TILE_N, FMA_THREADS, 1, fuse=default_fuse(path, m)).check(hidden)


def default_fma_tactic(path: str, m: int, hidden: int, sm_count: int = 132) -> FmaTactic:
    """A sensible FMA tactic for M tokens at hidden size H (before any tuning): ``ffma_tactic``, except on path E
    from 9 to 128 tokens, where the projection runs on warp MMA in 16- or 32-token CTAs of one 64-position chunk
    each (H / 64 splits) with the latency shape of the big fuse, as the tuned picks there have (faster than path B's
    default there). Path F keeps the FFMA tactic: its last CTA of a token block runs the big fuse for all of the
    block's tokens, and 16 or 32 of them took longer than 8 (``docs/experiments.md``).

    On path E a grid of at most one wave (at the bucket's largest M) runs one CTA per SM (``one_per_sm``), and at
    17-32 tokens 32-token CTAs are taken where 16-token ones would need more than a wave: launched early through
    PDL (after a cuBLAS GEMM) its CTAs otherwise stacked two to an SM, slower there, while one per SM was as fast or
    faster in the other measures (``docs/experiments.md``)."""
    bucket_m, _, mma_tokens = next(b for b in FMA_BUCKETS if m <= b[0])
    if path in ONE_LAUNCH_PATHS:
        return ffma_tactic(path, m, hidden, sm_count)
    if mma_tokens:
        chunk_h = FMA_THREADS * FMA_TILE_N // N_MIXES
        tactic = FmaTactic(path, hidden // chunk_h, mma_tokens, FMA_TILE_N, FMA_THREADS, 1, fuse="lat",
                           warp_mma=True)
        wide = replace(tactic, tokens_per_cta=2 * MMA_TILE_ROWS)
        if not fits_one_wave(tactic, bucket_m, sm_count) and fits_one_wave(wide, bucket_m, sm_count):
            tactic = wide
    else:
        tactic = ffma_tactic(path, m, hidden, sm_count)
    return replace(tactic, one_per_sm=fits_one_wave(tactic, bucket_m, sm_count)).check(hidden)


# --- tensor-core paths (B, D) -------------------------------------------------------------------------------

@dataclass(frozen=True)
class MmaTactic:
    """One configuration of the tensor-core paths.

    The grid is ``ceil(M / tile_m) * split_k`` CTAs, the splits of one M tile adjacent in launch order (they
    run together, so the tile's partials complete together). A CTA owns ``tile_m`` tokens (64 per MMA
    warpgroup) and a contiguous range of the ``H / 32`` blocks of 32 hidden positions (all 4 streams), and
    streams it through a ``stages``-deep TMA pipeline. ``fuse``: the shape of path B's big-fuse kernel
    (``FUSE_SHAPES``).
    """

    path: str  # "half_mma" (kernel 1 + big-fuse kernel) | "all_mma" (one launch, last CTA runs the big fuse)
    split_k: int
    tile_m: int = 128
    stages: int = 3
    fuse: str = "bw"

    @property
    def name(self) -> str:
        return f"{self.path}:k{self.split_k}:m{self.tile_m}:s{self.stages}:f{self.fuse}"

    @property
    def threads(self) -> int:
        return self.tile_m // 64 * MMA_WG_THREADS + 32  # MMA warpgroups + the TMA producer warp

    def smem_bytes(self, n_parts: int = 2) -> int:
        """Shared memory at ``n_parts`` weight parts (2: fp32, the larger; 1: tf32); path D's CTAs also hold the big
        fuse of one M tile."""
        total = self.stages * mma_stage_bytes(self.tile_m, n_parts) + 1024
        if self.path == "all_mma":
            total += big_fuse_smem_bytes(self.tile_m, self.threads)
        return total

    def invalid_reason(self, hidden: int) -> str | None:
        """None if this tactic can run at hidden size ``hidden`` (in both precisions), else why not."""
        if self.path not in MMA_PATHS:
            return f"path must be one of {MMA_PATHS}"
        if why := fuse_invalid_reason(self.path, self.fuse):
            return why
        if hidden % 64:
            return "H must be a multiple of 64"
        if self.tile_m not in (64, 128):
            return "tile_m must be 64 or 128"
        if not 1 <= self.split_k <= hidden // MMA_BLOCK_H:
            return f"split_k must be in [1, H / 32 = {hidden // MMA_BLOCK_H}]"
        if not 2 <= self.stages <= 8:
            return "stages must be in [2, 8]"
        if self.smem_bytes() > MMA_SMEM_LIMIT:
            return f"shared memory {self.smem_bytes()} B > {MMA_SMEM_LIMIT} B"
        return None

    def check(self, hidden: int) -> "MmaTactic":
        why = self.invalid_reason(hidden)
        if why is not None:
            raise ValueError(f"invalid tactic {self.name} for H = {hidden}: {why}")
        return self


_MMA_NAME = re.compile(rf"^(half_mma|all_mma):k(\d+):m(\d+):s(\d+):f({'|'.join(FUSE_SHAPES)})$")


def default_mma_tactic(path: str, m: int, hidden: int, sm_count: int = 132) -> MmaTactic:
    """About one wave of CTAs (one CTA per SM: the pipeline takes most of the shared memory), the deepest
    pipeline that fits. split_k is a power of two, so that few variants cover all M. The one-launch path
    keeps 64-token tiles: its last CTA also holds the big fuse."""
    tile_m = 64 if (m <= 64 or path == "all_mma") else 128
    split_k = one_wave_split_k(m, hidden, tile_m, sm_count)
    fuse = default_fuse(path, m)
    for stages in range(8, 1, -1):
        tactic = MmaTactic(path, split_k, tile_m, stages, fuse)
        if tactic.invalid_reason(hidden) is None:
            return tactic
    return MmaTactic(path, split_k, tile_m, 2, fuse).check(hidden)


def one_wave_split_k(m: int, hidden: int, tile_m: int, sm_count: int = 132) -> int:
    """The largest power of two of K splits (at most H / 32) whose grid of ``tile_m``-token tiles is at most one CTA
    per SM (at least 1)."""
    return 1 << max(0, min(hidden // MMA_BLOCK_H, sm_count // -(-m // tile_m)).bit_length() - 1)


def mma_shapes(base: MmaTactic, m: int, hidden: int, sm_count: int = 132) -> list[MmaTactic]:
    """The tensor-core shapes the tuner tries beside ``base``: for each M tile, its default split_k
    (``one_wave_split_k``), half of it, double and four times it, each at the three deepest pipelines that
    fit (the deepest is not always the fastest); the valid ones, ``base``'s path and big-fuse shape."""
    out = []
    for tile_m in (64, 128):
        split_k = one_wave_split_k(m, hidden, tile_m, sm_count)
        for k in (split_k, split_k // 2, split_k * 2, split_k * 4):
            fitting = [MmaTactic(base.path, k, tile_m, s, base.fuse) for s in range(8, 1, -1)]
            fitting = [t for t in fitting if k >= 1 and t.invalid_reason(hidden) is None]
            out += fitting[:3]
    return out


def mma_stage_bytes(tile_m: int, n_parts: int, with_x: bool = True, streams: int = HC_MULT) -> int:
    """Bytes one pipeline stage receives: residual + x tiles (bf16; no x tile without a post, one stream for the
    broadcast entry) and the weight tile (fp32)."""
    return (tile_m * (streams + (1 if with_x else 0)) * MMA_BLOCK_H * 2
            + N_MIXES * n_parts * streams * MMA_BLOCK_H * 4)
