"""Turn a `mhc-cute bench --json` result into a shipped tuning table (mhc_cute/tuned/<gpu>.json): per H and M
bucket, the fastest kernel backend measured (CUDA-graph replay), with its default tactic.

    python bench/ship_table.py bench.json --sm-count 132 > mhc_cute/tuned/nvidia_h200.json
"""

import argparse
import json
import sys

from mhc_cute import __version__
from mhc_cute.autotune import CACHE_FORMAT, TuneKey, bucket_of

KERNEL_BACKENDS = ("half_fma", "all_fma", "triton", "half_mma", "all_mma")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("bench_json", nargs="+", help="later files override earlier ones for the same (H, M, backend)")
    ap.add_argument("--sm-count", type=int, required=True)
    args = ap.parse_args()
    best, gpu, meta = {}, None, None
    times = {}
    for path in args.bench_json:
        data = json.load(open(path))
        gpu, meta = data["gpu"], data["meta"]
        for r in data["results"]:
            if r["name"] in KERNEL_BACKENDS and r["graph_us"]:
                times[(r["hidden"], r["m"], r["name"])] = r["graph_us"]
    for (h, m, name), us in times.items():
        cur = best.get((h, m))
        if cur is None or us < cur[1]:
            best[(h, m)] = (name, us)
    tables = {}
    for (h, m), (name, us) in sorted(best.items()):
        key = TuneKey(gpu, args.sm_count, h, meta["precision"], meta["norm"], __version__).as_str()
        tables.setdefault(key, {})[str(bucket_of(m))] = {"backend": name, "tactic": None, "us": round(us, 2)}
    json.dump({"format": CACHE_FORMAT, "source": args.bench_json, "tables": tables}, sys.stdout, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
