"""Quick device benchmark of the Triton backend: default tactics vs TileKernels and the copy-bandwidth floor,
plus a small tactic sweep to tune the configuration table.

    python bench/bench_triton.py --hidden 7168 --m 1 64 2048 --out results/      # default tactics + peers
    python bench/bench_triton.py --sweep --m 1 16 4096                          # also the sweep candidates
    python bench/bench_triton.py --with-tests --precompile-only                 # only warm the test grid

Timing is mhc_cute.benchmark's: CUDA-graph replay over rotating input sets (nothing stays in L2 between calls),
median µs per call. Triton compiles each kernel variant on first use (about a second each); ``--precompile``
every variant this run needs is compiled in parallel processes first (Triton's on-disk cache is shared), with
``--with-tests`` also those of the GPU test grid of tests/test_correctness.py, and TileKernels' kernels.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import sys
import time

import torch

from mhc_cute import benchmark as bm
from mhc_cute.accuracy import failure_of, problem_of
from mhc_cute.triton.configs import TritonTactic as T

# candidates per M (H = 7168 sizes; select/fit clamps them for other H): around the sm90 table's entries, from
# the sweeps that chose them (bench/measured/h200_triton_sweep_k64_2026-12-01.txt)
_W = dict(reduce_block_h=8192, reduce_warps=8)
_R = dict(reduce_block_t=2, reduce_block_h=1024)
SWEEP = {
    1: [T(1, 128, 56, 4, reduce_block_h=8192, reduce_warps=8), T(1, 32, 224, 4, reduce_block_h=8192, reduce_warps=8),
        T(1, 64, 112, 4, reduce_block_h=8192, reduce_warps=4), T(1, 64, 112, 4, reduce_block_h=8192, reduce_warps=16)],
    4: [T(4, 64, 112, 8, reduce_block_h=8192, reduce_warps=8), T(2, 64, 112, 4, reduce_block_h=8192, reduce_warps=8),
        T(4, 32, 112, 4, reduce_block_h=8192, reduce_warps=8), T(16, 16, 224, 4, reduce_block_h=8192, reduce_warps=8)],
    16: [T(16, 16, 224, 4, num_stages=3, **_W), T(16, 16, 112, 4, num_stages=3, **_W),
         T(16, 32, 112, 4, num_stages=3, **_W)],
    64: [T(16, 16, 112, 4, num_stages=2, **_W), T(32, 16, 32, 4, num_stages=3), T(16, 32, 56, 4, num_stages=3),
         T(64, 16, 16, 4, num_stages=3)],
    256: [T(32, 16, 32, 4, num_stages=4, **_W), T(32, 32, 16, 4, num_stages=4, **_W),
          T(64, 16, 16, 4, num_stages=4, **_W), T(32, 16, 64, 4, num_stages=3, **_W)],
    1024: [T(64, 32, 8, 4, num_stages=4), T(64, 32, 16, 4, num_stages=4), T(64, 16, 16, 4, num_stages=4)],
    2048: [T(64, 32, 8, 4, num_stages=4), T(64, 32, 4, 4, num_stages=4, **_R), T(64, 16, 8, 4, num_stages=5)],
    4096: [T(64, 32, 4, 4, num_stages=4, **_R), T(64, 32, 4, 4, num_stages=5, **_R),
           T(64, 32, 8, 4, num_stages=4, **_R), T(64, 32, 2, 4, num_stages=4, **_R),
           T(32, 32, 8, 4, num_stages=4, **_R), T(64, 16, 4, 4, num_stages=6, **_R),
           T(128, 32, 2, 8, num_stages=3, **_R), T(128, 16, 4, 8, num_stages=4, **_R)],
}
CHECK_MAX_M = 4096  # sweep tactics are checked against float64 up to this M (the reference needs ~5 GB there)


def _run_once(job):
    """Worker: run one problem once, so that its kernels get compiled and cached on disk. Returns an error line
    or None."""
    m, h, norm, tactic = job
    try:
        s = bm.make_sets(m, h, 1, torch.device("cuda"), norm)[0]
        if tactic == "tilekernels":
            peer = bm.peer_calls(False).get("tilekernels")
            if peer is not None:
                peer(s)
        else:
            bm.mhc_cute_call("triton", tactic=tactic)(s)
        torch.cuda.synchronize()
    except Exception as e:  # reported, and the variant's timing will show the error again
        return f"precompile M={m} H={h} norm={norm} {tactic}: {type(e).__name__}: {str(e)[:2000]}"
    return None


def _compile_key(m, h, norm, tactic):
    from mhc_cute.triton import configs, fused_hc

    if tactic == "tilekernels":
        return tactic, h
    t = fused_hc._default_tactic(torch.device("cuda"), m, h) if tactic is None else configs.fit(tactic, h)
    return t, norm, t.reduce_block_h >= h, (t.split_k - 1).bit_length()


def precompile(jobs, workers: int) -> None:
    unique = list({_compile_key(*j): j for j in jobs}.values())
    t0 = time.perf_counter()
    with mp.get_context("spawn").Pool(workers) as pool:
        for err in pool.imap_unordered(_run_once, unique):
            if err:
                print(err, file=sys.stderr, flush=True)
    print(f"precompiled {len(unique)} variants ({len(jobs)} jobs) in {time.perf_counter() - t0:.1f} s",
          file=sys.stderr, flush=True)


def test_grid_jobs():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from test_correctness import GPU_HS, GPU_MS

    return [(m, h, norm, None) for m in GPU_MS for h in GPU_HS for norm in (False, True)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, nargs="+", default=[7168])
    p.add_argument("--m", type=int, nargs="+", default=list(bm.BENCH_MS))
    p.add_argument("--sweep", action="store_true", help="also time the sweep candidates of the nearest M")
    p.add_argument("--no-peers", action="store_true")
    p.add_argument("--norm", action="store_true")
    p.add_argument("--with-tests", action="store_true", help="also compile the GPU test grid's kernels")
    p.add_argument("--precompile-only", action="store_true")
    p.add_argument("--no-precompile", action="store_true", help="the kernels are in Triton's cache already")
    p.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    p.add_argument("--out", help="folder for results.json and table.txt")
    args = p.parse_args()

    dev = torch.device("cuda")
    gpu = torch.cuda.get_device_name(dev)

    def candidates(m, h):
        near = min(SWEEP, key=lambda k: abs(k.bit_length() - m.bit_length()))
        return SWEEP[near] if args.sweep and h == 7168 else []

    jobs = [(m, h, args.norm, t) for h in args.hidden for m in args.m for t in [None, *candidates(m, h)]]
    if not args.no_peers and not args.norm:
        jobs += [(1, h, False, "tilekernels") for h in args.hidden]
    if args.with_tests:
        jobs += test_grid_jobs()
    if not args.no_precompile:
        precompile(jobs, args.workers)
    if args.precompile_only:
        return 0

    bandwidth = bm.measure_copy_bandwidth(dev)
    print(f"GPU {gpu}, copy bandwidth {bandwidth / 1e12:.2f} TB/s", file=sys.stderr, flush=True)
    peers = {} if args.no_peers else {k: v for k, v in bm.peer_calls(args.norm).items() if k == "tilekernels"}
    results, sweep = [], []
    for h in args.hidden:
        for m in args.m:
            sets = bm.rotated_sets(m, h, dev, args.norm)
            row = [bm.bench_one("triton", bm.mhc_cute_call("triton"), m, h, dev, args.norm, bandwidth, sets=sets)]
            row += [bm.bench_one(n, c, m, h, dev, args.norm, bandwidth, sets=sets, eager=False)
                    for n, c in peers.items()]
            timed = [(t, bm.bench_one("sweep", bm.mhc_cute_call("triton", tactic=t), m, h, dev, args.norm,
                                      bandwidth, sets=sets, eager=False)) for t in candidates(m, h)]
            # checked after all of the point's timing: a check slows the timings right after it (docs/experiments.md)
            for t, r in timed:
                check = (failure_of(problem_of(sets[0]), "triton", t) or "ok") if m <= CHECK_MAX_M else "unchecked"
                sweep.append(dict(m=m, h=h, tactic=repr(t), graph_us=r.graph_us, error=r.error, check=check))
                print(f"  sweep H={h} M={m} {r.graph_us} {r.error or ''} {check} {t}", file=sys.stderr, flush=True)
            for r in row:
                print(f"  H={h} M={m} {r.name}: graph {r.graph_us} eager {r.eager_us} "
                      f"floor {r.floor_frac} {r.error or ''}", file=sys.stderr, flush=True)
            results += row
            del sets
            torch.cuda.empty_cache()
    table = bm.format_table(results, bandwidth, gpu)
    print(table)
    for (h, m), group in itertools.groupby(sweep, key=lambda r: (r["h"], r["m"])):
        best = min((r for r in group if r["graph_us"] and r["check"] in ("ok", "unchecked")),
                   key=lambda r: r["graph_us"], default=None)
        if best:
            print(f"best H={h} M={m}: {best['graph_us']:.2f} us {best['tactic']}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "table.txt"), "w") as f:
            f.write(table + "\n")
        bm.write_json(results, os.path.join(args.out, "results.json"), bandwidth, gpu,
                      dict(norm=args.norm, sweep=sweep))
        with open(os.path.join(args.out, "sweep.json"), "w") as f:
            json.dump(sweep, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
