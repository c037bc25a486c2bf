"""Outcomes of GPU test runs split over several device calls: the ``pytest -v`` logs merged (the last outcome of a
test wins) against the collected GPU test ids, as totals, by file, by backend (the first backend name in the test's
parameters), the failures, and the tests no log reached, by test function. ``--rest FILE`` writes the ids not
reached, in the order of ``--ids``, for the next call's ``TESTS`` file.

    python -m pytest --collect-only -q -m gpu tests | grep :: > /tmp/gpu_ids     # on any machine
    python bench/gpu_tests_summary.py --ids /tmp/gpu_ids run1.log run2.log --rest /tmp/rest
"""

import argparse
import re
import sys
from collections import Counter

# "[gw3] [ 5%] PASSED tests/x.py::t[a]" (xdist) or "tests/x.py::t[a] PASSED" (one process)
_XDIST = re.compile(r"\] (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS) (tests/\S+)")
_PLAIN = re.compile(r"^(tests/\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)")
BACKENDS = ("half_fma", "all_fma", "half_mma", "all_mma", "triton", "torch", "cute", "seam", "auto")


def outcomes(lines) -> dict[str, str]:
    """{test id: its last outcome} of ``pytest -v`` output lines."""
    out = {}
    for line in lines:
        m = _XDIST.search(line)
        if m:
            out[m.group(2)] = m.group(1)
        elif m := _PLAIN.match(line):
            out[m.group(1)] = m.group(2)
    return out


def backend_of(test_id: str) -> str:
    params = test_id.partition("[")[2]
    return next((b for b in BACKENDS if re.search(rf"(^|-){b}(-|:|\]|$)", params)), "-")


def report(ids: list[str], seen: dict[str, str]) -> str:
    status = {i: seen.get(i, "NOT RUN") for i in ids}
    lines = ["totals: " + ", ".join(f"{k} {v}" for k, v in sorted(Counter(status.values()).items())), "", "by file:"]
    for (f, s), n in sorted(Counter((i.split("::")[0], s) for i, s in status.items()).items()):
        lines.append(f"  {f} {s} {n}")
    lines += ["", "by backend:"]
    for (b, s), n in sorted(Counter((backend_of(i), s) for i, s in status.items()).items()):
        lines.append(f"  {b} {s} {n}")
    lines += ["", "failed:"] + [f"  {s} {i}" for i, s in status.items() if s in ("FAILED", "ERROR")]
    lines += ["", "not reached, by test:"]
    lines += [f"  {n:6d} {t}" for t, n in Counter(i.partition("[")[0] for i, s in status.items()
                                                if s == "NOT RUN").most_common()]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("logs", nargs="+", help="pytest -v logs, oldest first")
    ap.add_argument("--ids", required=True, help="the collected test ids, one per line")
    ap.add_argument("--rest", help="write the ids no log reached here")
    args = ap.parse_args(argv)
    with open(args.ids) as f:
        ids = [line.strip() for line in f if "::" in line]
    seen = {}
    for path in args.logs:
        with open(path, errors="replace") as f:
            seen.update(outcomes(f))
    print(report(ids, seen))
    if args.rest:
        with open(args.rest, "w") as f:
            f.writelines(i + "\n" for i in ids if i not in seen)
    return 1 if any(seen.get(i) in ("FAILED", "ERROR") for i in ids) else 0


if __name__ == "__main__":
    sys.exit(main())
