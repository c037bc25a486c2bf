"""Merge `mhc-cute bench --json` files (a later file overrides an earlier one for the same H, M and name) into
the README's markdown tables and a PNG plot. Where the run timed `auto` in context (M <= benchmark.CONTEXT_MAX_M),
two columns give what a call adds after a one-element non-PDL kernel and after a cuBLAS GEMM ("auto after kernel",
"auto after GEMM"); files written before commit 35cd5a7 (2026-12-03) have instead "auto sep", the graph-difference
measure of then.

    python bench/merge_measured.py bench/measured/h200_bench_h7168_794fe68_2026-12-03.json \
        bench/measured/h200_bench_h4096_794fe68_2026-12-03.json --plot plot.png
"""

import argparse
import json
import sys

from mhc_cute.benchmark import CONTEXTS, Result, fastest, floor_bytes, plot

KERNELS = ("half_fma", "all_fma", "triton", "half_mma", "all_mma")
COLUMNS = (("auto", "auto"), ("half_fma", "E half_fma"), ("all_fma", "F all_fma"), ("triton", "triton"),
           ("half_mma", "B half_mma"), ("all_mma", "D all_mma"), ("tilekernels", "TileKernels"),
           ("torch-compile", "torch.compile"), ("torch-eager", "torch eager"))


def floor_frac(r: dict) -> float:
    """The floor's share of the call's time, with the present floor (files written before 2026-12-04 stored
    fractions of a floor that counted the weight as 96H bytes instead of 384H)."""
    if not r.get("copy_bandwidth"):
        return r["floor_frac"]
    return floor_bytes(r["m"], r["hidden"]) / r["copy_bandwidth"] * 1e6 / r["graph_us"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("json", nargs="+")
    ap.add_argument("--plot")
    args = ap.parse_args()
    merged, gpu = {}, None
    for path in args.json:
        data = json.load(open(path))
        gpu = data["gpu"]
        for r in data["results"]:
            if r["graph_us"]:
                merged[(r["hidden"], r["m"], r["name"])] = dict(r, copy_bandwidth=data.get("copy_bandwidth"))
    graph_us = {k: r["graph_us"] for k, r in merged.items()}
    if any(r.get("context_us") for r in merged.values()):
        extra = {label: lambda r, c=c: r.get("context_us", {}).get(c)
                 for label, c in zip(("auto after kernel", "auto after GEMM"), CONTEXTS)}
    else:  # a file of the older bench
        extra = {"auto sep": lambda r: r.get("sep_us")}
    for h in sorted({k[0] for k in merged}, reverse=True):
        print(f"\n**H = {h}** (µs per call, CUDA-graph replay; the fastest mhc_cute backend in bold)\n")
        print("| M | " + " | ".join(c[1] for c in COLUMNS)
              + "".join(f" | {c}" for c in extra)
              + " | auto % of floor | auto / fastest | auto vs TileKernels | auto eager | auto host (floor) |")
        print("|---:|" + "---:|" * (len(COLUMNS) + len(extra) + 5))
        for m in sorted({k[1] for k in merged if k[0] == h}):
            row = {name: merged.get((h, m, name)) for name, _ in COLUMNS}
            best = fastest(graph_us, h, m, KERNELS)
            cells = ["—" if r is None else (f"**{r['graph_us']:.1f}**" if n == best else f"{r['graph_us']:.1f}")
                     for n, r in row.items()]
            auto, tk = row["auto"], row["tilekernels"]
            floor = f"{100 * floor_frac(auto):.0f}%" if auto else "—"
            speedup = f"{tk['graph_us'] / auto['graph_us']:.2f}x" if auto and tk else "—"
            vs_best = f"{auto['graph_us'] / row[best]['graph_us']:.3f}" if auto else "—"
            eager = f"{auto['eager_us']:.0f}" if auto and auto.get("eager_us") else "—"
            # host µs per eager call of auto and its floor (benchmark.host_times), where the run measured them
            host = (f"{auto['host']['auto_us']:.1f} ({auto['host']['floor_us']:.1f})" if auto and auto.get("host")
                    else "—")
            extras = "".join(f" | {v:.1f}" if auto and (v := get(auto)) else " | —" for get in extra.values())
            print(f"| {m} | " + " | ".join(cells) + f"{extras} | {floor} | {vs_best} | {speedup} | {eager} | {host} |")
    if args.plot:
        plot([Result(r["name"], r["m"], r["hidden"], r["graph_us"]) for r in merged.values()], args.plot, gpu)
    return 0


if __name__ == "__main__":
    sys.exit(main())
