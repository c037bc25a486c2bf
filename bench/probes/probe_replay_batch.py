"""What timing each graph replay from an idle device adds to the benchmark's µs per call: the same graph of `auto`
calls (one per rotated set) timed with replays one at a time between CUDA events (the benchmark before
2026-12-06) and in batches of ``benchmark.REPLAY_BATCH`` (since), against the start-to-start time of consecutive
calls inside a replay (CUPTI, ``probe_large_m_timeline.timeline``); and the copy bandwidth both ways.

    python bench/probes/probe_replay_batch.py --hidden 7168 --m 1 32 2048 8192

Lines: ``RB seam H M sets one_us batch_us period_us`` (medians of alternating rounds) and ``COPY one batch`` (TB/s).
"""

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from mhc_cute import benchmark as mb  # noqa: E402
from probe_large_m_timeline import timeline  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, nargs="+", default=[7168])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 32, 2048, 8192])
    ap.add_argument("--seams", nargs="+", default=["delayed", "v4"], choices=["delayed", "v4"])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev).random_(0, 255)
    dst = torch.empty_like(src)
    copy = {}
    for batch in (1, mb.REPLAY_BATCH) * args.rounds:
        us = statistics.median(mb.launch_us(lambda: dst.copy_(src), 20, batch))
        copy.setdefault(batch, []).append(2 * src.numel() / (us * 1e-6) / 1e12)
    print(f"# {torch.cuda.get_device_name(dev)}")
    print("COPY " + " ".join(f"batch {b}: {statistics.median(v):.3f} TB/s" for b, v in copy.items()), flush=True)
    del src, dst
    with torch.no_grad():
        for h in args.hidden:
            for seam in args.seams:
                for m in args.m:
                    sets = mb.rotated_sets(m, h, dev)
                    if seam == "delayed":
                        sets = mb.with_carried_gates(sets)
                    call = mb.mhc_cute_call("auto", delayed=seam == "delayed")
                    graph = mb.capture(call, sets)
                    times = {}
                    for batch in (1, mb.REPLAY_BATCH) * args.rounds:
                        us = statistics.median(mb.launch_us(graph.replay, 20, batch)) / len(sets)
                        times.setdefault(batch, []).append(us)
                    try:
                        period = timeline(call, sets)[2]
                    except RuntimeError:  # one kernel a call (paths D/F): no kernel 1 to find
                        period = float("nan")
                    one, batched = (statistics.median(times[b]) for b in (1, mb.REPLAY_BATCH))
                    print(f"RB {seam:<7} H={h} M={m:<6} sets={len(sets):<3} {one:9.2f} {batched:9.2f} {period:9.2f}",
                          flush=True)
                    del sets, graph


if __name__ == "__main__":
    main()
