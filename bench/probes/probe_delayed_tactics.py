"""Which tactic runs the delayed seam (``mhc_fused_hc_delayed``, carried gates) fastest? It takes the V4 seam's tuned
pick; its kernel 1 does more (the collapse into ``layer_input``) and its big fuse less (no collapse), so the V4
seam's best may not be its best. Times every candidate ``mhc-cute tune`` would try for the V4 seam on ``--paths``
(``autotune.candidate_tactics``; default paths E/F, for decode sizes), CUDA-graph replay with the inputs rotated out
of L2, beside ``auto``.

``--streaming``: instead, paths E/F with the projection on warp MMA walking several chunks per CTA (``split_k`` a
few per token block, one or two stages, bursts of one or two chunks), shapes the tuner never tries (its warp-MMA
candidates take one chunk per CTA, made for decode sizes). The delayed seam's big fuse has no collapse to do, so at
prefill sizes paths E/F stream every byte once, from many small CTAs with per-thread loads (as ``mhc_post``, which
streams at the copy rate), where path B's kernel 1 streams through one TMA pipeline per SM. ``--check``: each candidate
is first checked once against the float64 contract at M = 1000 with its split (a failure is printed in place of its
time).

    python bench/probes/probe_delayed_tactics.py --hidden 7168 5120 --m 32
    python bench/probes/probe_delayed_tactics.py --paths half_mma all_mma --m 2048 8192
    python bench/probes/probe_delayed_tactics.py --m 2048 --tactics half_mma:k8:m128:s3:fbw half_mma:k8:m64:s2:fbw
    python bench/probes/probe_delayed_tactics.py --streaming --check --hidden 7168 --m 2048 8192
    python bench/probes/probe_delayed_tactics.py --m 2048 --precision fp32 tf32 --tactics half_mma:k4:m64:s4:fbw
    python bench/probes/probe_delayed_tactics.py --precompile [same selection]   # on the CPU, with
                                                                                 # $MHC_CUTE_KERNEL_CACHE set

Lines: ``H M tactic graph_us [% of floor] [check]``, best first per (H, M), then ``auto`` (and with ``--streaming`` the
V4 seam's ``auto``); the floor is the delayed seam's at the copy bandwidth measured first (``--streaming`` and
``--tactics``: the tactics named, each where valid, and the V4 seam's ``auto``).
"""

import argparse
from dataclasses import replace

SM_COUNT = 132
# (threads, tile_n) of the streaming candidates: chunks of 64, 32 and 64 positions
STREAMING_SHAPES = ((256, 6), (128, 6), (128, 12))
STREAMING_TOKENS = 32  # two 16-row MMA tiles per warp: half the weight loads per token of 16
CHECK_M = 1000  # tokens of --check's call: 31 full token blocks of 32 and a partial one


