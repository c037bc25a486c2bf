"""Before/after timing of two versions of the package in one device run: `backend="auto"` (the shipped table's
pick, so each version runs its own kernels with the same tactic names), or a point's own tactic, over a grid of
(H, M, norm), for whichever ``mhc_cute`` is first on the Python path. Run it alternately for the two trees, in
separate processes of one GPU run, and compare the medians line by line (machines differ by up to 9% for the
same kernel, so only numbers from one call compare).

    git archive HEAD mhc_cute | tar -x -C /tmp/old          # the version to compare against
    MHC_CUTE_KERNEL_CACHE=.kcache python bench/probes/ab_versions.py --precompile     # on a CPU machine, both trees
    MHC_CUTE_KERNEL_CACHE=.kcache PYTHONPATH=/tmp/old python bench/probes/ab_versions.py --precompile
    # on the GPU machine, from the repository root (with /tmp/old carried in the working tree):
    for r in 1 2; do PYTHONPATH=/tmp/old:$PYTHONPATH python bench/probes/ab_versions.py --tag old$r --check
                     python bench/probes/ab_versions.py --tag new$r; done

The script's directory comes first on ``sys.path`` (it holds no ``mhc_cute``), then ``PYTHONPATH``: that picks
the tree. ``--check`` runs each point once against the float64 contract (``ok`` or the first failure), after its
timing. ``HOST``
lines: host µs to issue one eager call (``benchmark.host_us_per_call``). ``--op`` times V4.1's delayed seam (carried
gates; ``auto`` on the delayed seam's own tables) or a standalone op (``mhc_post``, ``mhc_collapse`` with a bf16
norm weight) on ``auto`` instead of ``mhc_fused_hc``; a standalone op's tactic column names the V4 seam's pick.
"""

import argparse
import sys

GRIDS = {
    "small": [(7168, m, False) for m in (1, 2, 4, 8, 16, 32)] + [(4096, m, False) for m in (1, 4, 8, 16, 32)]
    + [(7168, 1, True), (7168, 8, True)],
    "wide": [(7168, m, False) for m in (1, 4, 16, 32, 64, 128, 256, 512, 2048, 8192)]
    + [(4096, m, False) for m in (1, 32, 128, 512, 2048)] + [(7168, m, True) for m in (1, 8, 32, 256)],
    "decode": [(h, m, norm) for norm in (False, True) for h in (7168, 4096) for m in (1, 4, 8, 16, 32, 256)],
    "mid": [(h, m, norm) for norm in (False, True) for h in (7168, 4096) for m in (64, 128)],
}


def picks_of(grid, delayed: bool = False, gpu: str = "NVIDIA H200"):
    """(H, M, norm, tactic, explicit) per point: a point's own tactic (explicit), else the one ``auto`` runs there on
    ``gpu`` (a GPU with tables of its own): the user's tuning cache, then the shipped tables, a table with the point's
    norm flag first (as ``selector.Selector.choose``); ``delayed``: the delayed seam's tables first, from their
    smallest bucket up."""
    from mhc_cute import tactics
    try:
        from mhc_cute import selector
    except ImportError:  # trees before 2026-12-04 kept the runtime table lookup in the tuner's module
        from mhc_cute import autotune as selector

    tables = selector.load_shipped_tables()
    tables.update(selector.load_user_tables())
    out = []
    for h, m, norm, *named in grid:
        if named:
            out.append((h, m, norm, tactics.parse_tactic(named[0]), True))
            continue
        bucket = selector.bucket_of(m)
        keys = [k for n in (norm, not norm) for k in tables
                if k.startswith(f"{gpu}|") and f"|H{h}|" in k and f"|norm{int(n)}|" in k]
        own = [k for k in keys if k.endswith("|delayed") and bucket >= min(tables[k])] if delayed else []
        key = (own + [k for k in keys if not k.endswith("|delayed")])[0]
        choice = selector.nearest(tables[key], bucket)
        out.append((h, m, norm, tactics.parse_tactic(choice.tactic), False))
    return out


def resolved(dev, h: int, m: int, norm: bool, delayed: bool):
    """The tactic ``auto`` runs at a point on this GPU, from the tree's own lookup (``selector.SELECTOR.resolve``;
    a backend's default where it names none)."""
    import torch

    from mhc_cute import selector, tactics

    backend, tactic = selector.SELECTOR.resolve(dev, m, h, "fp32", norm, "delayed" if delayed else "v4")
    return tactic or tactics.default_tactic(backend, m, h, torch.cuda.get_device_properties(dev).multi_processor_count)


