"""Tactics as data: what each kernel path can be configured with, which configurations are valid, and the
default per problem size.

A tactic is a frozen dataclass, so it is hashable (the compiled-kernel caches key on it) and printable (the
benchmark and the autotuner log it). ``FmaTactic`` describes paths E (``half_fma``) and F (``all_fma``); the
tensor-core paths B and D have ``MmaTactic`` (in ``kernels.mma``, next to its shared-memory model), and
``parse_tactic`` turns a tactic's ``name`` back into the object.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

N_MIXES = 24  # pre(4) + post(4) + comb(16) projection columns
HC_MULT = 4
PARTIAL_COLS = 32  # a split-K partial row: 24 dots, the sum of squares, 7 unused (one 128-byte line)
MAX_SMEM_BYTES = 48 * 1024  # static smem budget per CTA (no opt-in carve-out needed)
MAX_ACCUMULATORS = 64  # fp32 accumulators per thread (tokens_per_cta * tile_n) before register spills

FMA_PATHS = ("half_fma", "all_fma")
MMA_PATHS = ("half_mma", "all_mma")  # their tactic, MmaTactic, lives in kernels.mma for now


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
    """

    path: str  # "half_fma" (projection + big-fuse kernel) | "all_fma" (one launch, last CTA runs the big fuse)
    split_k: int
    tokens_per_cta: int
    tile_n: int
    threads: int
    stages: int = 1
    burst: int = 1

    @property
    def chunk_h(self) -> int:
        return self.threads * self.tile_n // N_MIXES

    @property
    def name(self) -> str:
        return (f"{self.path}:k{self.split_k}:t{self.tokens_per_cta}:n{self.tile_n}:"
                f"w{self.threads}:s{self.stages}:b{self.burst}")

    def smem_bytes(self) -> int:
        """Shared memory of the projection phase: the fp32 chunk of the post-map output plus the reduction."""
        activations = self.tokens_per_cta * HC_MULT * self.chunk_h * self.burst * 4
        reduction = (self.threads // 32) * self.tokens_per_cta * (self.tile_n + 1) * 4
        return activations + reduction

    def invalid_reason(self, hidden: int) -> str | None:
        """None if this tactic can run at hidden size ``hidden``, else why not."""
        if self.path not in FMA_PATHS:
            return f"path must be one of {FMA_PATHS}"
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
            return f"H / split_k = {hidden // max(self.split_k, 1)} must be a multiple of chunk_h = {self.chunk_h}"
        if self.tokens_per_cta < 1 or self.tokens_per_cta * self.tile_n > MAX_ACCUMULATORS:
            return f"tokens_per_cta * tile_n must be in [1, {MAX_ACCUMULATORS}]"
        if self.stages not in (1, 2):
            return "stages must be 1 or 2"
        if self.stages == 2 and hidden // self.split_k == self.chunk_h:
            return "stages = 2 needs at least two chunks per CTA"
        if self.burst < 1 or (hidden // self.split_k) % (self.chunk_h * self.burst):
            return "burst must divide the chunks of a CTA"
        if self.smem_bytes() > MAX_SMEM_BYTES:
            return f"shared memory {self.smem_bytes()} B > {MAX_SMEM_BYTES} B"
        return None

    def check(self, hidden: int) -> "FmaTactic":
        why = self.invalid_reason(hidden)
        if why is not None:
            raise ValueError(f"invalid tactic {self.name} for H = {hidden}: {why}")
        return self


_FMA_NAME = re.compile(r"^(half_fma|all_fma):k(\d+):t(\d+):n(\d+):w(\d+):s(\d+):b(\d+)$")


def parse_tactic(name: str):
    """The tactic object whose ``name`` is ``name`` (FMA paths here, MMA paths in ``kernels.mma``)."""
    match = _FMA_NAME.match(name)
    if match:
        path, *nums = match.groups()
        return FmaTactic(path, *map(int, nums))
    if name.startswith(MMA_PATHS):
        from .kernels.mma import parse_mma_tactic  # imports the CuTe DSL: only when an MMA tactic is named

        return parse_mma_tactic(name)
    raise ValueError(f"unknown tactic name {name!r}")


def largest_split(hidden: int, chunk_h: int, target: int) -> int:
    """The largest split_k <= target that divides H into whole chunks (1 if none larger)."""
    best = 1
    for k in range(1, target + 1):
        if hidden % k == 0 and (hidden // k) % chunk_h == 0:
            best = k
    return best


FMA_THREADS, FMA_TILE_N = 256, 6  # chunk_h = 64: every H % 64 == 0 works
# M buckets of the default FMA tactic: (largest M of the bucket, tokens per CTA); the split is a function of the
# bucket too (see default_fma_tactic), so there is one compiled variant per bucket. From an H200 sweep at
# H = 7168 (bench/bench_fma.py).
FMA_BUCKETS = ((2, 1), (4, 4), (16, 8), (32, 8), (128, 8), (256, 8), (1 << 30, 8))
FMA_SPLIT_M = 512  # the largest bucket sizes its split for this many tokens


def default_fma_tactic(path: str, m: int, hidden: int, sm_count: int = 132) -> FmaTactic:
    """A sensible FMA tactic for M tokens at hidden size H (before any tuning).

    Up to 16 tokens the op is latency bound: one chunk per CTA, so that the weight read is spread over as many
    CTAs as possible. Beyond, each token block gets about one wave's share of splits.
    """
    bucket_m, tokens = next(b for b in FMA_BUCKETS if m <= b[0])
    chunk_h = FMA_THREADS * FMA_TILE_N // N_MIXES
    if bucket_m <= 16:
        target = hidden // chunk_h
    else:
        target = max(1, sm_count // -(-min(bucket_m, FMA_SPLIT_M) // tokens))
    split_k = largest_split(hidden, chunk_h, target)
    return FmaTactic(path, split_k, tokens, FMA_TILE_N, FMA_THREADS, 1).check(hidden)
