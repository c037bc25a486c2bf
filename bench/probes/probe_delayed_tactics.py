"""Which tactic runs the delayed seam (``mhc_fused_hc_delayed``, carried gates) fastest? It takes the V4 seam's tuned
pick; its kernel 1 does more (the collapse into ``layer_input``) and its big fuse less (no collapse), so the V4
seam's best may not be its best. Times every candidate ``mhc-cute tune`` would try for the V4 seam on ``--paths``
(``autotune.candidate_tactics``; default paths E/F, for decode sizes), CUDA-graph replay with the inputs rotated out
of L2, beside ``auto``.

    python bench/probes/probe_delayed_tactics.py --hidden 7168 5120 --m 32
    python bench/probes/probe_delayed_tactics.py --paths half_mma all_mma --m 2048 8192
    python bench/probes/probe_delayed_tactics.py --precompile --hidden 7168 5120 --m 32   # on the CPU, with
                                                                                         # $MHC_CUTE_KERNEL_CACHE set

Lines: ``H M tactic graph_us``, best first per (H, M), then ``auto``.
"""

import argparse

SM_COUNT = 132


def candidates(paths, m: int, hidden: int) -> list:
    from mhc_cute import autotune

    out = []
    for path in paths:
        out += [t for t in autotune.candidate_tactics(path, m, hidden, SM_COUNT) if t.invalid_reason(hidden) is None]
    return list(dict.fromkeys(out))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, nargs="+", default=[7168, 5120])
    ap.add_argument("--m", type=int, nargs="+", default=[32])
    ap.add_argument("--paths", nargs="+", default=["half_fma", "all_fma"])
    ap.add_argument("--norm", action="store_true")
    ap.add_argument("--precompile", action="store_true", help="compile the candidates (no GPU) and exit")
    ap.add_argument("--top", type=int, default=8)
    args = ap.parse_args()
    norm = "bfloat16" if args.norm else None
    if args.precompile:
        from mhc_cute import tactics
        from mhc_cute.kernels import fma, mma

        tried = [(t, h) for h in args.hidden for m in args.m for t in candidates(args.paths, m, h)]
        fma_specs = [(t.name, h, norm, "carried") for t, h in tried if t.path in tactics.FMA_PATHS]
        mma_specs = [(t.name, h, "fp32", norm, "carried") for t, h in tried if t.path in tactics.MMA_PATHS]
        for module, specs in ((fma, fma_specs), (mma, mma_specs)):
            if specs:
                module.precompile(list(dict.fromkeys(specs)))
        print(f"{len(fma_specs) + len(mma_specs)} variants")
        return 0
    import torch

    from mhc_cute import benchmark as mb, mhc_fused_hc_delayed

    for h in args.hidden:
        for m in args.m:
            sets = mb.with_carried_gates(mb.rotated_sets(m, h, torch.device("cuda"), norm=args.norm))
            times = {}
            for t in candidates(args.paths, m, h) + ["auto"]:
                backend, tactic = ("auto", None) if t == "auto" else (t.path, t)
                times[getattr(t, "name", t)] = mb.time_graph(
                    lambda s: mhc_fused_hc_delayed(**s, backend=backend, tactic=tactic), sets)
            ranked = sorted((us, name) for name, us in times.items() if name != "auto")
            for us, name in ranked[:args.top]:
                print(f"{h:6d} {m:5d} {name:48s} {us:8.2f}", flush=True)
            print(f"{h:6d} {m:5d} {'auto':48s} {times['auto']:8.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
