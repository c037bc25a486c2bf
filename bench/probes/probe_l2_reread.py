"""Does re-reading an L2-resident weight slow a kernel that streams HBM at full speed? A copy kernel whose programs also
read a small array (the size of fp32 `fn` at H = 7168, 2.75 MB, so it stays in L2) in proportion to what they copy:
`--ratios` of extra L2 bytes per HBM byte (read + write). A design that collapses `residual_cur` from on-chip memory (no
re-read from HBM, the only way to the 80% of issue #5) must split each token's H over many CTAs, and each CTA then reads
its slice of `fn` again for every tile of tokens: 0.6-1.2 L2 bytes per HBM byte at 16-32 tokens per tile
(docs/experiments.md). Prints the HBM rate of each ratio against the plain copy (ratio 0) in the same run.

    python bench/probes/probe_l2_reread.py --ratios 0 0.125 0.25 0.5 1 2
"""

import argparse
import statistics

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from mhc_cute import benchmark as mb  # noqa: E402

WEIGHT_FLOATS = 24 * 4 * 7168  # fp32 fn at H = 7168


@triton.jit
def copy_and_reread(src, dst, weight, sink, weight_floats, per_program: tl.constexpr, BLOCK: tl.constexpr,
                    WBLOCK: tl.constexpr, EVERY: tl.constexpr):
    """Copy ``per_program`` floats of ``src`` to ``dst`` in steps of BLOCK; every EVERY steps also sum the next
    WBLOCK floats of ``weight`` (a window that starts where the program's index puts it and wraps around) into
    ``sink[program]``."""
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * per_program
    acc = tl.zeros([BLOCK], tl.float32)
    w0 = (pid * WBLOCK) % weight_floats
    for i in range(0, per_program, BLOCK):
        offs = base + i + tl.arange(0, BLOCK)
        tl.store(dst + offs, tl.load(src + offs))
        step = i // BLOCK
        if step % EVERY == 0:
            for j in tl.static_range(0, WBLOCK, BLOCK):
                w = (w0 + (step // EVERY) * WBLOCK + j) % weight_floats
                acc += tl.load(weight + w + tl.arange(0, BLOCK))
    tl.store(sink + pid, tl.sum(acc))


def reread_shape(ratio: float, block: int) -> tuple[int, int]:
    """(WBLOCK, EVERY) for ``ratio`` extra L2 bytes per HBM byte (a step copies BLOCK floats: 2 BLOCK moved)."""
    if ratio <= 0:
        return 0, 1
    if ratio >= 0.5:
        return int(round(2 * ratio)) * block, 1
    return block, int(round(1 / (2 * ratio)))


def launch(src, dst, weight, sink, per_program: int, block: int, ratio: float):
    wblock, every = reread_shape(ratio, block)
    copy_and_reread[(src.numel() // per_program,)](src, dst, weight, sink, weight.numel(), per_program=per_program,
                                                   BLOCK=block, WBLOCK=wblock, EVERY=every, num_warps=4)


def expected_sink(src, weight, per_program: int, block: int, ratio: float) -> torch.Tensor:
    """What ``launch`` leaves in ``sink`` (float64 sums of the same windows), for the CPU test."""
    wblock, every = reread_shape(ratio, block)
    n, w = weight.numel(), weight.double()
    sums = []
    for pid in range(src.numel() // per_program):
        total = torch.tensor(0.0, dtype=torch.float64)
        for step in range(0, per_program // block, every):
            for j in range(0, wblock, block):
                start = (pid * wblock + (step // every) * wblock + j) % n
                total += w[start:start + block].sum()
        sums.append(total)
    return torch.stack(sums)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ratios", type=float, nargs="+", default=[0, 0.125, 0.25, 0.5, 1, 2],
                    help="extra L2 bytes per HBM byte (0, 1/(2k) or a multiple of 0.5)")
    ap.add_argument("--gib", type=float, default=1.0, help="bytes copied per launch")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    block, per_program = 1024, 16 * 1024  # 64 KB per program, 4 KB per step
    n = int(args.gib * 2**30) // 4 // per_program * per_program
    src = torch.randn(n, device=dev)
    dst = torch.empty_like(src)
    weight = torch.randn(WEIGHT_FLOATS // block * block, device=dev)
    sink = torch.empty(n // per_program, device=dev)
    print(f"GPU: {torch.cuda.get_device_name(dev)}; torch copy bandwidth {mb.measure_copy_bandwidth(dev) / 1e12:.2f} TB/s; copy of {4 * n / 2**30:.2f} GiB, weight {weight.numel() * 4 / 2**20:.2f} "
          f"MiB; {per_program * 4 // 1024} KiB per program, {n // per_program} programs")
    print(f"{'ratio':>6} | {'us':>9} {'HBM TB/s':>9} {'vs copy':>8} {'L2 extra TB/s':>14}")
    base = None
    for ratio in [0.0] + [r for r in args.ratios if r > 0]:  # the plain copy first: the reference
        us = statistics.median(mb.launch_us(lambda: launch(src, dst, weight, sink, per_program, block, ratio),
                                            args.reps))
        assert torch.equal(dst, src)
        wblock, every = reread_shape(ratio, block)
        hbm = 8 * n / us / 1e6
        extra = 4 * (n // block // every) * wblock / us / 1e6
        base = base or hbm
        print(f"{ratio:6.3f} | {us:9.1f} {hbm:9.2f} {hbm / base:8.3f} {extra:14.2f}", flush=True)


if __name__ == "__main__":
    main()
