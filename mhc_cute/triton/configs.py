"""Launch configurations of the Triton backend, per architecture, as data in one place.

A table is keyed by architecture and compute-unit count (the count its K splits were sized for) and lists
tactics by M bucket. ``select_tactic`` picks the table of the device, the bucket of M, rescales the K splits to
the device's CU count when it differs from the table's, and clamps everything to H. Unknown GPUs (and the CPU
interpreter) use ``FALLBACK``.

How the numbers were chosen: at small M the op is latency bound and the K splits spread one token block over every CU
(the whole GPU reads its share of ``fn`` and of the 4H row once); at large M each program takes a large token block so
that ``fn`` (read from L2 once per token block and K step) is reused, and the splits only keep a few programs per CU
resident to hide memory latency. The Hopper entries from M = 9 up come from H200 sweeps of the current main kernel (one
projection per step over the four streams; bench/measured/h200_triton_sweep_k64_2026-12-01.txt): from M = 1024 up,
32-wide H steps with a 4-deep pipeline (one program of 4 warps per SM; the weight's bf16 terms take most of the shared
memory), and the largest bucket's reduce kernel takes two tokens per program. No entry spills (ptxas report,
bench/probes/triton_registers.py). The AMD entries follow the same rules with the CU counts of MI355X (gfx950, 256 CUs)
and MI300X (gfx942, 304 CUs), compile for those targets, and have not been run on AMD hardware.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields, replace



@dataclass(frozen=True)
class TritonTactic:
    """One launch configuration of the two kernels.

    Main kernel: a program owns ``block_m`` tokens and one of ``split_k`` ranges of H (for all 4 streams), walked
    in steps of ``block_h``; ``block_m >= 16`` projects on tensor cores (``tl.dot`` with ``fn`` split exactly
    into three bf16 terms: fp32-exact products, fp32 accumulation), smaller blocks with fp32 FMAs held as
    ``[block_m, block_h, 32]`` (keep ``block_m * block_h <= 256``). Reduce kernel: a
    program owns ``reduce_block_t`` tokens and walks H in tiles of ``reduce_block_h`` (a tile covering H keeps
    the row in registers for the fused RMSNorm). ``chunk_m`` > 0 runs the two kernels per chunk of that many
    tokens, so that the reduce kernel re-reads ``residual_cur`` from L2 rather than HBM (large M).
    """

    block_m: int
    block_h: int
    split_k: int
    num_warps: int
    num_stages: int = 1
    reduce_block_t: int = 1
    reduce_block_h: int = 2048
    reduce_warps: int = 4
    chunk_m: int = 0

    @property
    def uses_dot(self) -> bool:
        """Whether the main kernel projects on tensor cores (else with fp32 FMAs)."""
        return self.block_m >= 16

    @property
    def name(self) -> str:
        """``triton:`` and every field as ``key value`` (``_NAME_KEYS``); ``parse_triton_tactic`` reads it back."""
        return "triton:" + ":".join(f"{key}{getattr(self, f.name)}" for key, f in zip(_NAME_KEYS, fields(self)))

    def __post_init__(self):
        for name in ("block_m", "block_h", "reduce_block_t", "reduce_block_h"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"TritonTactic.{name} must be a power of two; got {v}")
        if self.block_h < 16:
            raise ValueError(f"TritonTactic.block_h must be >= 16; got {self.block_h}")
        if self.split_k < 1 or self.num_warps < 1 or self.reduce_warps < 1 or self.num_stages < 1 or self.chunk_m < 0:
            raise ValueError(f"TritonTactic: split_k, warps and stages must be >= 1; got {self}")


_NAME_KEYS = ("m", "h", "k", "w", "s", "rt", "rh", "rw", "c")  # TritonTactic's fields, in order
_NAME = re.compile("triton" + "".join(f":{key}(\\d+)" for key in _NAME_KEYS) + "$")


def parse_triton_tactic(name: str) -> TritonTactic:
    """The ``TritonTactic`` whose ``name`` is ``name``."""
    match = _NAME.match(name)
    if match is None:
        raise ValueError(f"unknown Triton tactic name {name!r} (like {TritonTactic(16, 64, 8, 4).name!r})")
    return TritonTactic(*map(int, match.groups()))


@dataclass(frozen=True)
class ArchTable:
    arch: str  # "sm90", "gfx950", "gfx942", ... or "generic"
    compute_units: int  # CU/SM count the split_k values were sized for
    buckets: tuple[tuple[int, TritonTactic], ...]  # (largest M, tactic), ascending; the last covers every M


T = TritonTactic
BIG = 1 << 62

TABLES: tuple[ArchTable, ...] = (
    ArchTable("sm90", 132, (
        (1, T(1, 64, 112, 4, reduce_block_h=8192, reduce_warps=8)),
        (2, T(2, 64, 112, 4, reduce_block_h=8192, reduce_warps=8)),
        (4, T(4, 32, 224, 4, reduce_block_h=8192, reduce_warps=8)),
        (8, T(8, 16, 224, 4, reduce_block_h=8192, reduce_warps=8)),
        (64, T(16, 16, 112, 4, num_stages=3, reduce_block_h=8192, reduce_warps=8)),
        (256, T(32, 16, 32, 4, num_stages=3, reduce_block_h=8192, reduce_warps=8)),
        (512, T(64, 16, 16, 4, num_stages=3, reduce_block_h=2048, reduce_warps=4)),
        (2048, T(64, 32, 8, 4, num_stages=4, reduce_block_h=2048, reduce_warps=4)),
        (BIG, T(64, 32, 8, 4, num_stages=4, reduce_block_t=2, reduce_block_h=1024, reduce_warps=4)),
    )),
    # MI355X: 256 CUs, 64-lane wavefronts (num_warps counts wavefronts)
    ArchTable("gfx950", 256, (
        (4, T(4, 64, 112, 4, reduce_block_h=8192, reduce_warps=8)),
        (16, T(16, 64, 112, 4, reduce_block_h=8192, reduce_warps=8)),
        (64, T(16, 64, 56, 4, reduce_block_h=8192, reduce_warps=8)),
        (256, T(32, 64, 28, 4, reduce_block_h=8192, reduce_warps=8)),
        (1024, T(64, 64, 16, 4, reduce_block_h=2048, reduce_warps=4)),
        (2048, T(64, 64, 8, 4, reduce_block_h=2048, reduce_warps=4)),
        (BIG, T(64, 64, 4, 4, reduce_block_h=2048, reduce_warps=4)),
    )),
    # MI300X / MI325X: 304 CUs
    ArchTable("gfx942", 304, (
        (4, T(4, 64, 112, 4, reduce_block_h=8192, reduce_warps=8)),
        (16, T(16, 64, 112, 4, reduce_block_h=8192, reduce_warps=8)),
        (64, T(16, 64, 64, 4, reduce_block_h=8192, reduce_warps=8)),
        (256, T(32, 64, 32, 4, reduce_block_h=8192, reduce_warps=8)),
        (1024, T(64, 64, 16, 4, reduce_block_h=2048, reduce_warps=4)),
        (2048, T(64, 64, 8, 4, reduce_block_h=2048, reduce_warps=4)),
        (BIG, T(64, 64, 4, 4, reduce_block_h=2048, reduce_warps=4)),
    )),
)

# Any other GPU (and the CPU interpreter): the same rules, sized for 100 CUs and rescaled to the real count.
FALLBACK = ArchTable("generic", 100, (
    (4, T(4, 64, 64, 4, reduce_block_h=4096, reduce_warps=8)),
    (16, T(16, 64, 64, 4, reduce_block_h=4096, reduce_warps=8)),
    (256, T(32, 64, 16, 4, reduce_block_h=4096, reduce_warps=8)),
    (BIG, T(64, 64, 4, 4, reduce_block_h=2048, reduce_warps=4)),
))

del T


def arch_of(props) -> str:
    """``"gfx950"`` from an AMD ``gcnArchName`` such as ``"gfx950:sramecc+:xnack-"``, else ``"sm<major><minor>"``."""
    gcn = getattr(props, "gcnArchName", "") or ""
    if gcn.startswith("gfx"):
        return gcn.split(":")[0]
    return f"sm{props.major}{props.minor}"


def table_for(arch: str) -> ArchTable:
    for table in TABLES:
        if table.arch == arch:
            return table
    return FALLBACK


def select_tactic(arch: str, compute_units: int, m: int, hidden: int) -> TritonTactic:
    """The tactic for ``m`` tokens of hidden size ``hidden`` on a GPU of ``arch`` with ``compute_units`` CUs."""
    table = table_for(arch)
    tactic = next(t for max_m, t in table.buckets if m <= max_m)
    split_k = tactic.split_k
    if compute_units != table.compute_units:
        split_k = max(1, round(split_k * compute_units / table.compute_units))
    return fit(replace(tactic, split_k=split_k), hidden)


def fit(tactic: TritonTactic, hidden: int) -> TritonTactic:
    """Clamp a tactic to H: block_h divides H, every K split owns the same number of H blocks (the last may own
    fewer, never none), no reduce tile wider than H."""
    block_h = tactic.block_h
    while hidden % block_h:
        block_h //= 2
    n_blocks = hidden // block_h
    split_k = -(-n_blocks // -(-n_blocks // min(tactic.split_k, n_blocks)))
    reduce_block_h = min(tactic.reduce_block_h, 1 << math.ceil(math.log2(hidden)))
    return replace(tactic, block_h=block_h, split_k=split_k, reduce_block_h=reduce_block_h)
