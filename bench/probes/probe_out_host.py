"""Host time of an eager call with fresh outputs against one writing the caller's buffers (``out=``), and the graph
time of both (the same kernels: it should not move).

    python bench/probes/probe_out_host.py --hidden 7168 --m 1 32 2048

Lines: ``OUTH H M backend host_fresh_us host_out_us graph_fresh_us graph_out_us``.
"""

import argparse

import torch

from mhc_cute import benchmark as mb
from mhc_cute.api import mhc_fused_hc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, nargs="+", default=[7168])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 32, 2048])
    ap.add_argument("--backends", nargs="+", default=["auto"])
    args = ap.parse_args()
    print(f"# {torch.cuda.get_device_name()}")
    for h in args.hidden:
        for m in args.m:
            sets = mb.rotated_sets(m, h, "cuda")
            for backend in args.backends:
                outs = [tuple(torch.empty_like(t) for t in mhc_fused_hc(**s, backend=backend)) for s in sets]
                by_set = {id(s): o for s, o in zip(sets, outs)}

                def fresh(s):
                    return mhc_fused_hc(**s, backend=backend)

                def into(s):
                    return mhc_fused_hc(**s, backend=backend, out=by_set[id(s)])
                row = [mb.host_us_per_call(f, sets[0]) for f in (fresh, into)]
                row += [mb.time_graph(f, sets) for f in (fresh, into)]
                print(f"OUTH {h} {m} {backend} " + " ".join(f"{v:.2f}" for v in row), flush=True)
            del sets
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
