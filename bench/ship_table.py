"""Turn the cache file written by `mhc-cute tune` on a device into a shipped tuning table
(mhc_cute/tuned/<gpu>.json, used by ``backend="auto"`` when a user has not tuned), keeping only that GPU's
tables and noting where they came from.

    MHC_CUTE_CACHE_DIR=out mhc-cute tune ...   # on the GPU machine
    python bench/ship_table.py out/tuned.json --gpu "NVIDIA H200" --compute-capability 9.0 --source "..." \
        > mhc_cute/tuned/nvidia_h200.json

With ``--compute-capability`` the tables also stand in for other GPUs of that architecture and SM count that have
no table of their own (``mhc_cute.selector``).
"""

import argparse
import json
import sys

from mhc_cute.selector import CACHE_FORMAT, TuneKey


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("tuned_json", help="the tune cache file (format %d)" % CACHE_FORMAT)
    ap.add_argument("--gpu", required=True, help="the GPU name as torch reports it")
    ap.add_argument("--source", required=True, help="how and when the tables were measured")
    ap.add_argument("--compute-capability", help='the GPU\'s, "major.minor" (e.g. 9.0)')
    args = ap.parse_args()
    data = json.load(open(args.tuned_json))
    if data.get("format") != CACHE_FORMAT:
        print(f"{args.tuned_json}: not a tune cache of format {CACHE_FORMAT}", file=sys.stderr)
        return 2
    tables = {k: v for k, v in data["tables"].items() if TuneKey.parse(k).gpu == args.gpu}
    out = {"format": CACHE_FORMAT, "source": args.source, "tables": tables}
    if args.compute_capability:
        out["compute_capability"] = args.compute_capability
    json.dump(out, sys.stdout, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
