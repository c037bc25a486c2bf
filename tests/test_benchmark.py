"""The benchmark's arithmetic on the CPU: SPEC's floors."""

import pytest

from mhc_cute import benchmark as bm

H = 7168


def test_the_seam_floor_counts_the_fp32_weight_once():
    # fn [24, 4H] fp32 = 384H bytes, read once per call; 20H + 160 bytes per token
    assert bm.floor_bytes(1, H) == 20 * H + 160 + 384 * H
    assert bm.floor_bytes(0, H) == 384 * H == 2_752_512
    assert bm.floor_bytes(1000, H) - bm.floor_bytes(999, H) == 143_520  # SPEC: 143,520 B per token at H = 7168


@pytest.mark.parametrize("floor,per_token,weight", [  # bytes per token and of the weight, as functions of H
    (bm.delayed_floor_bytes, lambda h: 20 * h + 192, lambda h: 384 * h),
    (bm.entry_floor_bytes, lambda h: 2 * h + 8 * h + 2 * h, lambda h: 24 * h * 4),
    (bm.no_post_floor_bytes, lambda h: 8 * h + 2 * h, lambda h: 384 * h),
    (bm.post_floor_bytes, lambda h: 18 * h + 80, lambda h: 0),
    (bm.collapse_floor_bytes, lambda h: 10 * h + 16, lambda h: 0),
    (bm.head_floor_bytes, lambda h: 10 * h + 8 * h, lambda h: 4 * 4 * h * 4),
])
@pytest.mark.parametrize("hidden", [4096, 5120, 7168])
def test_the_other_ops_floors_follow_the_spec(floor, per_token, weight, hidden):
    for m in (0, 1, 256):
        assert floor(m, hidden) == m * per_token(hidden) + weight(hidden)


def test_rotation_covers_the_flush_size_with_the_weight_counted():
    for m in (1, 64, 4096):
        n = bm.n_rotation_sets(m, H)
        assert 2 <= n <= bm.MAX_SETS
        assert n == bm.MAX_SETS or n * bm.floor_bytes(m, H) >= bm.L2_FLUSH_BYTES


@pytest.mark.parametrize("pre", [None, "carried"])
def test_the_host_floor_makes_the_compiled_call_a_plan_makes(monkeypatch, pre):
    """The bench's floor of host time (``host_floor_call``) calls the compiled kernels with the arguments an eager
    call passes them (``kernels.KernelLaunch``), only prepared once: the same tensors' shapes and dtypes, scratch and
    scalars, in the same order (the delayed seam's too: ``pre`` its carried gates)."""
    import torch

    from mhc_cute import tactics
    from mhc_cute.accuracy import make_inputs, problem_of
    from mhc_cute.kernels.launch import KernelLaunch

    calls = []

    def prepared_launch(problem, backend, tactic, out):
        tactic = tactics.default_fma_tactic("all_fma", problem.m, problem.hidden)
        return KernelLaunch(lambda *args: calls.append(args), problem, tactic, counters=1)
    monkeypatch.setattr(bm, "prepared_launch", prepared_launch)
    s = make_inputs(3, 64, seed=1, pre=pre)
    bm.host_floor_call(s)(s)
    problem = problem_of(s)
    out = problem.empty_outputs()
    prepared_launch(problem, "auto", None, out)(problem.inputs, out)
    floor, eager = calls
    assert len(floor) == len(eager) == 8 + 4 + 2 + 2 + 6  # inputs, outputs, partials, counters, seam, scalars
    for a, b in zip(floor, eager):
        if isinstance(b, torch.Tensor):
            assert (a.shape, a.dtype, a.is_contiguous()) == (b.shape, b.dtype, b.is_contiguous())
        else:
            assert a == b
    assert (floor[14] is None) == (floor[15] is None) == (pre is None)  # pre_mix_prev, pre_mix_cur