def streaming_candidates(paths, m: int, hidden: int) -> list:
    """Path E/F tactics with warp MMA walking several chunks: per shape, stages and burst, the split_k (a power of
    two) giving the grid closest to 2, 4 and 8 CTAs per SM."""
    from mhc_cute.tactics import FmaTactic

    blocks = -(-m // STREAMING_TOKENS)
    out = []
    for path in paths:
        for threads, tile_n in STREAMING_SHAPES:
            for stages in (1, 2):
                for burst in (1, 2):
                    base = FmaTactic(path, 1, STREAMING_TOKENS, tile_n, threads, stages, burst, "bw", warp_mma=True)
                    valid = [replace(base, split_k=1 << i) for i in range(8)]
                    valid = [t for t in valid if t.invalid_reason(hidden) is None]
                    for per_sm in (2, 4, 8):
                        if valid:
                            out.append(min(valid, key=lambda t: abs(blocks * t.split_k - per_sm * SM_COUNT)))
    return list(dict.fromkeys(out))


def candidates(paths, m: int, hidden: int, streaming: bool = False, names=None) -> list:
    if names:
        from mhc_cute import tactics

        return [t for t in map(tactics.parse_tactic, names) if t.invalid_reason(hidden) is None]
    if streaming:
        return streaming_candidates(paths, m, hidden)
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
    ap.add_argument("--streaming", action="store_true", help="the streaming candidates (module docstring)")
    ap.add_argument("--check", action="store_true", help="check each candidate once against the float64 contract")
    ap.add_argument("--norm", action="store_true")
    ap.add_argument("--tactics", nargs="+", metavar="NAME", help="time these tactics (those valid at each H) instead")
    ap.add_argument("--precompile", action="store_true", help="compile the candidates (no GPU) and exit")
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--precision", nargs="+", default=["fp32"], choices=["fp32", "tf32"],
                    help="time every tactic at each of these (tf32: the MMA paths' one-part weight)")
    args = ap.parse_args()
    norm = "bfloat16" if args.norm else None
    from mhc_cute import tactics

    if args.precompile:
        from mhc_cute.kernels import fma, mma

        tried = [(t, h) for h in args.hidden for m in args.m
                 for t in candidates(args.paths, m, h, args.streaming, args.tactics)]
        fma_specs = [(t.name, h, norm, "carried") for t, h in tried if t.path in tactics.FMA_PATHS]
        mma_specs = [(t.name, h, p, norm, "carried") for t, h in tried if t.path in tactics.MMA_PATHS
                     for p in args.precision]
        for module, specs in ((fma, fma_specs), (mma, mma_specs)):
            if specs:
                module.precompile(list(dict.fromkeys(specs)))
        print(f"{len(fma_specs) + len(mma_specs)} variants")
        return 0
    import torch

    from mhc_cute import accuracy, benchmark as mb, mhc_fused_hc_delayed

    dev = torch.device("cuda")
    bandwidth = mb.measure_copy_bandwidth(dev) if args.streaming or args.tactics else None
    if bandwidth:
        print(f"# copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    for h in args.hidden:
        # --check's call: CHECK_M tokens (a partial token block), made once per H (the float64 check is slow)
        check_set = mb.with_carried_gates(mb.make_sets(CHECK_M, h, 1, dev, args.norm))[0] if args.check else None
        for m in args.m:
            sets = mb.with_carried_gates(mb.rotated_sets(m, h, dev, norm=args.norm))
            times, checks = {}, {}
            # tf32 only where it changes the kernel (the MMA paths); the FMA paths run fp32 whatever is asked
            runs = [(t, p) for t in candidates(args.paths, m, h, args.streaming, args.tactics) for p in args.precision
                    if p == "fp32" or t.path in tactics.MMA_PATHS]
            for t, precision in runs + [("auto", "fp32")]:
                backend, tactic = ("auto", None) if t == "auto" else (t.path, t)
                name = getattr(t, "name", t) + ("" if precision == "fp32" else f" {precision}")
                if check_set is not None and tactic is not None and precision == "fp32":  # (the fp32 contract)
                    checks[name] = accuracy.failure_of(accuracy.problem_of(check_set), tactic.path, tactic) or "ok"
                    if checks[name] != "ok":
                        print(f"{h:6d} {m:5d} {name:48s} {'-':>8} {checks[name]}", flush=True)
                        continue
                times[name] = mb.time_graph(lambda s: mhc_fused_hc_delayed(**s, backend=backend, tactic=tactic,
                                                                           precision=precision), sets)
            if args.streaming or args.tactics:
                times["mhc_fused_hc auto"] = mb.time_graph(mb.v4_auto, sets)
            ranked = sorted((us, name) for name, us in times.items() if name not in ("auto", "mhc_fused_hc auto"))
            floor_us = mb.delayed_floor_bytes(m, h) / bandwidth * 1e6 if bandwidth else None

            def line(name, us):
                share = f" {100 * floor_us / us:5.1f}%" if floor_us else ""
                return f"{h:6d} {m:5d} {name:48s} {us:8.2f}{share} {checks.get(name, '')}".rstrip()
            for us, name in ranked[:args.top]:
                print(line(name, us), flush=True)
            for name in ("auto", "mhc_fused_hc auto"):
                if name in times:
                    print(line(name, times[name]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
