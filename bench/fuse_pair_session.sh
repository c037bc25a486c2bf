#!/usr/bin/env bash
# One device call for branch wip-fuse-pair (the big-fuse shapes latp / bwp): the whole GPU suite on its kernels, then
# `mhc-cute tune` at M <= 512 over the FMA and tensor-core two-launch paths, whose candidates now include the pair
# shapes, with the shipped table's picks beside the new ones. From the repository root on the device machine:
#   bash .devbundle/gpu.sh bash bench/fuse_pair_session.sh        (logs and the tune cache under $OUT)
# Kernels compiled ahead on a CPU machine (MHC_CUTE_KERNEL_CACHE=/tmp/kc python bench/precompile.py --session,
# packed as .kcarry/kcache.tar.xz) are unpacked first when present.
set -u
out=${OUT:-/tmp/fuse_pair_out}
mkdir -p "$out"
if [ -f .kcarry/kcache.tar.xz ]; then
  export MHC_CUTE_KERNEL_CACHE=/tmp/mhc-kcache
  mkdir -p "$MHC_CUTE_KERNEL_CACHE" && tar -C "$MHC_CUTE_KERNEL_CACHE" -xJf .kcarry/kcache.tar.xz
fi
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee "$out/gpu.txt"
t0=$(date +%s)
timeout 260 python -m pytest -m gpu -q > "$out/tests.txt" 2>&1
echo "tests rc=$? $(( $(date +%s) - t0 )) s: $(tail -1 "$out/tests.txt")"
grep -E "^FAILED" "$out/tests.txt" | head
timeout 320 env MHC_CUTE_CACHE_DIR="$out" python -m mhc_cute.cli tune --hidden 4096 7168 \
  --m 1 2 4 8 16 32 64 128 256 512 --backends half_fma half_mma > "$out/tune.txt" 2>&1
echo "tune rc=$? $(( $(date +%s) - t0 )) s"
python - "$out/tuned.json" <<'PY'
import json, sys
from mhc_cute import autotune
new = json.load(open(sys.argv[1]))["tables"]
old = autotune.load_shipped_tables()
for key, rows in new.items():
    base = next((k for k in old if k.split("|")[2] == key.split("|")[2]), None)
    for m, c in sorted(rows.items(), key=lambda kv: int(kv[0])):
        was = old[base].get(int(m)) if base else None
        print(f"{key.split('|')[2]} M={m:>4} new {c['tactic']:40s} {c['us']:7.2f} us | shipped "
              f"{was.tactic if was else '-'}")
PY