def test_host_table():
    rows = [(7168, 1, bm.HostTimes(15.0, 10.0, "half_fma (default)")),
            (7168, 256, bm.HostTimes(18.0, 12.0, "half_mma half_mma:k64:m128:s3:fbw", compiled_us=60.0))]
    lines = bm.format_host_table(rows, "NVIDIA H200").splitlines()
    assert lines[1].startswith("TVM-FFI ") and "compiled" in lines[2] and lines[3].startswith("---")
    assert lines[4].split() == ["7168", "1", "|", "15.0", "10.0", "1.50", "-", "|", "half_fma", "(default)"]
    assert lines[5].split()[3:7] == ["18.0", "12.0", "1.50", "60.0"]
    assert "compiled" not in bm.format_host_table(rows[:1], "NVIDIA H200").splitlines()[2]
    assert "mhc_post" in bm.format_host_table(rows[:1], "NVIDIA H200", "mhc_post").splitlines()[0]
    assert "5 torch.empty" in bm.format_host_table(rows[:1], "NVIDIA H200", "mhc_fused_hc_delayed").splitlines()[0]


@pytest.mark.gpu
def test_the_host_floor_computes_what_auto_computes():
    """On a GPU: the floor of ``mhc-cute bench --host`` is auto's own work (its compiled kernels with the call's
    arguments): its outputs are bit-identical to an eager auto call's. And the host measures run end to end."""
    import torch

    from mhc_cute import mhc_fused_hc_delayed

    dev = torch.device("cuda")
    for m, hidden, delayed in ((1, 7168, False), (32, 7168, False), (256, 4096, False), (1, 7168, True),
                               (256, 7168, True)):
        sets = bm.make_sets(m, hidden, 1, dev, norm=m == 32)
        s = bm.with_carried_gates(sets)[0] if delayed else sets[0]
        want = mhc_fused_hc_delayed(**s) if delayed else bm.mhc_cute_call("auto")(s)
        got = bm.host_floor_call(s)(s)
        for name, a, b in zip(want._fields, want, got):
            assert torch.equal(a.view(torch.int16 if a.dtype == torch.bfloat16 else torch.int32),
                               b.view(a.shape).view(torch.int16 if a.dtype == torch.bfloat16 else torch.int32)), name
    for delayed in (False, True):
        times = bm.host_times(1, 512, dev, False, compiled=True, delayed=delayed)
        assert times.auto_us > 0 and times.floor_us > 0 and times.compiled_us > 0
    for op in ("mhc_post", "mhc_collapse", "mhc_head"):
        times = bm.op_host_times(op, 3, 512, dev)
        assert times.auto_us > 0 and times.floor_us > 0 and times.choice in ("cute", "triton", "seam"), times


def test_readme_tables_show_auto_host_time_beside_its_floor(tmp_path):
    """``bench/merge_measured.py`` renders auto's host time per eager call and its floor where the run measured them."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    results = [bm.Result("auto", 1, 512, graph_us=4.4, floor_frac=0.1, host=bm.HostTimes(15.04, 10.0, "x")._asdict()),
               bm.Result("auto", 2048, 512, graph_us=40.0, floor_frac=0.5)]
    results += [bm.Result("half_fma", r.m, 512, graph_us=r.graph_us, floor_frac=r.floor_frac) for r in results]
    bm.write_json(results, str(tmp_path / "run.json"), 4e12, "Fake GPU", {})
    out = subprocess.run([sys.executable, os.path.join(root, "bench", "merge_measured.py"), str(tmp_path / "run.json")],
                         env=dict(os.environ, PYTHONPATH=root), capture_output=True, text=True, check=True).stdout
    head, _, small, large = [[c.strip() for c in line.strip("|").split(" | ")] for line in out.splitlines()
                             if line.startswith("|")]
    assert dict(zip(head, small))["auto host (floor)"] == "15.0 (10.0)"
    assert dict(zip(head, large))["auto host (floor)"] == "—"


def test_op_bench_calls_run_the_op_and_the_seam_on_the_same_tokens():
    """``bench --op``: each standalone op's calls on ``op_sets`` give the op's output (the same as a direct call), and
    the comparison column the seam's on the same tokens."""
    import torch

    from mhc_cute import benchmark as bm, ops
    from mhc_cute.accuracy import op_inputs_of

    sets = bm.with_carried_gates(bm.make_sets(3, 64, 2, "cpu", True))
    for op in ("mhc_post", "mhc_collapse", "mhc_head"):
        calls = bm.op_calls(op, ["torch"])
        assert list(calls) == ["auto", "torch", "mhc_fused_hc auto"]
        s = bm.op_sets(op, sets)[1]
        want = getattr(ops, op)(**op_inputs_of(op, sets[1]), backend="torch")
        assert torch.equal(calls["torch"](s), want)
        assert calls["mhc_fused_hc auto"](s).layer_input.shape == (3, 64)
        assert bm.OP_FLOORS[op.removeprefix("mhc_")](3, 64) > 0


