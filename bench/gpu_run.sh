#!/usr/bin/env bash
# One batched GPU run (from the repository root on the GPU machine):
# unpack kernels precompiled on a CPU machine (`bench/precompile.py --gpu-suite`, packed as .kcarry/*.tar.xz),
# compile what is missing in parallel (the same --gpu-suite set, then Triton's test and bench configurations), run
# the GPU tests listed in $TESTS (pytest node ids or files, one per line; default: every gpu test) in 8 xdist workers
# ($PYTEST_ARGS; at most three large-M tests at once, tests/conftest.py), then `mhc-cute bench`.
# Everything is logged under $OUT. Each stage has its own time limit (WARM_S, TEST_S, BENCH_S seconds; 0 skips the
# stage) so that one slow stage cannot eat the rest. Off unless given a time: PROBE_S (the collapse hang probe),
# SAN_S (the sanitizer sweep, 4 tools x 3 shards at once; SAN_BACKENDS: only these backends), SOAK_S (the soak; with
# SOAK_BG=1 it runs on past this script, and a later run's SOAK_WAIT_S collects it).
#
# Where a command's time is limited, split the stages over runs (docs/developer.md): the tests with TESTS_REST=1
# take up the tests a previous run did not reach:
#   BENCH_S=0 TEST_S=560 ...   then   WARM_S=0 TESTS_REST=1 BENCH_S=0 ...   then   WARM_S=0 TEST_S=0 BENCH_S=570 ...
set -u
OUT=${OUT:-/tmp/mhc-out}
mkdir -p "$OUT"
export MHC_CUTE_KERNEL_CACHE=/tmp/mhc-kcache
mkdir -p "$MHC_CUTE_KERNEL_CACHE"
for f in .kcarry/*.tar.xz; do [ -f "$f" ] && tar -C "$MHC_CUTE_KERNEL_CACHE" -xJf "$f"; done  # one or several parts
echo "kernels in cache: $(ls "$MHC_CUTE_KERNEL_CACHE" | wc -l)"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader | tee "$OUT/gpu.txt"
t0=$(date +%s)

[ "${WARM_S:-300}" = 0 ] || {
timeout "${WARM_S:-300}" python bench/precompile.py --gpu-suite --workers 16 2>&1 | grep -v -i warn | tail -2
timeout 120 python bench/sanitize.py --precompile-only --workers 16 2>&1 | grep -v -i warn | tail -2  # the sweep's
timeout 90 python - <<'EOF_PY' 2>&1 | tail -1
import sys
sys.path.insert(0, "bench")
import bench_triton
jobs = [(m, h, norm, None) for m in (1, 2, 3, 16, 17, 64, 100, 256, 1000, 4096, 8192)
        for h in (512, 4096, 5120, 7168) for norm in (False, True)]
jobs += [(m, h, False, None) for m in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
         for h in (4096, 7168)]
bench_triton.precompile(jobs, 16)
EOF_PY
}
echo "warm $(( $(date +%s) - t0 )) s"

[ "${PROBE_S:-0}" = 0 ] || {  # where the CuTe collapse with the norm hangs (bench/probes/probe_collapse_hang.py)
timeout "${PROBE_S}" python bench/probes/probe_collapse_hang.py --timeout 20 > "$OUT/probe_collapse.txt" 2>&1
echo "probe rc=$? $(( $(date +%s) - t0 )) s"; cat "$OUT/probe_collapse.txt" | grep -v "^    " | head -12
}

[ "${SAN_S:-0}" = 0 ] || {  # every tool in 3 shards at once, one JSON per process, then one merged table
mkdir -p /tmp/san; pids=
for tool in check memcheck synccheck racecheck initcheck; do for sh in 1 2 3; do
  # "check": the unsanitized pass in processes of its own (in a tool's shard it ate that tool's budget on a loaded GPU)
  if [ $tool = check ]; then sel=(--tools ""); else sel=(--tools $tool --no-check); fi
  [ -n "${SAN_BACKENDS:-}" ] && sel+=(--backends "$SAN_BACKENDS")
  python bench/sanitize.py "${sel[@]}" --shard $sh/3 --no-precompile --budget $(( SAN_S - 40 )) \
    --case-timeout 150 --timeout $(( SAN_S - 40 )) --json /tmp/san/${tool}_$sh.json > /tmp/san/${tool}_$sh.txt 2>&1 &
  pids="$pids $!"
done; done
wait $pids
python bench/sanitize.py --merge /tmp/san/*.json > "$OUT/sanitize.txt" 2>&1
echo "sanitize rc=$? $(( $(date +%s) - t0 )) s"; tail -3 "$OUT/sanitize.txt"
tar -C /tmp -czf "$OUT/sanitize_logs.tgz" san
}

[ "${SOAK_S:-0}" = 0 ] || {  # the soak; SOAK_BG=1: in a process session of its own, which outlives this call
soak="python bench/soak.py --seconds $SOAK_S --seed ${SOAK_SEED:-21} --progress 60"
if [ "${SOAK_BG:-0}" = 1 ]; then
  rm -f /tmp/soak.txt; setsid nohup bash -c "$soak > /tmp/soak.txt 2>&1; echo soak-rc=\$? >> /tmp/soak.txt" \
    < /dev/null > /dev/null 2>&1 &
  echo "soak started in the background ($SOAK_S s): collect it with SOAK_WAIT_S in a later call on this machine"
else
  $soak > "$OUT/soak.txt" 2>&1; echo "soak rc=$? $(( $(date +%s) - t0 )) s"; grep -E "^FAIL|^soak:" "$OUT/soak.txt" | tail -4
fi
}

[ "${SOAK_WAIT_S:-0}" = 0 ] || {  # a background soak's end (at most SOAK_WAIT_S seconds), its log to $OUT
for _ in $(seq "$SOAK_WAIT_S"); do grep -q "^soak-rc=" /tmp/soak.txt 2>/dev/null && break; sleep 1; done
cp /tmp/soak.txt "$OUT/soak.txt"; grep -E "^FAIL|^soak:|^soak-rc" "$OUT/soak.txt" | tail -4
}

[ "${TEST_S:-240}" = 0 ] || {
python -m pytest --collect-only -q -p no:cacheprovider -m gpu tests 2>/dev/null | grep "::" > /tmp/gpu_ids
sel=(-m gpu tests); [ -n "${TESTS:-}" ] && mapfile -t sel < "$TESTS"
if [ "${TESTS_REST:-0}" = 1 ]; then  # the GPU tests that no earlier call on this machine reached (their -v logs)
  logs=(/tmp/mhc-tests-*.log); [ -e "${logs[0]}" ] || logs=(/dev/null)
  python bench/gpu_tests_summary.py --ids /tmp/gpu_ids "${logs[@]}" --rest /tmp/gpu_rest > /dev/null
  mapfile -t sel < /tmp/gpu_rest; echo "tests not reached before: ${#sel[@]}"
fi
# -v: each test's outcome on its own line, which TESTS_REST=1 reads in the next call; a test past 300 s prints its
# stacks and ends its worker (pytest-timeout, on the GPU image): a hang becomes a named failure, the others go on
log=/tmp/mhc-tests-$(date +%s).log
export MHC_CUTE_FAILURES="$OUT/failures.txt"  # each failure's traceback as it happens (tests/conftest.py)
[ ${#sel[@]} -gt 0 ] && timeout "${TEST_S:-240}" python -m pytest -v -p no:cacheprovider --tb=line -rfE \
  ${PYTEST_ARGS:--n 8 --timeout 300 --timeout-method thread} "${sel[@]}" > "$log" 2>&1
echo "tests rc=$? $(( $(date +%s) - t0 )) s"; cp "$log" "$OUT/tests.log"
# every call's outcomes on this machine so far (the later outcome of a test wins), against every GPU test
python bench/gpu_tests_summary.py --ids /tmp/gpu_ids /tmp/mhc-tests-*.log > "$OUT/tests_summary.txt"
grep -E "^totals|^  (FAILED|ERROR) " "$OUT/tests_summary.txt" | head -40
}

[ "${BENCH_S:-300}" = 0 ] || {
timeout "${BENCH_S:-300}" python -m mhc_cute.cli bench ${BENCH_ARGS:-} --json "$OUT/bench.json" --plot "$OUT/bench.png" \
  > "$OUT/bench.txt" 2> "$OUT/bench.err"
echo "bench rc=$? $(( $(date +%s) - t0 )) s"
cat "$OUT/bench.txt"
grep -v TileLang "$OUT/bench.err" | tail -5
}
