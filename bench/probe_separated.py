"""Two measures of a call that follows a kernel without PDL, side by side with the back-to-back graph time.

"sep" (``benchmark.time_graph_separated``): a graph of call + one-element torch kernel per set, minus a graph of
those kernels alone. "after" (``time_graph_after_separator`` here): a graph of kernel + call per set, from
kernel timestamps: each separator's end to the end of the call's last kernel. For a backend without PDL (Triton,
the torch peers) a lone call should take its back-to-back time, which checks each measure.

    python bench/probe_separated.py --hidden 7168 --m 1 8 16 32 --names auto triton
    python bench/probe_separated.py --m 17 32 --names auto half_fma:k224:t16:n6:w128:s1:b1:flat:mma

Lines: ``SEPV round name H M graph_us sep_us after_us``.
"""

import argparse
import json
import statistics
import tempfile
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from mhc_cute import benchmark as mb


def time_graph_after_separator(call: Callable[[dict], object], sets: list[dict], reps: int = 5) -> float:
    """Median µs from the end of a kernel that does not take part in PDL to the end of the call after it: a CUDA
    graph of ``benchmark.separator()`` then one call per set, replayed under ``torch.profiler`` (kernel timestamps
    from CUPTI)."""
    bump = mb.separator()

    def bump_then_call(s):
        bump(s)
        call(s)
    graph = mb.capture(bump_then_call, sets)
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        kernels = sorted((e for e in json.load(open(f.name))["traceEvents"] if e.get("cat") == "kernel"),
                         key=lambda e: e["ts"])
    per_call, rest = divmod(len(kernels), reps * len(sets))
    groups = [kernels[i:i + per_call] for i in range(0, len(kernels), per_call)]
    if rest or per_call < 2 or len({g[0]["name"] for g in groups}) != 1:
        raise RuntimeError(f"time_graph_after_separator: {len(kernels)} kernels in {reps} replays of {len(sets)} "
                           "calls do not split into (separator, call) groups")
    return statistics.median(max(e["ts"] + e["dur"] for e in g[1:]) - (g[0]["ts"] + g[0]["dur"]) for g in groups)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, nargs="+", default=[7168])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8, 16, 32])
    ap.add_argument("--names", nargs="+", default=["auto", "triton", "torch-compile"])
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    peers = mb.peer_calls(False)
    # a name with a colon is a tactic name (backend first): that tactic at every M
    calls = {n: peers[n] if n in peers else mb.mhc_cute_call(n.split(":")[0], tactic=n if ":" in n else None)
             for n in args.names}
    for r in range(args.rounds):
        for h in args.hidden:
            for m in args.m:
                sets = mb.rotated_sets(m, h, "cuda")
                separator_us = mb.time_graph(mb.separator(), sets)
                for name, call in calls.items():
                    graph = mb.time_graph(call, sets)
                    sep = mb.time_graph_separated(call, sets, separator_us)
                    after = time_graph_after_separator(call, sets)
                    print(f"SEPV r{r} {name} {h} {m} {graph:.2f} {sep:.2f} {after:.2f}", flush=True)
                del sets
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
