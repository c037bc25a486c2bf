"""Device benchmark of the tensor-core paths (B ``half_mma``, D ``all_mma``) with the method of
``mhc_cute.benchmark``: CUDA-graph replay over rotating input and weight sets (nothing in L2 between calls),
median of the replays; the floor is SPEC's byte count over the copy bandwidth measured in the same run.

    python bench/bench_mma.py --hidden 7168 4096 --m 2048 4096 8192 --sweep --json mma.json
    python bench/bench_mma.py --precompile-tests     # only compile what the GPU correctness tests will use

Compiles run first, in parallel worker processes that persist the kernels (``$MHC_CUTE_KERNEL_CACHE``, a
temporary directory when unset); the timing process then loads them.
"""

import argparse
import json
import os
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # test_correctness: the GPU test grid

import torch  # noqa: E402

from mhc_cute import benchmark as mb  # noqa: E402
from mhc_cute.accuracy import failure_of, problem_of  # noqa: E402
from mhc_cute.tactics import parse_tactic  # noqa: E402
from mhc_cute.kernels import KERNEL_CACHE_ENV  # noqa: E402

PATHS = ("half_mma", "all_mma")
FLOOR_TARGET = 0.80  # of the copy-bandwidth floor, for M >= 2048 in fp32 (issue 5)
TILEKERNELS_SPEEDUP = 1.8  # at M = 8192 (issue 5)


