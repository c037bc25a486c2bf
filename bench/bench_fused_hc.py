"""Side-by-side benchmark of mhc_fused_hc (auto, every backend) and its peers; same as `mhc-cute bench`.

    python bench/bench_fused_hc.py --hidden 7168 --m 1 8 64 512 4096 --json out.json --plot out.png
"""

import sys

from mhc_cute.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
