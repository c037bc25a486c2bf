"""Why does the delayed seam's small-M time step up after a process has timed two points (H100, H = 4096, M = 16,
with the norm: 5.2 -> 5.35 µs, the V4 seam steady; `docs/experiments.md`, 2026-12-07)? Times one point again and
again in one process, each repetition on fresh input sets (as ``ab_versions.py`` does) or on the same ones
(``--same-sets``), optionally after allocating a spacer that stays alive (``--spacer-mib``: shifts where later
tensors land) or after dropping the package's caches of prepared weights and plans (``--clear``). Each line names
the repetition, the time and where the first set's inputs and an eager call's ``layer_input`` landed (offset within a
2 MiB page), so that a step can be matched to addresses, to the caches, or to neither:

    python bench/probes/probe_place_in_process.py --op delayed seam --hidden 4096 --m 16 --norm --repeat 6
    python bench/probes/probe_place_in_process.py --op delayed --same-sets --repeat 6
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

PAGE = 2 << 20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--op", nargs="+", choices=["seam", "delayed"], default=["delayed", "seam"])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--m", type=int, default=16)
    ap.add_argument("--norm", action="store_true")
    ap.add_argument("--repeat", type=int, default=6)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--same-sets", action="store_true", help="time the same input sets every repetition")
    ap.add_argument("--spacer-mib", type=int, default=0, help="allocate and keep this much before each repetition")
    ap.add_argument("--clear", action="store_true", help="drop the prepared-weight and plan caches between repetitions")
    args = ap.parse_args()

    import torch

    from ab_versions import call_of, sets_of
    from mhc_cute import api, benchmark as mb, weights

    dev = torch.device("cuda")
    spacers = []
    kept = {op: sets_of(op, args.m, args.hidden, args.norm, dev) for op in args.op} if args.same_sets else {}
    for r in range(args.repeat):
        for op in args.op:
            if args.spacer_mib:
                spacers.append(torch.empty(args.spacer_mib << 20, dtype=torch.uint8, device=dev))
            if args.clear:  # the package's own caches (private: a probe may look inside)
                weights.clear()
                api._PLANS.clear()
                for recent in api._RECENT.values():
                    recent.entries.clear()
            sets = kept.get(op) or sets_of(op, args.m, args.hidden, args.norm, dev)
            call = call_of(op, {})
            us = mb.time_graph(call, sets, reps=args.reps)
            out = call(sets[0])
            where = " ".join(f"{k}@{sets[0][k].data_ptr() % PAGE:#x}" for k in ("residual_prev", "fn"))
            print(f"PLACE {op} H={args.hidden} M={args.m} norm={int(args.norm)} rep={r} sets={len(sets)} {us:.2f} "
                  f"{where} layer_input@{out.layer_input.data_ptr() % PAGE:#x}", flush=True)
            del out
            if not args.same_sets:
                del sets
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
