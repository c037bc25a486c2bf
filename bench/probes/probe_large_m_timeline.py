"""Where a large-M call's time goes, kernel by kernel: the CUPTI records of `auto`'s calls replayed back to back
(CUDA graph over rotated sets, as the benchmark times them), split into kernel 1 (the projection and the pass over
the tokens), the big fuse, and the time between consecutive calls' kernel 1 that neither covers. Kernel 1's
duration against the bytes it moves (the whole floor but the big fuse's partials and gates) says how fast the pass
itself streams; the fit of those durations over M separates its per-token rate from its fixed cost.

    python bench/probes/probe_large_m_timeline.py --hidden 7168 5120 --m 1024 2048 4096 8192 16384

Lines: ``TL seam H M norm graph_us k1_us fuse_us k1_to_k1_us gap_us k1%copy``: the graph's µs per call, kernel 1's and
the big fuse's median durations, the median start-to-start time of consecutive kernel 1s, the median time from a
kernel 1's end to its big fuse's start (negative: launched early, PDL), and the copy rate over kernel 1's bytes as a
fraction of the copy bandwidth measured first. ``FIT`` lines: kernel 1's duration over M by least squares.
"""

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from mhc_cute import benchmark as mb  # noqa: E402


def timeline(call, sets, reps: int = 3) -> tuple[float, float, float, float]:
    """Medians (µs) of kernel 1's duration, the big fuse's, kernel 1's start-to-start period, kernel 1's end to the
    big fuse's start."""
    groups = mb.kernel_records(call, sets, reps)
    ours = [i for i, e in enumerate(groups[0]) if not e["name"].startswith("void at::")]  # not torch's fills
    if len(ours) != 2:
        raise RuntimeError(f"expected kernel 1 and the big fuse, got {[e['name'][:60] for e in groups[0]]}")
    k1 = [g[ours[0]] for g in groups]
    fuse = [g[ours[1]] for g in groups]
    period = [b["ts"] - a["ts"] for a, b in zip(k1, k1[1:])]
    return (statistics.median(e["dur"] for e in k1), statistics.median(e["dur"] for e in fuse),
            statistics.median(period), statistics.median(f["ts"] - k["ts"] - k["dur"] for k, f in zip(k1, fuse)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, nargs="+", default=[7168, 5120])
    ap.add_argument("--m", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--seams", nargs="+", default=["delayed", "v4"], choices=["delayed", "v4"])
    ap.add_argument("--norm", nargs="+", type=int, default=[0, 1], choices=[0, 1])
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    bw = mb.measure_copy_bandwidth(dev)
    print(f"# {torch.cuda.get_device_name(dev)}, copy bandwidth {bw / 1e12:.2f} TB/s")
    with torch.no_grad():
        for h in args.hidden:
            for seam in args.seams:
                for norm in args.norm:
                    fit = []
                    floor = mb.delayed_floor_bytes if seam == "delayed" else mb.floor_bytes
                    for m in args.m:
                        sets = mb.rotated_sets(m, h, dev, norm=bool(norm))
                        if seam == "delayed":
                            sets = mb.with_carried_gates(sets)
                        call = mb.mhc_cute_call("auto", delayed=seam == "delayed")
                        try:
                            graph_us = mb.time_graph(call, sets)
                            k1, fuse, period, gap = timeline(call, sets)
                        except RuntimeError as e:
                            print(f"TL {seam:<7} H={h} M={m:<6} norm={norm} ERROR {str(e)[:160]}", flush=True)
                            continue
                        # kernel 1 moves all of the floor's bytes but the 192 a token of partials and gates
                        k1_bytes = floor(m, h)
                        print(f"TL {seam:<7} H={h} M={m:<6} norm={norm} {graph_us:9.1f} {k1:9.1f} {fuse:7.1f} "
                              f"{period:9.1f} {gap:6.1f} {100 * k1_bytes / (k1 * 1e-6) / bw:5.1f}%", flush=True)
                        fit.append((m, k1))
                        del sets
                    if len(fit) >= 2:
                        mean_m = statistics.fmean(m for m, _ in fit)
                        mean_t = statistics.fmean(t for _, t in fit)
                        slope = (sum((m - mean_m) * (t - mean_t) for m, t in fit)
                                 / sum((m - mean_m) ** 2 for m, _ in fit))
                        per_token = floor(2, h) - floor(1, h)
                        print(f"FIT {seam} H={h} norm={norm}: kernel 1 = {mean_t - slope * mean_m:.1f} us + "
                              f"{slope * 1000:.2f} us per 1000 tokens ({100 * per_token / (slope * 1e-6) / bw:.1f}% "
                              "of the copy bandwidth at the margin)", flush=True)


if __name__ == "__main__":
    main()
