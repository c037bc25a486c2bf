"""Compile ahead, in parallel processes, the CuTe kernel variants that the default tactics reach for a grid of
M and H, into ``$MHC_CUTE_KERNEL_CACHE`` (object files that later processes load in about a millisecond).

A GPU is not needed: compile on a CPU machine, pack the folder, and unpack it on the GPU machine beside the
same checkout (the file names carry a digest of the kernel sources and the CuTe DSL version).

    MHC_CUTE_KERNEL_CACHE=.kcache python bench/precompile.py --m 1 17 1000 --hidden 4096 7168 --norm both

``--tune`` compiles the candidates ``mhc-cute tune`` times at those M and H instead of the default tactics (with
``--delayed``: those of ``mhc-cute tune --delayed``).

``--gpu-suite`` compiles every variant a GPU run of the tests and the bench reaches (``bench/gpu_run.sh``'s warm stage
runs it): the GPU tests' default tactics over their grid (fp32 and tf32) and their explicit tactics (the big-fuse
shapes, the warp-MMA tactics), the bench grid's defaults and the shipped tables' tactics, with and without the norm;
and the delayed seam's (``mhc_fused_hc_delayed``: tests/test_delayed.py's GPU grid and the bench grid, carried and
identity gates, with and without the norm, and every CuTe path's entry forms, as the shipped picks in them;
``--delayed`` compiles only those). The FMA broadcast specs name the seam's tactic (the worker compiles
``tactics.fma_broadcast_tactic`` of it, as the launch does). About 1000 FMA and 1100 MMA variants, half an hour on
two cores; packed, about 4.5 MB, for a GPU machine that should not spend its time compiling:

    MHC_CUTE_KERNEL_CACHE=/tmp/kc python bench/precompile.py --gpu-suite
    mkdir -p .kcarry && tar -C /tmp/kc -cJf .kcarry/kcache.tar.xz .   # gpu_run.sh unpacks it
"""

import argparse
import os
import sys
import time

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
HERE = os.path.dirname(os.path.abspath(__file__))


def split_specs(pairs, norms, precisions, seams=(None,), form="regular"):
    """(FMA specs, MMA specs) of (H, tactic) ``pairs``, each with every norm (and, for MMA, every precision) and
    seam (None: ``mhc_fused_hc``; "carried" / "identity": the delayed seam's gates), in seam ``form`` ("regular",
    "no_post" or "broadcast")."""
    from mhc_cute import tactics

    fma, mma = [], []
    for h, t in pairs:
        for norm in norms:
            for seam in seams:
                tail = (seam, form) if form != "regular" else () if seam is None else (seam,)
                if t.path in tactics.FMA_PATHS:
                    fma.append((t.name, h, norm, *tail))
                else:
                    mma += [(t.name, h, p, norm, *tail) for p in precisions]
    return list(dict.fromkeys(fma)), list(dict.fromkeys(mma))


def call_specs(backend, tactic, m, hidden, norm, precision, seam=None, form="regular", sm_count=132):
    """(FMA specs, MMA specs) of the kernel one seam call launches: ``tactic`` (a name), or None for ``backend``'s
    default at M on ``sm_count`` SMs, as the API resolves it; none for a backend that is not a CuTe path."""
    from mhc_cute import tactics

    if backend not in tactics.FMA_PATHS + tactics.MMA_PATHS:
        return [], []
    t = tactics.parse_tactic(tactic) if tactic else tactics.default_tactic(backend, m, hidden, sm_count)
    return split_specs([(hidden, t)], [norm], [precision], [seam], form)


def specs_for(backends, ms, hiddens, norms, precisions, sm_count, seams=(None,), form="regular"):
    """The default tactics of these backends at these M and H."""
    from mhc_cute import tactics

    pairs = [(h, tactics.default_tactic(b, m, h, sm_count)) for h in hiddens for m in ms for b in backends
             if b in tactics.FMA_PATHS + tactics.MMA_PATHS]
    return split_specs(pairs, norms, precisions, seams, form)


