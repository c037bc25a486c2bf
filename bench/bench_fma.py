"""Quick device benchmark of the FMA paths (E ``half_fma``, F ``all_fma``): a small tactic sweep per M, the
default tactic, host overhead per eager call, and the peers, with the method of ``mhc_cute.benchmark``
(CUDA-graph replay over rotating input and weight sets, so that nothing sits in L2 between calls).

    python bench/bench_fma.py --hidden 7168 4096 --m 1 4 16 32 64 128 256 512 --sweep --json fma.json

Compiles run first, in parallel worker processes that persist the kernels (``$MHC_CUTE_KERNEL_CACHE``, a
temporary directory when unset); the timing process then loads them.
"""

import argparse
import json
import os
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from mhc_cute import benchmark as mb  # noqa: E402
from mhc_cute.accuracy import failure_of, problem_of  # noqa: E402
from mhc_cute import tactics as tac  # noqa: E402
from mhc_cute.kernels import KERNEL_CACHE_ENV  # noqa: E402

PATHS = ("all_fma", "half_fma")
TARGET_US = 8.0  # at most this per call for M <= 32 at H = 7168 (issue 4)


def sweep_tactics(path: str, m: int, hidden: int, sm_count: int, limit: int = 6) -> list:
    """The default plus neighbours for M tokens: wider post-map bursts, pipelined weights, 16-token tiles,
    more or fewer splits, the other big-fuse shape."""
    default = tac.default_fma_tactic(path, m, hidden, sm_count)
    cands = [default]
    for burst in (2, 4):
        cands += [replace(default, burst=burst), replace(default, burst=burst, stages=2)]
    if m > 8:
        cands += [replace(default, tokens_per_cta=16, tile_n=3, burst=b) for b in (1, 4)]
    cands += [replace(default, split_k=tac.largest_split(hidden, default.chunk_h, k))
              for k in (default.split_k * 2, default.split_k // 2) if k >= 1]
    cands += [replace(default, fuse=f) for f in tac.FUSE_SHAPES if f != default.fuse]  # valid on path E only
    out = []
    for t in cands:
        if t.invalid_reason(hidden) is None and t not in out:
            out.append(t)
    return out[:limit]


def direct_host_us(path: str, tactic, inputs: dict) -> float:
    """Host µs per call of the backend's prepared launch itself (on a ready ``Problem``), no API layer."""
    from mhc_cute import backends

    problem = problem_of(inputs)
    out = problem.empty_outputs()
    launch = backends.BACKENDS[path].load()(problem, tactic, out)
    return mb.host_us_per_call(lambda _: launch(problem.inputs, out), inputs)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, nargs="+", default=[7168, 4096])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 4, 16, 32, 64, 128, 256, 512])
    ap.add_argument("--sweep", action="store_true", help="time a small tactic sweep, not only the default")
    ap.add_argument("--tactics", nargs="*", default=[], metavar="NAME",
                    help="also time these tactics (names as printed) at every (H, M) where they are valid")
    ap.add_argument("--norm", action="store_true", help="with the fused RMSNorm (norm_weight)")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--check", action="store_true", help="check every timed tactic against the contract once")
    ap.add_argument("--contexts", action="store_true",
                    help="also time what each tactic adds after a non-PDL kernel and after a cuBLAS GEMM "
                         "(benchmark.context_predecessors; the table's after-kernel and after-gemm columns)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    os.environ.setdefault(KERNEL_CACHE_ENV, tempfile.mkdtemp(prefix="mhc_kernels_"))
    from mhc_cute.kernels import fma

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    gpu = torch.cuda.get_device_name(dev)
    norm = "torch.bfloat16" if args.norm else None
    plan = {(h, m, p): (sweep_tactics(p, m, h, sms) if args.sweep else [tac.default_fma_tactic(p, m, h, sms)])
            for h in args.hidden for m in args.m for p in PATHS}
    for name in args.tactics:
        t = tac.parse_tactic(name)
        for (h, m, p), ts in plan.items():
            if t.path == p and t not in ts and t.invalid_reason(h) is None:
                ts.append(t)
    specs = [(t.name, h, norm) for (h, m, p), ts in plan.items() for t in ts]
    fma.precompile(specs)
    print(f"compiled {len(set(specs))} variants", flush=True)

    bandwidth = mb.measure_copy_bandwidth(dev)
    peers = {} if args.no_peers else mb.peer_calls(args.norm)
    results, rows = [], []
    for h in args.hidden:
        for m in args.m:
            sets = mb.rotated_sets(m, h, dev, args.norm)
            contexts = mb.context_predecessors(sets) if args.contexts else None
            timed = []
            for p in PATHS:
                default = tac.default_fma_tactic(p, m, h, sms)
                for t in plan[(h, m, p)]:
                    r = mb.bench_one(t.name, mb.mhc_cute_call(p, tactic=t), m, h, dev, args.norm, bandwidth, sets,
                                     eager=(t == default), contexts=contexts)
                    timed.append((p, t, r))
                    if r.error:
                        print(f"H={h} M={m} {t.name}: {r.error}", flush=True)
                host = mb.host_us_per_call(mb.mhc_cute_call(p, tactic=default), sets[0])
                results.append(mb.Result(f"{p}:host", m, h, extra=dict(host_us=host, run_us=direct_host_us(
                    p, default, sets[0]))))
            peer_us = {}
            for name, call in peers.items():
                r = mb.bench_one(name, call, m, h, dev, args.norm, bandwidth, sets, eager=False)
                results.append(r)
                peer_us[name] = r.graph_us
            # checked after all the point's timing: a float64 check slows the timings after it (docs/experiments.md)
            best = {}
            for p, t, r in timed:
                why = failure_of(problem_of(sets[0]), p, t) if args.check else None
                if why:
                    print(f"H={h} M={m} {t.name}: WRONG: {why}", flush=True)
                r.extra["wrong"] = why
                results.append(r)
                if r.graph_us is not None and not why and (p not in best or r.graph_us < best[p].graph_us):
                    best[p] = r
            fastest = min(best.values(), key=lambda r: r.graph_us) if best else None
            beaten = [n for n, us in peer_us.items() if us is not None and fastest and us <= fastest.graph_us]
            rows.append((h, m, {p: (best[p].graph_us, best[p].name) for p in best}, peer_us, beaten))
            line = " ".join(f"{p}={best[p].graph_us:6.2f}us[{best[p].name.split(':', 1)[1]}]" for p in best)
            peer_line = " ".join(f"{n}={us:.2f}" if us else f"{n}=err" for n, us in peer_us.items())
            print(f"H={h:5d} M={m:5d} | {line} | {peer_line} | {'LOSES to ' + ','.join(beaten) if beaten else 'ok'}",
                  flush=True)
            del sets
            torch.cuda.empty_cache()

    print(mb.format_table([r for r in results if r.graph_us is not None], bandwidth, gpu))
    for h, m, best, _, _ in rows:
        if h == 7168 and m <= 32 and best:
            us = min(v[0] for v in best.values())
            print(f"target H=7168 M={m}: best {us:.2f} us {'<=' if us <= TARGET_US else '>'} {TARGET_US} us")
    hosts = [r for r in results if r.name.endswith(":host")]
    for r in hosts:
        print(f"host overhead H={r.hidden} M={r.m} {r.name}: {r.extra['host_us']:.1f} us per mhc_fused_hc call, "
              f"{r.extra['run_us']:.1f} us per run_* call")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=gpu, bandwidth=bandwidth, results=[asdict(r) for r in results]), f, indent=1)


if __name__ == "__main__":
    main()