@pytest.mark.parametrize("delayed", [False, True])
def test_form_bench_calls_run_the_entry_form_and_the_seam_on_the_same_tokens(delayed):
    """``bench --form``: the calls on ``form_sets`` run the seam in that form (the no-post seam returns
    ``residual_prev`` itself; the broadcast entry writes 4 copies of stream 0), the comparison column the regular
    seam on the full inputs."""
    import torch

    sets = bm.make_sets(3, 64, 2, "cpu", True)
    if delayed:
        sets = bm.with_carried_gates(sets)
    for form in ("no_post", "broadcast"):
        calls = bm.form_calls(["torch"], delayed)
        assert list(calls) == ["auto", "torch", "mhc_fused_hc auto"]
        s = bm.form_sets(form, sets)[1]
        got = calls["torch"](s)
        if form == "no_post":
            assert got.residual_cur is s["form"]["residual_prev"]
        else:
            assert s["form"]["residual_prev"].shape == (3, 64)
            assert torch.equal(got.residual_cur, sets[1]["residual_prev"][:, :1].expand(3, 4, 64))
        assert hasattr(got, "pre_mix_cur") == delayed
        assert calls["mhc_fused_hc auto"](s).residual_cur.shape == (3, 4, 64)
        assert bm.FORM_FLOORS[form](3, 64) > 0


def test_bench_refuses_form_with_op(capsys):
    from mhc_cute import cli

    assert cli.main(["bench", "--form", "no_post", "--op", "mhc_post"]) == 2
    assert "--form" in capsys.readouterr().err


def test_replays_are_timed_in_batches_enqueued_between_two_events(monkeypatch):
    """``replay_us`` times ``REPLAY_BATCH`` replays between two events (the host's launch of each overlaps the one
    before) and reports µs per call of each batch; ``launch_us`` refuses fewer calls than one batch."""
    import torch

    log = []

    class FakeEvent:
        def __init__(self, enable_timing):
            self.at = None

        def record(self):
            self.at = len(log)
            log.append("event")

        def synchronize(self):
            pass

        def elapsed_time(self, end):  # ms: 1 ms per replay enqueued between the two events
            return float(log[self.at:end.at].count("replay"))

    class FakeGraph:
        def replay(self):
            log.append("replay")

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    times = bm.replay_us(FakeGraph(), calls_per_replay=8, reps=20)
    assert len(times) == 20 // bm.REPLAY_BATCH
    assert times == [1e3 / 8] * len(times)  # 1 ms per replay of 8 calls
    timed = log[bm.REPLAY_BATCH:]  # after the untimed warm batch
    assert timed == (["event"] + ["replay"] * bm.REPLAY_BATCH + ["event"]) * (20 // bm.REPLAY_BATCH)
    with pytest.raises(ValueError, match="reps"):
        bm.launch_us(FakeGraph().replay, reps=2, batch=4)