def delayed_gpu_suite_specs(sm_count):
    """(FMA specs, MMA specs) of the delayed seam's variants a GPU run reaches: tests/test_delayed.py's GPU
    grid (and its M = 4096 and 33-token cases), the offsets-past-2^31 test of tests/test_correctness.py and
    ``mhc-cute bench --delayed``'s grid at H = 4096, 5120, 7168."""
    sys.path[:0] = [os.path.join(HERE, "..", "tests")]
    from test_correctness import LARGE_FIRST_PAST, LARGE_H, LARGE_ROWS_PAST
    from test_delayed import GPU_HS, GPU_MS

    from mhc_cute import tactics
    from mhc_cute.benchmark import BENCH_MS

    ms = sorted(set(GPU_MS) | set(BENCH_MS) | {33, 4096})
    hiddens = sorted(set(GPU_HS) | {4096, 5120, 7168})
    paths = tactics.FMA_PATHS + tactics.MMA_PATHS
    fma, mma = specs_for(paths, ms, hiddens, [None, "bfloat16"], ["fp32"], sm_count, ("carried", "identity"))
    large = specs_for(paths, [m + LARGE_ROWS_PAST for m in LARGE_FIRST_PAST], [LARGE_H], [None, "bfloat16"], ["fp32"],
                      sm_count, ("carried",))
    fma, mma = fma + large[0], mma + large[1]
    # the entry forms (tests/test_delayed.py's variants): V4's and V4.1's with either gates
    no_post = specs_for(paths, ms, hiddens, [None, "bfloat16"], ["fp32"], sm_count, (None, "carried", "identity"),
                        "no_post")
    broadcast = specs_for(paths, ms, hiddens, [None, "bfloat16"], ["fp32"], sm_count, (None, "carried", "identity"),
                          "broadcast")
    return fma + no_post[0] + broadcast[0], mma + no_post[1] + broadcast[1]


def tune_specs(backends, ms, hiddens, norms, precisions, sm_count, seams=(None,)):
    """Every candidate ``mhc-cute tune`` times for these backends, M and H (``seams=("carried",)``: as
    ``mhc-cute tune --delayed`` times them)."""
    from mhc_cute import autotune

    pairs = autotune.candidate_kernels(autotune.candidate_groups(hiddens, ms, backends, sm_count))
    return split_specs(pairs, norms, precisions, seams)


def gpu_suite_specs(sm_count):
    """(FMA specs, MMA specs) of every variant a GPU run reaches (see the module docstring)."""
    sys.path[:0] = [os.path.join(HERE, "..", "tests"), HERE]
    import bench_mma
    from test_correctness import (GPU_HS, GPU_MS, LARGE_FIRST_PAST, LARGE_H, LARGE_ROWS_PAST, PAIR_TACTICS,
                                  warp_mma_tactics)

    from mhc_cute import selector, tactics
    from mhc_cute.benchmark import BENCH_MS

    ms = sorted(set(GPU_MS) | set(BENCH_MS))
    hiddens = sorted(set(GPU_HS) | {4096, 7168})
    fma, mma = specs_for(tactics.FMA_PATHS + tactics.MMA_PATHS, ms, hiddens, [None, "bfloat16"], ["fp32"], sm_count)
    large = specs_for(tactics.FMA_PATHS + tactics.MMA_PATHS, [m + LARGE_ROWS_PAST for m in LARGE_FIRST_PAST],
                      [LARGE_H], [None, "bfloat16"], ["fp32"], sm_count)  # the offsets-past-2^31 test
    fma, mma = fma + large[0], mma + large[1]
    mma += bench_mma.test_grid_specs(sm_count)
    named = [(selector.TuneKey.parse(key).hidden, c.tactic)  # the shipped tables' picks
             for key, rows in selector.load_shipped_tables().items() for c in rows.values() if c.tactic]
    named += [(h, n.format(shape)) for h, names in PAIR_TACTICS.items()  # the big-fuse shapes test
              for n in names for shape in tactics.FUSE_SHAPES]
    named += [(h, t.name) for h in GPU_HS for path in tactics.FMA_PATHS  # the warp-MMA test
              for t in warp_mma_tactics(path, h)]
    named_fma, named_mma = split_specs([(h, tactics.parse_tactic(n)) for h, n in named], [None, "bfloat16"], ["fp32"])
    # the shipped picks in the entry forms too: mhc_head's seam form and the entry seams take them under auto
    picks = [(selector.TuneKey.parse(key).hidden, tactics.parse_tactic(c.tactic))
             for key, rows in selector.load_shipped_tables().items() for c in rows.values() if c.tactic]
    no_post_fma, no_post_mma = split_specs(picks, [None, "bfloat16"], ["fp32"], form="no_post")
    broadcast_fma, broadcast_mma = split_specs(picks, [None, "bfloat16"], ["fp32"], form="broadcast")
    return (list(dict.fromkeys(fma + named_fma + no_post_fma + broadcast_fma)),
            list(dict.fromkeys(mma + named_mma + no_post_mma + broadcast_mma)))


