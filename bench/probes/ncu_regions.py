"""Warp-state samples of one kernel per region of its SASS, from the source page of an `ncu` report.

On the device: ``ncu --set full --import-source no -k regex:NAME -c 1 -o rep python ...`` then
``ncu -i rep.ncu-rep --page source --csv --print-source sass | gzip > rep.source.csv.gz``. Here::

    python bench/probes/ncu_regions.py rep.source.csv.gz --marks     # landmarks: barriers, waits, MMAs, bulk copies
    python bench/probes/ncu_regions.py rep.source.csv.gz --top 12 0:208:setup 208:1380:postmap ...

A region is ``first:last:name``, SASS instruction indices (as ``--marks`` prints them) from ``first`` up to but not
including ``last``; per region: its share of all samples, the warp instructions it executed, and its main stall
reasons as shares of all samples. Then the ``--top`` instructions by samples with their main stall reasons.
"""

import argparse
import collections
import csv
import gzip
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
LANDMARKS = ("BAR", "SYNCS", "STAS", "EXIT", "UBLKCP", "WARPGROUP", "ERRBAR", "UCGABAR_ARV", "UCGABAR_WAIT")
RUNS = ("HMMA", "HGMMA", "LDG", "STG", "LDS", "STS")  # marked where a run of them starts


def read(path: str):
    """(stall reason columns, rows as dicts) of the source page."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        rows = list(csv.reader(f))
    header = rows[1]  # rows[0] names the kernel
    stalls = [h for h in header if h.startswith("stall_") and "(Not Issued)" not in h]
    return stalls, [dict(zip(header, r)) for r in rows[2:]]


def count(row: dict, column: str) -> int:
    return int(row.get(column) or 0)


def opcode(row: dict) -> str:
    words = row["Source"].split()
    word = words[1] if words and words[0].startswith("@") and len(words) > 1 else (words[0] if words else "")
    return word.split(".")[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", help="the source page as CSV (gzipped or not)")
    ap.add_argument("regions", nargs="*", help="first:last:name")
    ap.add_argument("--top", type=int, default=0, help="instructions with the most samples")
    ap.add_argument("--marks", action="store_true", help="list the landmark instructions that ran")
    args = ap.parse_intermixed_args()
    stalls, rows = read(args.source)
    total = sum(count(r, SAMPLES) for r in rows)
    print(f"instructions {len(rows)} samples {total}")
    if args.marks:
        previous = ""
        for i, r in enumerate(rows):
            op = opcode(r)
            if count(r, EXECUTED) and (op in LANDMARKS or (op in RUNS and op != previous)):
                print(f"{i:5d} executed {count(r, EXECUTED):9d} samples {count(r, SAMPLES):6d}  "
                      f"{r['Source'].strip()[:70]}")
            previous = op
    for region in args.regions:
        first, last, name = region.split(":")
        part = rows[int(first):int(last)]
        reasons = collections.Counter()
        for r in part:
            for s in stalls:
                reasons[s[len("stall_"):]] += count(r, s)
        samples = sum(count(r, SAMPLES) for r in part)
        print(f"{name:14s} [{first}:{last}] samples {samples} ({100 * samples / total:.1f}%) executed "
              f"{sum(count(r, EXECUTED) for r in part)}  "
              + " ".join(f"{k}={100 * v / total:.1f}%" for k, v in reasons.most_common(6)))
    for i in sorted(range(len(rows)), key=lambda i: -count(rows[i], SAMPLES))[:args.top]:
        r = rows[i]
        reasons = sorted(((count(r, s), s[len("stall_"):]) for s in stalls), key=lambda x: -x[0])
        print(f"{i:5d} {count(r, SAMPLES):6d} {r['Source'].strip()[:60]:60s} "
              + " ".join(f"{name}={n}" for n, name in reasons[:4] if n))
    return 0


if __name__ == "__main__":
    sys.exit(main())
