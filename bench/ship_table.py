"""Turn the cache file written by `mhc-cute tune` on a device into a shipped tuning table
(mhc_cute/tuned/<gpu>.json, used by ``backend="auto"`` when a user has not tuned), keeping only that GPU's
tables and noting where they came from.

    MHC_CUTE_CACHE_DIR=out mhc-cute tune ...   # on the GPU machine
    python bench/ship_table.py out/tuned.json --gpu "NVIDIA H200" --compute-capability 9.0 --source "..." \
        > mhc_cute/tuned/nvidia_h200.json

With ``--compute-capability`` the tables also stand in for other GPUs of that architecture and SM count that have
no table of their own (``mhc_cute.selector``). With ``--into FILE`` the tuned rows are merged into an already
shipped file (a later tune of more buckets, another seam or the norm): a (key, bucket) row of the tune replaces the
file's, every other row is kept, the new ``--source`` is appended to the file's and its compute capability stays
unless given.
"""

import argparse
import json
import sys

from mhc_cute.selector import CACHE_FORMAT, TuneKey


def shipped(tuned: dict, gpu: str, source: str, compute_capability: str | None, into: dict | None = None) -> dict:
    """The shipped file's content: ``gpu``'s tables of the tune cache ``tuned``, merged into ``into`` when given."""
    into = into or {}
    tables = {k: dict(v) for k, v in into.get("tables", {}).items()}
    for key, rows in tuned["tables"].items():
        if TuneKey.parse(key).gpu == gpu:
            tables.setdefault(key, {}).update(rows)
    out = {"format": CACHE_FORMAT, "source": " ".join(s for s in (into.get("source"), source) if s),
           "tables": {k: dict(sorted(rows.items(), key=lambda kv: int(kv[0]))) for k, rows in sorted(tables.items())}}
    cc = compute_capability or into.get("compute_capability")
    if cc:
        out["compute_capability"] = cc
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("tuned_json", help="the tune cache file (format %d)" % CACHE_FORMAT)
    ap.add_argument("--gpu", required=True, help="the GPU name as torch reports it")
    ap.add_argument("--source", required=True, help="how and when the tables were measured")
    ap.add_argument("--compute-capability", help='the GPU\'s, "major.minor" (e.g. 9.0)')
    ap.add_argument("--into", help="a shipped file to merge the tuned rows into (its path; the result goes to stdout)")
    args = ap.parse_args()
    data = json.load(open(args.tuned_json))
    into = json.load(open(args.into)) if args.into else None
    for name, d in ((args.tuned_json, data), (args.into, into)):
        if d is not None and d.get("format") != CACHE_FORMAT:
            print(f"{name}: not a table file of format {CACHE_FORMAT}", file=sys.stderr)
            return 2
    json.dump(shipped(data, args.gpu, args.source, args.compute_capability, into), sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
