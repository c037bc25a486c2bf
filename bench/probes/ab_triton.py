"""Timing of the Triton backend for whichever ``mhc_cute`` is first on the Python path: the default tactics over
a grid of (H, M), optionally followed by explicit candidate tactics. Run it alternately for two trees in one
GPU run to compare versions (see bench/probes/ab_versions.py for the set-up), or once with ``--sweep`` to compare
tactics. CUDA-graph replay over rotated input sets (mhc_cute.benchmark), median µs per call over
``--rounds`` rounds; points with M <= ``--check-max-m`` are also checked once against the float64 contract,
after the timing.

    PYTHONPATH=/tmp/old:$PYTHONPATH python bench/probes/ab_triton.py --tag old1
    python bench/probes/ab_triton.py --tag new1 --sweep reduce main
    python bench/probes/ab_triton.py --once 8192 7168      # a few eager calls, nothing timed (for ncu)

``--delayed`` times V4.1's delayed seam (``mhc_fused_hc_delayed``, carried gates) instead of the V4 seam.
"""

import argparse
import functools
import statistics
import sys

import torch

from mhc_cute import benchmark as mb
from mhc_cute.accuracy import failure_of, problem_of
from mhc_cute.api import mhc_fused_hc
from mhc_cute.triton import fused_hc
from mhc_cute.triton.configs import TritonTactic as T

_BIG = dict(block_m=64, block_h=32, split_k=8, num_warps=4, num_stages=4)
# candidate sets by name, each for M >= 1024 (H = 7168 sizes; fit() clamps them to H)
SWEEPS = {
    "reduce": [T(**_BIG, reduce_block_t=t, reduce_block_h=h, reduce_warps=w)
               for t, h, w in ((1, 2048, 4), (2, 1024, 4), (2, 2048, 4), (1, 4096, 4), (1, 8192, 8), (1, 1024, 4))],
    "main": [T(64, 32, 8, 4, num_stages=2, reduce_block_t=2, reduce_block_h=1024),
             T(64, 64, 8, 4, num_stages=2, reduce_block_t=2, reduce_block_h=1024),
             T(128, 32, 8, 4, num_stages=3, reduce_block_t=2, reduce_block_h=1024),
             T(128, 16, 8, 4, num_stages=4, reduce_block_t=2, reduce_block_h=1024),
             T(64, 32, 8, 8, num_stages=4, reduce_block_t=2, reduce_block_h=1024)],
    # more warps per SM: two warpgroups of 64 tokens per program, or programs small enough that two or three
    # share an SM (16-wide steps)
    "occupancy": [T(128, 32, 8, 8, num_stages=3, reduce_block_t=2, reduce_block_h=1024),
                  T(128, 32, 4, 8, num_stages=3, reduce_block_t=2, reduce_block_h=1024),
                  T(128, 16, 8, 8, num_stages=4, reduce_block_t=2, reduce_block_h=1024),
                  T(64, 16, 8, 4, num_stages=4, reduce_block_t=2, reduce_block_h=1024),
                  T(64, 16, 8, 4, num_stages=3, reduce_block_t=2, reduce_block_h=1024),
                  T(64, 16, 4, 4, num_stages=4, reduce_block_t=2, reduce_block_h=1024)],
    # wider H steps (128- and 256-byte pieces of each row, which stream faster than 64-byte ones as a plain copy:
    # probe_triton_ceiling.py) on fewer tokens per program
    "wide": [T(bm, bh, k, w, num_stages=st, reduce_block_t=2, reduce_block_h=1024)
             for bm, bh, k, w, st in ((32, 64, 8, 8, 3), (32, 64, 8, 8, 2), (32, 64, 8, 4, 3), (32, 64, 8, 4, 4),
                                      (32, 64, 16, 8, 3), (32, 64, 4, 8, 3), (16, 64, 8, 4, 4), (16, 64, 8, 4, 3),
                                      (16, 128, 8, 8, 2), (16, 128, 8, 4, 2), (64, 64, 8, 8, 2))],
    # 64-wide steps on 64 or more tokens with 16 warps, so that each thread's share of a step stays that of the
    # 32-wide table shape
    "warps16": [T(bm, bh, k, 16, num_stages=st, reduce_block_t=2, reduce_block_h=1024)
                for bm, bh, k, st in ((64, 64, 8, 2), (64, 64, 4, 2), (64, 64, 16, 2), (128, 32, 8, 3))],
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tag", default="run")
    ap.add_argument("--hidden", type=int, nargs="+", default=[7168, 4096])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 32, 512, 1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--sweep", nargs="*", default=[], choices=sorted(SWEEPS), help="candidate sets, at M >= 1024")
    ap.add_argument("--check-max-m", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2, help="timings of each candidate (median reported)")
    ap.add_argument("--delayed", action="store_true", help="the delayed seam (carried gates) instead")
    ap.add_argument("--once", type=int, nargs=2, metavar=("M", "H"), help="only a few eager calls (profiling)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    if args.once:
        s = mb.make_sets(args.once[0], args.once[1], 1, dev, False)[0]
        for _ in range(4):
            mhc_fused_hc(**s, backend="triton")
        torch.cuda.synchronize()
        return 0
    for h in args.hidden:
        for m in args.m:
            sets = mb.rotated_sets(m, h, dev)
            if args.delayed:
                sets = mb.with_carried_gates(sets)
            cands = [None] + [t for name in args.sweep for t in SWEEPS[name] if m >= 1024]
            # Every candidate is timed in each of --rounds rounds (the order reversed every other round), and the
            # float64 checks run only after all the timing: a check between timings slows the candidates timed
            # right after it (docs/experiments.md).
            call = functools.partial(mb.mhc_cute_call, "triton", delayed=args.delayed)
            times = mb.alternating_rounds(
                {i: (lambda t=t, sets=sets: mb.time_graph(call(tactic=t), sets, reps=args.reps))
                 for i, t in enumerate(cands)}, args.rounds)
            for i, t in enumerate(cands):
                if isinstance(times[i], Exception):  # a candidate that does not compile or launch: not fatal
                    e = times[i]
                    print(f"TAB {args.tag} H={h} M={m} ERROR {type(e).__name__} {str(e)[:200]} {t}", flush=True)
                    continue
                shown = fused_hc._default_tactic(dev, m, h) if t is None else t
                check = (failure_of(problem_of(sets[0]), "triton", t) or "ok") if m <= args.check_max_m else "-"
                rounds = " ".join(f"{us:.2f}" for us in times[i])
                print(f"TAB {args.tag} H={h} M={m} {statistics.median(times[i]):8.2f} {check} "
                      f"{'default' if t is None else 'cand'} {shown} rounds {rounds}", flush=True)
            del sets
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