def sweep_tactics(path: str, m: int, hidden: int, sm_count: int) -> list:
    """The default (and, on path B, its other big-fuse shape) plus splits for about 1 and 2 waves, both tiles
    (path B) and the deepest pipelines."""
    from dataclasses import replace

    from mhc_cute.tactics import FUSE_SHAPES, MMA_BLOCK_H as BLOCK_H, MmaTactic, default_mma_tactic

    default = default_mma_tactic(path, m, hidden, sm_count)
    out = {default}
    if path == "half_mma":
        out |= {replace(default, fuse=f) for f in FUSE_SHAPES}
    for tile_m in ((64, 128) if path == "half_mma" else (64,)):
        tiles = -(-m // tile_m)
        for waves in (1, 2):
            split = max(1, min(hidden // BLOCK_H, waves * sm_count // tiles))
            for stages in (2, 3, 4, 5):
                t = MmaTactic(path, split, tile_m, stages, default.fuse)
                if t.invalid_reason(hidden) is None:
                    out.add(t)
    return sorted(out, key=lambda t: (t.tile_m, t.split_k, t.stages))


def test_grid_specs(sm_count: int) -> list:
    """(tactic, H, precision, norm) of every default tactic the GPU correctness tests reach."""
    from mhc_cute.tactics import default_mma_tactic

    from test_correctness import GPU_HS, GPU_MS

    specs = []
    for p in PATHS:
        for h in GPU_HS:
            for m in GPU_MS:
                for norm in (None, "bfloat16"):
                    specs.append((default_mma_tactic(p, m, h, sm_count).name, h, "fp32", norm))
        for h in (4096, 7168):
            for m in (1, 17, 1000, 8192):
                specs.append((default_mma_tactic(p, m, h, sm_count).name, h, "tf32", "bfloat16"))
    explicit = ["half_mma:k16:m64:s2:flat", "half_mma:k5:m64:s4:fbw", "half_mma:k3:m128:s3:fbw", "half_mma:k1:m128:s2:flat"]
    for name, h in zip(explicit, (512, 4096, 7168, 5120)):
        specs += [(name, h, prec, None) for prec in ("fp32", "tf32")]
    for name in ("half_mma:k7:m128:s3:fbw", "half_mma:k28:m64:s5:flat", "all_mma:k1:m64:s2:fbw", "all_mma:k9:m64:s4:fbw",
                 "all_mma:k56:m64:s3:fbw"):
        specs += [(name, 7168, "fp32", norm) for norm in (None, "bfloat16")]
    return specs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, nargs="+", default=[7168, 4096])
    ap.add_argument("--m", type=int, nargs="+", default=[256, 1024, 2048, 4096, 8192])
    ap.add_argument("--precision", nargs="+", default=["fp32", "tf32"])
    ap.add_argument("--sweep", action="store_true", help="time a small tactic sweep, not only the default")
    ap.add_argument("--tactics", nargs="+", default=None, help="time these tactics (names) instead")
    ap.add_argument("--check", action="store_true", help="check every timed tactic against the contract once")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--precompile-tests", action="store_true", help="compile the test grid's variants and exit")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    os.environ.setdefault(KERNEL_CACHE_ENV, tempfile.mkdtemp(prefix="mhc_kernels_"))
    from mhc_cute.kernels import mma

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    gpu = torch.cuda.get_device_name(dev)
    if args.precompile_tests:
        specs = test_grid_specs(sms)
        mma.precompile(specs)
        print(f"compiled {len(set(specs))} test variants", flush=True)
        return 0

    def tactics_for(h, m, p):
        if args.tactics:
            return [t for t in map(parse_tactic, args.tactics) if t.path == p]
        return sweep_tactics(p, m, h, sms) if args.sweep else [mma.default_mma_tactic(p, m, h, sms)]

    plan = {(h, m, p): tactics_for(h, m, p) for h in args.hidden for m in args.m for p in PATHS}
    specs = [(t.name, h, prec, None) for (h, m, p), ts in plan.items() for t in ts for prec in args.precision]
    mma.precompile(specs)
    print(f"compiled {len(set(specs))} variants", flush=True)

    bandwidth = mb.measure_copy_bandwidth(dev)
    print(f"{gpu}: copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    peers = {} if args.no_peers else {k: v for k, v in mb.peer_calls(False).items() if k == "tilekernels"}
    results, summary = [], []
    for h in args.hidden:
        for m in args.m:
            sets = mb.rotated_sets(m, h, dev)
            floor_us = mb.floor_bytes(m, h) / bandwidth * 1e6
            peer_us = {}
            for name, call in peers.items():
                r = mb.bench_one(name, call, m, h, dev, False, bandwidth, sets, eager=False)
                results.append(r)
                peer_us[name] = r.graph_us
            timed = {prec: [(p, t, mb.bench_one(f"{t.name}:{prec}", mb.mhc_cute_call(p, prec, t), m, h, dev, False,
                                                bandwidth, sets, eager=False))
                            for p in PATHS for t in plan[(h, m, p)]] for prec in args.precision}
            # checked after all the point's timing: a float64 check slows the timings after it (docs/experiments.md)
            for prec in args.precision:
                best = None
                for p, t, r in timed[prec]:
                    why = failure_of(problem_of(sets[0], prec), p, t) if args.check else None
                    r.extra["wrong"] = why
                    results.append(r)
                    status = r.error or (f"WRONG {why}" if why else "")
                    if r.graph_us is not None:
                        print(f"H={h:5d} M={m:5d} {prec} {t.name:24s} {r.graph_us:8.2f} us "
                              f"{100 * r.floor_frac:5.1f}% of floor {status}", flush=True)
                    else:
                        print(f"H={h:5d} M={m:5d} {prec} {t.name:24s} {status}", flush=True)
                    if r.graph_us is not None and not why and (best is None or r.graph_us < best.graph_us):
                        best = r
                if best is None:
                    continue
                tk = peer_us.get("tilekernels")
                line = dict(hidden=h, m=m, precision=prec, best=best.name, us=best.graph_us, floor_us=floor_us,
                            floor_frac=best.floor_frac, tilekernels_us=tk,
                            speedup_vs_tilekernels=(tk / best.graph_us) if tk else None)
                summary.append(line)
                print(f"BEST H={h} M={m} {prec}: {best.name} {best.graph_us:.2f} us = {100 * best.floor_frac:.1f}% "
                      f"of floor ({floor_us:.2f} us)" + (f"; tilekernels {tk:.2f} us ({tk / best.graph_us:.2f}x)"
                                                         if tk else ""), flush=True)
    for s in summary:
        if s["precision"] == "fp32" and s["m"] >= 2048 and s["floor_frac"] < FLOOR_TARGET:
            print(f"BELOW TARGET: H={s['hidden']} M={s['m']} {100 * s['floor_frac']:.1f}% < "
                  f"{100 * FLOOR_TARGET:.0f}% of floor")
        if s["m"] == 8192 and s["speedup_vs_tilekernels"] and s["speedup_vs_tilekernels"] < TILEKERNELS_SPEEDUP:
            print(f"BELOW TARGET: H={s['hidden']} M=8192 {s['precision']} only "
                  f"{s['speedup_vs_tilekernels']:.2f}x TileKernels")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=gpu, copy_bandwidth=bandwidth, summary=summary,
                           results=[asdict(r) for r in results]), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
