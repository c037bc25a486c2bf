#!/usr/bin/env bash
# One batched GPU session (run from the repository root on the GPU machine, under .devbundle/gpu.sh):
# unpack kernels precompiled on a CPU machine (bench/precompile.py), warm Triton's cache in parallel, run the
# GPU tests listed in $TESTS (pytest node ids, one per line; default: every gpu test), then `mhc-cute bench`.
# Everything is logged under $OUT. Each stage has its own time limit so that one slow stage cannot eat the rest.
set -u
OUT=${OUT:-/tmp/mhc-out}
mkdir -p "$OUT"
export MHC_CUTE_KERNEL_CACHE=/tmp/mhc-kcache
mkdir -p "$MHC_CUTE_KERNEL_CACHE"
if [ -f .kcarry/kcache.tar.xz ]; then tar -C "$MHC_CUTE_KERNEL_CACHE" -xJf .kcarry/kcache.tar.xz; fi
echo "kernels in cache: $(ls "$MHC_CUTE_KERNEL_CACHE" | wc -l)"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader | tee "$OUT/gpu.txt"

[ "${WARM_S:-60}" = 0 ] || timeout "${WARM_S:-60}" python - <<'EOF' 2>&1 | tail -3
import sys
sys.path.insert(0, "bench")
import bench_triton
jobs = [(m, h, norm, None) for m in (1, 3, 17, 100, 1000, 4096) for h in (512, 4096, 7168) for norm in (False, True)]
jobs += [(m, h, False, None) for m in (1, 4, 16, 32, 64, 256, 1024, 2048, 4096, 8192) for h in (4096, 7168)]
bench_triton.precompile(jobs, 16)
EOF

if [ -n "${TESTS:-}" ]; then sel=$(cat "$TESTS"); else sel="-m gpu tests"; fi
timeout "${TEST_S:-200}" python -m pytest -q -p no:cacheprovider --tb=line -rf $sel > "$OUT/tests.log" 2>&1
echo "tests rc=$?"; grep -E "passed|failed" "$OUT/tests.log" | tail -1
grep -E "^FAILED|Error|assert" "$OUT/tests.log" | head -40

timeout "${BENCH_S:-200}" python -m mhc_cute.cli bench ${BENCH_ARGS:-} --json "$OUT/bench.json" --plot "$OUT/bench.png" \
  > "$OUT/bench.txt" 2> "$OUT/bench.err"
echo "bench rc=$?"
cat "$OUT/bench.txt"
grep -v TileLang "$OUT/bench.err" | tail -5
