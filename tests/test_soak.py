"""bench/soak.py without a GPU: a short run on the torch backend and Triton's interpreter, and how a failure is
reported (its reproducer replays the same call)."""

import itertools
import json

import pytest
from conftest import bench_script


@pytest.fixture(scope="module")
def soak():
    with bench_script("soak.py") as module:
        yield module


def test_short_soak_on_the_cpu(soak, capsys):
    assert soak.main(["--seconds", "3", "--seed", "7", "--device", "cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "soak seed 7 on cpu: torch, triton"
    last = lines[-1].split()
    assert last[0] == "soak:" and last[2:] == ["calls,", "0", "failures"] and int(last[1]) >= 1, lines[-1]


@pytest.mark.parametrize("op", ["mhc_fused_hc_delayed", "mhc_post", "mhc_collapse", "mhc_head"])
def test_short_soak_of_each_op(soak, capsys, op):
    assert soak.main(["--seconds", "2", "--seed", "5", "--device", "cpu", "--ops", op]) == 0
    lines = capsys.readouterr().out.splitlines()
    counts = lines[-2].split(": ", 1)[1].split()
    assert counts and all(c.startswith(op + ":") for c in counts), lines[-2]
    last = lines[-1].split()
    assert last[2:] == ["calls,", "0", "failures"] and int(last[1]) >= 1, lines[-1]


def test_delayed_draws_cover_every_form(soak):
    env = soak.make_env("cpu", None, None)
    draws = [soak.draw_fused_hc_delayed(soak.call_rng(2, i), env) for i in range(60)]
    assert {d["form"] for d in draws} == {"regular", "no_post", "broadcast"}
    assert {d["pre"] for d in draws} == {"carried", "identity"}


def test_draws_depend_only_on_the_seed(soak):
    env_a, env_b = (soak.make_env("cpu", None, None) for _ in range(2))
    draws = [[soak.draw_fused_hc(soak.call_rng(3, i), env) for i in range(30)] for env in (env_a, env_b)]
    assert draws[0] == draws[1]
    assert json.loads(json.dumps(draws[0])) == draws[0]  # a reproducer carries a draw as JSON
    assert {d["backend"] for d in draws[0]} == {"torch", "triton"}


def test_a_failure_is_reported_with_a_reproducer(soak, capsys, monkeypatch):
    """A call off the contract: the soak goes on, prints the failure and a command that replays that very call, and
    exits 1; the replay fails the same way."""
    real = soak.OPS["mhc_fused_hc"]

    def run(d, env):
        if d["m"] % 2:
            raise AssertionError(f"odd M = {d['m']}")
        real.run(d, env)

    monkeypatch.setitem(soak.OPS, "mhc_fused_hc", real._replace(run=run, draw=lambda rng, env: dict(
        real.draw(rng, env), backend="torch", h=64)))
    assert soak.main(["--seconds", "1.5", "--seed", "3", "--device", "cpu", "--ops", "mhc_fused_hc"]) == 1
    out = capsys.readouterr().out.splitlines()
    n, failures = int(out[-1].split()[1]), int(out[-1].split()[3])
    assert 0 < failures < n
    repro = [line for line in out if "reproduce:" in line]
    assert len(repro) == failures
    draw = json.loads(repro[0].split("--replay ", 1)[1].strip("'"))
    assert draw["m"] % 2 == 1
    assert soak.main(["--device", "cpu", "--replay", json.dumps(draw)]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == "soak: 1 calls, 1 failures"
    draw["m"], draw["lead"] = 2, [2]
    assert soak.main(["--device", "cpu", "--replay", json.dumps(draw)]) == 0


def test_a_slow_then_hung_call_is_reported_with_its_reproducer(soak, capsys):
    import time

    hung = []
    watchdog = soak.Watchdog(0.5, 2.0, "cpu", on_hang=lambda: hung.append(True))
    draw = {"op": "mhc_fused_hc", "m": 5}
    watchdog.start(4, draw, 4, 0)
    time.sleep(4)
    out = capsys.readouterr().out
    assert hung == [True]
    assert "slow call 4:" in out and "FAIL call 4: hung" in out and json.dumps(draw) in out
    assert "in test_a_slow_then_hung_call_is_reported_with_its_reproducer" in out  # the stack of the call in flight
    assert out.strip().splitlines()[-1] == "soak: 5 calls, 1 failures"


def test_a_stopped_watchdog_never_fires(soak, capsys):
    """After the soak ends its watchdog stops: a process that goes on (a test session) is not ended by the last call."""
    import time

    hung = []
    watchdog = soak.Watchdog(0.5, 1.0, "cpu", on_hang=lambda: hung.append(True))
    watchdog.start(0, {"op": "mhc_fused_hc"}, 0, 0)
    watchdog.stop()
    time.sleep(2.5)
    assert hung == [] and "hung" not in capsys.readouterr().out


def test_the_soak_makes_the_draws_its_precompile_lists(soak, monkeypatch):
    """``--precompile-only`` enumerates the draws a soak makes on a Hopper GPU: the soak's loop runs exactly
    ``draw_sequence``'s draws, and ``kernel_specs`` names a kernel for each CuTe seam draw among them (the draw's own
    tactic where it has one), nothing for the others. No GPU: the calls are recorded, not run."""
    ops = ["mhc_fused_hc", "mhc_fused_hc_delayed"]
    made = []
    for op in ops:
        monkeypatch.setitem(soak.OPS, op, soak.OPS[op]._replace(run=lambda d, env: made.append(d)))
    assert soak.soak(0.3, 11, soak.hopper_env(["all_fma", "all_mma", "torch"], None, 132), ops, 60) == 0
    assert len(made) > 100
    listed = [d for _, _, d in itertools.islice(soak.draw_sequence(11, soak.hopper_env(
        ["all_fma", "all_mma", "torch"], None, 132), ops), len(made))]
    assert listed == made
    fma, mma = soak.kernel_specs(11, soak.hopper_env(["all_fma", "all_mma", "torch"], None, 132), ops, len(made))
    cute = [d for d in made if d["backend"] != "torch" and d["m"] > 0]
    assert cute and len(cute) < len(made)
    configs = {(d["backend"], d["h"], d["norm"], d.get("pre"), d["form"], d["tactic"]) for d in cute}
    assert 0 < len(fma) + len(mma) <= len(configs)  # one kernel a configuration at most (defaults differ by M)
    names = {s[0] for s in fma + mma}
    assert {d["tactic"] for d in cute if d["tactic"]} <= names
    assert {s[0].split(":")[0] for s in fma} == {"all_fma"} and {s[0].split(":")[0] for s in mma} == {"all_mma"}


def test_precompile_only_compiles_the_listed_kernels(soak, monkeypatch, capsys):
    import precompile

    jobs = []
    monkeypatch.setattr(precompile, "compile_jobs", lambda j, workers: jobs.extend(j))
    assert soak.main(["--precompile-only", "--seed", "4", "--calls", "500", "--backends", "all_fma,all_mma"]) == 0
    seams = ["mhc_fused_hc", "mhc_fused_hc_delayed"]  # the standalone ops have no backend among these two
    fma, mma = soak.kernel_specs(4, soak.hopper_env(["all_fma", "all_mma"], None, 132), seams, 500)
    assert [specs for _, _, specs in jobs] == [fma, mma] and fma and mma
    assert f"{len(fma)} FMA and {len(mma)} MMA variants" in capsys.readouterr().out
    jobs.clear()  # every backend, as a soak draws by default: Triton's and auto's draws need no GPU either
    assert soak.main(["--precompile-only", "--seed", "4", "--calls", "500"]) == 0
    assert [len(specs) for _, _, specs in jobs] == [len(s) for s in soak.kernel_specs(
        4, soak.hopper_env(None, None, 132), list(soak.OPS), 500)]
    with pytest.raises(SystemExit):
        soak.main(["--precompile-only", "--calls", "10"])  # which soak: the seed is needed
