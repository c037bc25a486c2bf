"""Resource usage of the Triton backend's NVIDIA kernels, compiled on this machine for sm_90 (no GPU needed):
registers per thread, spill stack, shared memory, and the programs per SM those allow, for the Hopper table's
tactics (or ``ab_triton.py``'s candidate sets) and optionally a register cap (Triton's ``maxnreg``), for the main
kernel of each ``--form`` (the V4 seam, the delayed seam with carried gates, with the norm, the identity, ...).

    python bench/probes/triton_registers.py                      # every bucket of the sm90 table, H = 7168
    python bench/probes/triton_registers.py --maxnreg 168 128    # the same, capped
    python bench/probes/triton_registers.py --form delayed delayed-norm --sweep main occupancy wide

Registers bound how many programs share an SM, hence how many loads a streaming kernel has in flight.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # before importing the kernels
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import triton  # noqa: E402

from mhc_cute.triton import aot, configs  # noqa: E402

REGS_PER_SM, SMEM_PER_SM, MAX_WARPS_PER_SM = 65536, 228 * 1024, 64  # sm_90


def resource_usage(kernel) -> tuple[int, int]:
    """(registers per thread, stack bytes per thread) from the cubin's resource report."""
    exe = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([str(exe), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    regs, stack = re.search(r"REG:(\d+) STACK:(\d+)", usage).groups()
    return int(regs), int(stack)


def programs_per_sm(regs: int, smem: int, warps: int) -> int:
    by_regs = REGS_PER_SM // (max(regs, 1) * 32 * warps)
    by_smem = SMEM_PER_SM // (smem + 1024)  # 1 KB per block reserved by the system
    return min(by_regs, by_smem, MAX_WARPS_PER_SM // warps)


# the main kernel's flags per form (``aot.compile_main``'s ``form``)
FORMS = {
    "v4": {}, "v4-norm": dict(HAS_NORM=True), "no-post": dict(HAS_POST=False),
    "broadcast": dict(HAS_POST=False, BROADCAST=True), "delayed": dict(DELAYED=True),
    "delayed-norm": dict(DELAYED=True, HAS_NORM=True), "identity": dict(DELAYED=True, IDENTITY=True),
    "broadcast-identity": dict(HAS_POST=False, BROADCAST=True, DELAYED=True, IDENTITY=True),
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--maxnreg", type=int, nargs="*", default=[], help="also compile with these register caps")
    ap.add_argument("--form", nargs="+", default=["v4"], choices=sorted(FORMS))
    ap.add_argument("--sweep", nargs="*", default=[],
                    help="ab_triton.py's candidate sets (by name) instead of the table's tactics")
    args = ap.parse_args(argv)
    if args.sweep:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from ab_triton import SWEEPS

        rows = [(name, t) for name in args.sweep for t in SWEEPS[name]]
    else:
        rows = [("any" if max_m >= configs.BIG else max_m, t) for max_m, t in configs.table_for("sm90").buckets]
    print(f"{'form':>18} {'M <= / set':>12} {'block_m':>7} {'block_h':>7} {'warps':>5} {'stages':>6} {'maxnreg':>7} | "
          f"{'regs':>4} {'stack B':>7} {'smem B':>7} | programs/SM warps/SM")
    for form in args.form:
        for label, tactic in rows:
            t = configs.fit(tactic, args.hidden)
            for cap in [None, *args.maxnreg]:
                k = aot.compile_main(t, aot.TARGETS["sm90"], FORMS[form], **({"maxnreg": cap} if cap else {}))
                regs, stack = resource_usage(k)
                n = programs_per_sm(regs, k.metadata.shared, t.num_warps)
                print(f"{form:>18} {label:>12} {t.block_m:>7} {t.block_h:>7} {t.num_warps:>5} {t.num_stages:>6} "
                      f"{cap or '-':>7} | {regs:>4} {stack:>7} {k.metadata.shared:>7} | {n:>11} {n * t.num_warps:>8}",
                      flush=True)


if __name__ == "__main__":
    main()