def compile_jobs(jobs, workers: int) -> None:
    """``module.precompile(specs)`` for each (label, module, specs) of ``jobs``, timed."""
    for name, module, specs in jobs:
        if specs:
            t0 = time.perf_counter()
            module.precompile(specs, processes=max(1, min(workers, len(specs))))
            print(f"{name}: {len(specs)} variants in {time.perf_counter() - t0:.0f} s", flush=True)


def compile_seam_kernels(fma_specs, mma_specs, workers: int) -> None:
    """Compile the seam kernels of ``split_specs``'s two lists (the sanitizer's and the soak's precompile)."""
    from mhc_cute.kernels import fma, mma

    compile_jobs([("precompile: FMA", fma, fma_specs), ("precompile: MMA", mma, mma_specs)], workers)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu-suite", action="store_true",
                    help="every variant the GPU tests and the bench reach (no --m/--hidden)")
    ap.add_argument("--delayed", action="store_true",
                    help="the delayed seam's variants: alone, or with --m/--hidden those of the default tactics there")
    ap.add_argument("--tune", action="store_true", help="the tuner's candidates at --m/--hidden, not the defaults")
    ap.add_argument("--m", type=int, nargs="+")
    ap.add_argument("--hidden", type=int, nargs="+")
    ap.add_argument("--norm", choices=["off", "on", "both"], default="both")
    ap.add_argument("--precision", nargs="+", default=["fp32"])
    ap.add_argument("--backends", nargs="+", default=["half_fma", "all_fma", "half_mma", "all_mma"])
    ap.add_argument("--sm-count", type=int, default=132, help="the target GPU's SM count (H100/H200 SXM: 132)")
    ap.add_argument("--workers", type=int, default=os.cpu_count())
    args = ap.parse_args()
    if not os.environ.get("MHC_CUTE_KERNEL_CACHE"):
        print("set MHC_CUTE_KERNEL_CACHE to the folder to fill", file=sys.stderr)
        return 2
    if args.gpu_suite or (args.delayed and not (args.m or args.hidden)):
        fma_specs, mma_specs = delayed_gpu_suite_specs(args.sm_count)
        if not args.delayed:
            v4 = gpu_suite_specs(args.sm_count)
            fma_specs, mma_specs = v4[0] + fma_specs, v4[1] + mma_specs
    elif args.m and args.hidden:
        norms = {"off": [None], "on": ["bfloat16"], "both": [None, "bfloat16"]}[args.norm]
        if args.tune:  # mhc-cute tune --delayed times the carried gates only
            specs, seams = tune_specs, ("carried",) if args.delayed else (None,)
        else:
            specs, seams = specs_for, ("carried", "identity") if args.delayed else (None,)
        fma_specs, mma_specs = specs(args.backends, args.m, args.hidden, norms, args.precision, args.sm_count, seams)
    else:
        ap.error("give --gpu-suite, --delayed, or --m and --hidden")
    from mhc_cute.kernels import fma, mma

    jobs = [("FMA", fma, fma_specs), ("MMA", mma, mma_specs)]
    if args.gpu_suite:  # the standalone ops' kernels at every H of the GPU tests and the --model bench
        from mhc_cute.kernels import collapse, post

        from test_ops import GPU_HS as OP_HS
        op_hs = sorted(set(OP_HS) | {4096, 5120, 7168})
        jobs += [("mhc_post", post, op_hs), ("mhc_collapse", collapse,
                                             [(h, None) for h in op_hs] + [(h, n, prefetch) for h in op_hs
                                              for n in ("bfloat16", "float32") for prefetch in (True, False)])]
    compile_jobs(jobs, args.workers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