def precompile(picks, op: str) -> None:
    from mhc_cute import autotune, benchmark as mb

    if op in ("mhc_post", "mhc_collapse"):
        from mhc_cute.kernels import collapse, post

        hiddens = sorted({h for h, *_ in picks})
        if op == "mhc_post":
            post.precompile(hiddens)
        else:
            collapse.precompile([(h, "bfloat16") for h in hiddens])
        return
    variants = (("carried", "regular"),) if op == "delayed" else ((None, "regular"),)
    for norm in (False, True):
        autotune.precompile_candidates([(h, t) for h, _, n, t, _ in picks if n == norm], "fp32",
                                       mb.NORM_DTYPE if norm else None, variants)


def call_of(op: str, kwargs: dict):
    """The timed call of ``op`` on one set of ``sets_of``."""
    from mhc_cute import api, ops

    if op in ("mhc_post", "mhc_collapse"):
        fn = getattr(ops, op)
        return lambda s: fn(**s["op"])
    fn = api.mhc_fused_hc_delayed if op == "delayed" else api.mhc_fused_hc
    return lambda s: fn(**s, **kwargs)


def check_of(op: str, s: dict, call, tactic) -> str | None:
    """None if one call on ``s`` meets the float64 contract (a seam: ``accuracy.failure_of`` on its backend and
    tactic; a standalone op: ``accuracy.check_op_output`` of ``call``'s output), else the first failure line."""
    from mhc_cute import accuracy

    if op in ("seam", "delayed"):
        return accuracy.failure_of(accuracy.problem_of(s), tactic.path, tactic)
    try:
        accuracy.check_op_output(op, call(s), s["op"])
    except AssertionError as e:
        return str(e).splitlines()[0][:200]
    return None


def sets_of(op: str, m: int, h: int, norm: bool, dev) -> list:
    from mhc_cute import benchmark as mb

    if op == "seam":
        return mb.rotated_sets(m, h, dev, norm)
    sets = mb.with_carried_gates(mb.rotated_sets(m, h, dev, norm or op == "mhc_collapse"))
    return mb.op_sets(op, sets) if op != "delayed" else sets


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--grid", choices=sorted(GRIDS), default="small")
    ap.add_argument("--points", nargs="+", metavar="H:M:NORM[:TACTIC]",
                    help="these points instead of a grid (e.g. 7168:32:0, or 7168:256:0:all_fma:... to time that "
                    "tactic instead of auto's pick)")
    ap.add_argument("--op", nargs="+", choices=["seam", "delayed", "mhc_post", "mhc_collapse"], default=["seam"],
                    help="what to time, in turn (default mhc_fused_hc)")
    ap.add_argument("--tag", default="run", help="label of this version in the output lines")
    ap.add_argument("--precompile", action="store_true", help="compile the grid's kernels (no GPU needed) and exit")
    ap.add_argument("--gpu", default="NVIDIA H200", help="with --precompile: whose shipped tables' picks to compile")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--interleave", action="store_true",
                    help="time the ops point by point (each point's ops in turn) instead of op by op: a delayed "
                    "seam's time can depend on how many points its process timed before (docs/experiments.md, "
                    "2026-12-07), so that both ops of a point are timed at nearly the same place in the process")
    ap.add_argument("--separated", action="store_true",
                    help="also SEP lines: the calls separated by a non-PDL kernel (benchmark.time_graph_separated)")
    args = ap.parse_args()
    grid = GRIDS[args.grid]
    if args.points:
        grid = [(int(h), int(m), n == "1", *([t] if t else [])) for h, m, n, t in
                (p.split(":", 3) + [""] * (3 - p.count(":")) for p in args.points)]
    if args.precompile:
        for op in args.op:
            precompile(picks_of(grid, op == "delayed", args.gpu), op)
        return 0

    import torch

    from mhc_cute import benchmark as mb, tactics

    dev = torch.device("cuda")
    order = ([(op, p) for p in grid for op in args.op] if args.interleave
             else [(op, p) for op in args.op for p in grid])
    for op, (h, m, norm, *named) in order:
        explicit = bool(named)
        # a standalone op's column names the V4 seam's pick, as before
        tactic = (tactics.parse_tactic(named[0]) if explicit else resolved(dev, h, m, norm, op == "delayed"))
        sets = sets_of(op, m, h, norm, dev)
        call = call_of(op, dict(backend=tactic.path, tactic=tactic) if explicit else {})
        us = mb.time_graph(call, sets, reps=args.reps)
        check = (check_of(op, sets[0], call, tactic) or "ok") if args.check else ""
        point = f"{args.tag} {op} H={h} M={m} norm={int(norm)} {tactic.name}"
        if args.separated:
            sep = mb.time_graph_separated(call, sets, mb.time_graph(mb.separator(), sets), reps=args.reps)
            print(f"SEP {point} {sep:.2f}", flush=True)
        host = mb.host_us_per_call(call, sets[0])
        print(f"AB {point} {us:.2f} {check}", flush=True)
        print(f"HOST {point} {host:.2f}", flush=True)
        del sets
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
