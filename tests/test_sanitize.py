"""bench/sanitize.py without a GPU: its help and case list, the parsing of compute-sanitizer's output, and the
parent's bookkeeping (attribution to cases, a new process after one dies) against a stand-in sanitizer."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import bench_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "sanitize.py"


@pytest.fixture(scope="module")
def sanitize():
    with bench_script("sanitize.py") as module:
        yield module


def test_help_needs_no_torch():
    """``--help`` runs where torch cannot even be imported (no GPU, nothing heavy at the module's top)."""
    code = ("import runpy, sys; sys.modules['torch'] = None; sys.argv = ['sanitize.py', '--help']; "
            f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "compute-sanitizer" in proc.stdout and "--shard" in proc.stdout


def test_list_reaches_every_kernel_shape(sanitize, capsys):
    from mhc_cute import tactics

    assert sanitize.main(["--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == f"{len(lines) - 1} cases"
    cases = sanitize.all_cases()
    names = {c.name for c in cases}
    assert len(names) == len(lines) - 1
    backends = sanitize.kernel_backends()
    assert {"triton", "half_fma", "all_fma", "half_mma", "all_mma"} <= set(backends)
    for b in backends:
        mine = [c for c in cases if c.backend == b]
        for m in sanitize.MS:  # each M and each H, with and without the norm
            assert {c.norm for c in mine if c.m == m and c.label == "default"} == {False, True}, (b, m)
        for h in sanitize.HS:
            assert {c.norm for c in mine if c.h == h and c.label == "default"} == {False, True}, (b, h)
        assert sum(c.graph for c in mine) == 1
        assert any(c.label == "max-split" for c in mine), b
    for path in ("half_fma", "half_mma"):  # every standalone big-fuse shape at every H
        for shape in tactics.FUSE_SHAPES:
            hs = {c.h for c in cases if c.backend == path and c.tactic and tactics.parse_tactic(c.tactic).fuse == shape}
            assert hs == set(sanitize.HS), (path, shape, hs)
    for c in cases:  # every explicit CuTe tactic is valid at its H
        if c.tactic and c.backend != "triton":
            assert tactics.parse_tactic(c.tactic).invalid_reason(c.h) is None, c.name
    assert any(c.precision == "tf32" for c in cases)
    flipped = [c for c in cases if c.label == "one_per_sm-flipped"]
    assert {tactics.parse_tactic(c.tactic).one_per_sm for c in flipped} == {False, True}
    for c in flipped:
        assert tactics.parse_tactic(c.tactic).one_per_sm != tactics.default_fma_tactic(c.backend, c.m, c.h).one_per_sm


def test_shards_partition_the_cases(sanitize):
    cases = sanitize.all_cases()
    shards = [sanitize.select(cases, shard=f"{i}/3") for i in (1, 2, 3)]
    assert sorted(c.name for s in shards for c in s) == sorted(c.name for c in cases)
    assert {c.backend for c in sanitize.select(cases, backends=["triton"])} == {"triton"}


def test_match_keeps_the_cases_whose_names_contain_a_string(sanitize):
    cases = sanitize.all_cases()
    picked = sanitize.select(cases, match=["broadcast", "/M1031/"])
    assert picked and all("broadcast" in c.name or "/M1031/" in c.name for c in picked)
    assert len(picked) == sum("broadcast" in c.name or "/M1031/" in c.name for c in cases)


SAMPLE = """\
========= COMPUTE-SANITIZER
========= Program hit cudaErrorInvalidValue (error 1) due to "invalid argument" on CUDA API call to cuPointerGetAttribute.
@@sanitize-begin fused/half_fma/M3
========= Barrier error detected. Divergent thread(s) in block
=========     at 0x650 in kernel_cutlass_kernel_BigFuseKernel_0
=========     by thread (128,0,0) in block (0,0,0)
=========
========= Barrier error detected. Divergent thread(s) in block
=========     at 0x650 in kernel_cutlass_kernel_BigFuseKernel_0
=========     by thread (160,0,0) in block (0,0,0)
=========
@@sanitize-end fused/half_fma/M3 fatal: RuntimeError: CUDA error: unspecified launch failure
@@sanitize-begin fused/all_fma/M3
@@sanitize-end fused/all_fma/M3 ok
========= Invalid __global__ read of size 4 bytes
=========     at 0x1a0 in kernel_x
=========     Address 0x7f0000000100 is out of bounds
=========     Saved host backtrace up to driver entry point at kernel launch time
=========         Host Frame: [0x2dd4b3] in libcuda.so.1
=========
========= Target application returned an error
========= ERROR SUMMARY: 4 errors
"""


def test_parse_counts_and_attributes_reports(sanitize):
    p = sanitize.parse_output(SAMPLE)
    assert p.errors == 4
    assert p.reports["fused/half_fma/M3"] == ["Barrier error detected. Divergent thread(s) in block"] * 2
    assert p.reports["fused/all_fma/M3"] == ["Invalid __global__ read of size 4 bytes"]  # after its end marker
    assert p.reports[None] == ['Program hit cudaErrorInvalidValue (error 1) due to "invalid argument" on CUDA API '
                               'call to cuPointerGetAttribute.']
    assert p.statuses == {"fused/half_fma/M3": "fatal: RuntimeError: CUDA error: unspecified launch failure",
                          "fused/all_fma/M3": "ok"}


def test_parse_summary_forms(sanitize):
    assert sanitize.parse_output("========= ERROR SUMMARY: 0 errors\n").errors == 0
    assert sanitize.parse_output("========= ERROR SUMMARY: 1 error\n").errors == 1
    beyond = ("========= ERROR SUMMARY: 250 errors\n"
              "========= ERROR SUMMARY: 150 errors were not printed. Use --print-limit option to adjust the number\n")
    assert sanitize.parse_output(beyond).errors == 250
    assert sanitize.parse_output("@@sanitize-begin a\nKilled\n") == sanitize.Parsed(None, 0, {}, {"a": "running"}, {})
    race = ("========= Warning: Race reported between Write access at 0x10 in k\n"
            "=========     and Read access at 0x20 in k [4 hazards]\n"
            "========= RACECHECK SUMMARY: 1 hazard displayed (0 errors, 1 warning)\n"
            "========= ERROR SUMMARY: 0 errors\n")
    p = sanitize.parse_output(race)
    assert (p.errors, p.warnings, p.reports) == (0, 1, {None: ["Warning: Race reported between Write access at 0x10 "
                                                                "in k"]})
    # racecheck of compute-sanitizer 2025.3.1 (H200, 2026-12-04) ends with its own summary only
    assert sanitize.parse_output("========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n").errors == 0
    only_race = sanitize.parse_output("========= RACECHECK SUMMARY: 3 hazards displayed (2 errors, 1 warning)\n")
    assert (only_race.errors, only_race.warnings) == (2, 1)


FAKE_SANITIZER = r"""#!{python}
# stands in for compute-sanitizer: runs no program, prints what a worker and the tool would print
import os, sys
args = sys.argv[1:]
if args == ["--help"]:
    print("  --show-backtrace arg   --track-unused-memory arg")
    sys.exit(0)
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write(" ".join(args[:args.index("--worker")]) + " | caching off: "
              + os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING", "-") + "\n")
names = args[args.index("--cases") + 1].split(",")
errors = 0
print("========= COMPUTE-SANITIZER")
for n in names:
    print("@@sanitize-begin", n, flush=True)
    if "bad" in n:
        print("========= Barrier error detected. Divergent thread(s) in block")
        print("=========     by thread (128,0,0) in block (0,0,0)")
        errors += 1
    if "crash" in n:
        print("========= ERROR SUMMARY: %d errors" % errors)
        sys.exit(3)
    if "flood" in n:  # one report printed, two more counted (past the print limit)
        print("========= Invalid __global__ write of size 4 bytes")
        errors += 3
    print("@@sanitize-end", n, "ok")
print("========= ERROR SUMMARY: %d errors" % errors)
sys.exit(99 if errors else 0)
"""


def test_runner_attributes_reports_and_restarts_after_a_death(sanitize, tmp_path, monkeypatch):
    fake = tmp_path / "compute-sanitizer"
    fake.write_text(FAKE_SANITIZER.replace("{python}", sys.executable))
    fake.chmod(0o755)
    log = tmp_path / "log"
    monkeypatch.setenv("FAKE_LOG", str(log))
    monkeypatch.delenv("PYTORCH_NO_CUDA_MEMORY_CACHING", raising=False)
    cases = [sanitize.Case("op", "b", 1, 64, False, label) for label in ("ok1", "bad", "flood", "crash", "ok2")]
    cases.append(sanitize.Case("op", "b", 1, 64, False, "graph", graph=True))
    runner = sanitize.Runner(str(fake), chunk=10, timeout=60, budget=300, print_limit=10)
    results = runner.run("initcheck", cases)
    got = {name.rsplit("/", 1)[1]: (r["status"], r["errors"]) for name, r in results.items()}
    assert got == {"ok1": ("ok", 0), "bad": ("ok", 1), "flood": ("ok", 3), "crash": ("died (exit 3)", 0),
                   "ok2": ("ok", 0), "graph": ("ok", 0)}
    assert results[cases[1].name]["reports"] == ["Barrier error detected. Divergent thread(s) in block"]
    runs = log.read_text().splitlines()
    # the chunk, the rest after the death, then the graph case with torch's caching allocator on
    assert len(runs) == 3
    assert all("--tool initcheck" in r and "--show-backtrace device" in r and "--track-unused" not in r for r in runs)
    assert [r.rsplit(": ", 1)[1] for r in runs] == ["1", "1", "-"]
    assert [sanitize.finding(r) for r in results.values()] == [False, True, True, True, False, False]


@pytest.mark.parametrize("budget, timeout, status", [(300, 60, "hung"), (40, 300, "stopped by the budget's end")])
def test_a_process_killed_at_the_budgets_end_is_not_a_hang(sanitize, monkeypatch, budget, timeout, status):
    """A process the sweep's deadline ends (its budget shorter than the process time limit) leaves its running case
    not run, not a finding; the process's own time limit is a hang (the H200 sweep of 2026-12-05 counted 13 cases cut
    by the deadline as hung, each of which then passed every tool alone)."""
    cases = [sanitize.Case("op", "b", 1, 64, False, label) for label in ("done", "cut")]
    names = [c.name for c in cases]
    killed = f"{sanitize.BEGIN} {names[0]}\n{sanitize.END} {names[0]} ok\n{sanitize.BEGIN} {names[1]}\n"
    monkeypatch.setattr(sanitize, "run_bounded", lambda cmd, env, limit: (killed, None, True))
    monkeypatch.setattr(sanitize.Runner, "command", lambda self, tool, names: ["true"])
    runner = sanitize.Runner("compute-sanitizer", chunk=10, timeout=timeout, budget=budget, print_limit=10)
    results = runner.run("memcheck", cases)
    assert results[names[0]]["status"] == "ok" and results[names[1]]["status"] == status
    assert sanitize.finding(results[names[1]]) == (status == "hung")
    assert sanitize.not_run(results[names[1]]) == (status != "hung")


def test_worker_runs_a_case_on_the_cpu(sanitize, capsys):
    """The worker's own loop, on the Triton interpreter: markers around the case, the contract checked."""
    name = "mhc_fused_hc/triton/M1/H512/norm/fp32/default"
    assert sanitize.worker([name], check=True, device="cpu") == 0
    assert capsys.readouterr().out.splitlines() == [f"{sanitize.BEGIN} {name}", f"{sanitize.END} {name} ok"]


def test_merge_prints_one_table(sanitize, tmp_path, capsys):
    import json

    for i, status in enumerate(("ok", "ok")):
        (tmp_path / f"{i}.json").write_text(json.dumps({"cases": [f"c{i}"], "results": {
            "check": {f"c{i}": {"status": status, "errors": None, "reports": []}},
            "synccheck": {f"c{i}": {"status": status, "errors": i, "reports": ["Barrier error"] * i}}}}))
    assert sanitize.main(["--merge", str(tmp_path / "0.json"), str(tmp_path / "1.json"), "--tools", "synccheck"]) == 1
    out = capsys.readouterr().out
    assert "[synccheck] c1: ok, 1 reports" in out and out.splitlines()[-1] == "sanitize: 2 cases, 1 findings, 0 not run"


def test_graph_case_is_checked_on_the_inputs_of_its_last_replay(sanitize, monkeypatch):
    """A graph case replays on new activations: the contract check must see those, not the first set (the H200 sweep
    of 2026-12-04 reported every graph case off the contract before this)."""
    import mhc_cute.benchmark

    class Replayed:  # stands in for a captured CUDA graph: a replay makes the call again
        def __init__(self, call, sets):
            self.call, self.sets = call, sets
            call(sets[0])

        def replay(self):
            self.call(self.sets[0])

    monkeypatch.setattr(mhc_cute.benchmark, "capture", Replayed)
    case = sanitize.Case("mhc_fused_hc", "torch", 3, 64, True, "graph", graph=True)
    assert sanitize.run_case(case, check=True, device="cpu") == "ok"


def test_a_hung_process_and_its_children_are_killed_at_the_timeout(sanitize):
    """The sanitizer's child (the worker) holds the output pipe: the timeout kills the whole process group, so the
    runner gets the output so far instead of waiting on the child."""
    import time

    hang = ("import subprocess, sys, time\n"
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
            "print('started', flush=True)\n"
            "time.sleep(120)\n")
    t0 = time.monotonic()
    out, rc, hung = sanitize.run_bounded([sys.executable, "-c", hang], dict(os.environ), timeout=3)
    assert hung and rc is None and "started" in out
    assert time.monotonic() - t0 < 30


def test_a_case_past_its_timeout_ends_its_worker_with_the_stack(sanitize):
    """A case that hangs (here a sleep standing in for a kernel that never finishes) ends its worker after
    ``case_timeout`` with every thread's stack printed; the parent reads the case as timed out and keeps the
    innermost frames of the main thread, which show where it waited."""
    import time

    code = ("import runpy, sys, time\n"
            f"m = runpy.run_path({str(SCRIPT)!r})\n"
            "case = m['Case']('mhc_collapse', 'torch', 1, 64, True)\n"
            "def wait_for_the_gpu(): time.sleep(120)\n"
            "m['worker'].__globals__['all_cases'] = lambda: [case]\n"
            "m['worker'].__globals__['run_case'] = lambda *a: wait_for_the_gpu()\n"
            "sys.exit(m['worker']([case.name], False, 'cpu', 2))\n")
    t0 = time.monotonic()
    out, rc, hung = sanitize.run_bounded([sys.executable, "-c", code], dict(os.environ), timeout=60)
    assert not hung and rc != 0 and time.monotonic() - t0 < 50
    parsed = sanitize.parse_output(out)
    name = "mhc_collapse/torch/M1/H64/norm/fp32/default"
    assert parsed.statuses == {name: "timed out"}
    assert any("wait_for_the_gpu" in frame for frame in sanitize._innermost(parsed.stacks[name]))
