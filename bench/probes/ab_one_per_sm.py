"""The shipped table's small-M path-E rows against their one-CTA-per-SM forms (``FmaTactic.one_per_sm``, ``:o1``),
on the tuner's measures and rule, and the table with the rows that move.

Per row (H, norm, bucket M <= ``--max-m``) whose pick is a ``half_fma`` tactic, the candidates are the pick, its
``:o1`` form and from M = 16 the ``:o1`` forms of the warp-MMA shapes the tuner tries
(``autotune.candidate_tactics``: 16 or 32 tokens per CTA; 256 threads with 64-position chunks or 128 with 32 or 64),
each where its grid is one wave. Each candidate is timed back to
back and after the two kernels of ``benchmark.context_predecessors`` in ``--rounds`` rounds; its score is the
worst of the three medians (``autotune.worst_context``'s measure). The pick stays unless another candidate scores
``autotune.TUNE_MARGIN`` lower (``autotune.pick`` with the pick as the default); a new pick is checked against the
float64 contract first (a wrong one is dropped for the next).

    python bench/probes/ab_one_per_sm.py --table mhc_cute/tuned/nvidia_h200.json --out new.json --source "..."

Lines: ``ROW H norm M tactic graph_us after_kernel_us after_gemm_us score_us [pick|new]``.
"""

import argparse
import json
import statistics
from dataclasses import replace

import torch

from mhc_cute import accuracy, autotune, benchmark as mb, selector, tactics as tac


def candidates(pick: tac.FmaTactic, m: int, hidden: int, sm_count: int) -> list:
    """The pick, its ``:o1`` form and from M = 16 the tuner's ``:o1`` warp-MMA candidates with the pick's big fuse,
    each where its grid is one wave (``autotune.candidate_tactics`` gives ``:o1`` forms only there)."""
    tuned = autotune.candidate_tactics("half_fma", m, hidden, sm_count) if m >= 16 else []
    shapes = [pick, replace(pick, one_per_sm=True)]
    shapes += [t for t in tuned if t.warp_mma and t.one_per_sm and t.fuse == pick.fuse]
    ok = [t for t in shapes if t.invalid_reason(hidden) is None and (t == pick or tac.fits_one_wave(t, m, sm_count))]
    return list(dict.fromkeys(ok))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--table", required=True, help="a shipped table file (mhc_cute/tuned/<gpu>.json)")
    ap.add_argument("--max-m", type=int, default=64)
    ap.add_argument("--hidden", type=int, nargs="*", help="default: every H of the table")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", help="write the table with the moved rows here")
    ap.add_argument("--source", default="", help="appended to the table's source field")
    ap.add_argument("--precompile", action="store_true", help="only compile the candidates (on a CPU machine too)")
    ap.add_argument("--sm-count", type=int, default=132, help="with --precompile: the target GPU's SM count")
    args = ap.parse_args()
    table = json.load(open(args.table))
    sm_count = args.sm_count if args.precompile else torch.cuda.get_device_properties(0).multi_processor_count
    rows = []  # (table key, TuneKey, bucket, pick, candidates)
    for key, buckets in table["tables"].items():
        k = selector.TuneKey.parse(key)
        if k.sm_count != sm_count or (args.hidden and k.hidden not in args.hidden):
            continue
        for bucket, choice in buckets.items():
            b = int(bucket)
            if b <= args.max_m and choice["backend"] == "half_fma" and choice["tactic"]:
                pick = tac.parse_tactic(choice["tactic"])
                rows.append((key, k, b, pick, candidates(pick, b, k.hidden, sm_count)))
    if args.precompile:
        from mhc_cute.kernels import fma

        specs = [(t.name, k.hidden, mb.NORM_DTYPE if k.norm else None) for _, k, _, _, cands in rows for t in cands]
        print(f"compiled {len(fma.precompile(specs))} variants")
        return 0

    moved = 0
    for key, k, b, pick, cands in rows:
        sets = mb.rotated_sets(b, k.hidden, "cuda", k.norm)
        predecessors = mb.context_predecessors(sets)
        times = {t: [] for t in cands}
        for _ in range(args.rounds):
            for t in cands:
                call = mb.mhc_cute_call("half_fma", tactic=t)
                times[t].append([mb.time_graph(call, sets)] +
                                [mb.time_after(call, sets, p).after_us for p in predecessors.values()])
        medians = {t: [statistics.median(r[i] for r in times[t]) for i in range(3)] for t in cands}
        timed = [(max(medians[t]), "half_fma", t, t == pick) for t in cands]
        problem = accuracy.problem_of(sets[0])
        while (choice := autotune.pick(timed)) is not None:
            if choice[2] == pick or (why := accuracy.failure_of(problem, "half_fma", choice[2])) is None:
                break
            print(f"WRONG H={k.hidden} norm={int(k.norm)} M={b} {choice[2].name}: {why}", flush=True)
            timed.remove(choice)
        for t in cands:
            mark = "pick" if t == pick else ("new" if choice and t == choice[2] else "")
            g, ak, ag = medians[t]
            print(f"ROW {k.hidden} {int(k.norm)} {b} {t.name} {g:.2f} {ak:.2f} {ag:.2f} {max(medians[t]):.2f} {mark}",
                  flush=True)
        if choice and choice[2] != pick:
            table["tables"][key][str(b)] = {"backend": "half_fma", "tactic": choice[2].name, "us": choice[0]}
            moved += 1
        del sets
        torch.cuda.empty_cache()
    print(f"{moved} of {len(rows)} rows moved")
    if args.out:
        table["source"] += args.source
        with open(args.out, "w") as f:
            json.dump(table, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
