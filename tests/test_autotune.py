"""Tactic selection on the CPU: M buckets, the tuning cache (atomic, corrupt files survived), nearest bucket."""

import json
import os
from dataclasses import replace

import pytest

from mhc_cute import autotune, selector
from mhc_cute.selector import Choice, bucket_of


@pytest.mark.parametrize("m,bucket", [
    (1, 1), (2, 2), (3, 4), (5, 8), (64, 64), (65, 128), (128, 128), (129, 256), (256, 256), (257, 384),
    (1000, 1024), (8191, 8192), (8192, 8192), (8193, 16384), (20000, 32768),
])
def test_bucket_of(m, bucket):
    assert bucket_of(m) == bucket


def test_buckets_cover_and_are_fixed_points():
    buckets = selector.all_buckets(16384)
    assert buckets[:8] == [1, 2, 4, 8, 16, 32, 64, 128]
    assert buckets[8:11] == [256, 384, 512] and buckets[-2:] == [8192, 16384]
    assert all(bucket_of(b) == b for b in buckets)
    for m in range(1, 9000, 7):
        assert bucket_of(m) >= m and bucket_of(m) in buckets


def test_nearest_bucket():
    rows = {1: Choice("a", None), 64: Choice("b", None), 4096: Choice("c", None)}
    assert selector.nearest(rows, 1).backend == "a"
    assert selector.nearest(rows, 8).backend == "b"  # log2 distance 3 to both: ties go to the larger bucket
    assert selector.nearest(rows, 512).backend in ("b", "c")
    assert selector.nearest(rows, 16384).backend == "c"
    assert selector.nearest({}, 4) is None


def test_cache_roundtrip_and_merge(tmp_path):
    path = str(tmp_path / "sub" / "tuned.json")
    selector.save_user_tables({"k1": {1: Choice("all_fma", "t1", 3.5)}}, path)
    selector.save_user_tables({"k1": {2: Choice("half_fma", None)}, "k2": {8: Choice("triton", "x")}}, path)
    tables = selector.load_user_tables(path)
    assert tables["k1"][1] == Choice("all_fma", "t1", 3.5)
    assert tables["k1"][2] == Choice("half_fma", None)
    assert tables["k2"][8].tactic == "x"
    assert [f for f in os.listdir(tmp_path / "sub") if f.startswith(".tuned-")] == []  # no temp files left


@pytest.mark.parametrize("content", ["{not json", json.dumps({"format": 999, "tables": {}}), json.dumps([1, 2]),
                                     json.dumps({"format": 1, "tables": {"k": {"x": {}}}})])
def test_corrupt_cache_is_ignored_with_a_warning(tmp_path, content):
    path = tmp_path / "tuned.json"
    path.write_text(content)
    with pytest.warns(UserWarning, match="ignoring the tuning cache"):
        assert selector.load_user_tables(str(path)) == {}
    # and tuning again replaces it (saying again that the old file is ignored)
    with pytest.warns(UserWarning, match="ignoring the tuning cache"):
        selector.save_user_tables({"k": {1: Choice("torch", None)}}, str(path))
    assert selector.load_user_tables(str(path))["k"][1].backend == "torch"


def test_cache_dir_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("MHC_CUTE_CACHE_DIR", str(tmp_path))
    assert selector.cache_path() == str(tmp_path / "tuned.json")


def test_resolve_on_cpu_is_the_reference(monkeypatch):
    import torch

    monkeypatch.delenv("MHC_CUTE_BACKEND", raising=False)
    sel = selector.Selector()
    assert sel.resolve(torch.device("cpu"), 17, 512, "fp32", False) == ("torch", None)


def test_resolve_env_override_and_memo(monkeypatch):
    import torch

    sel = selector.Selector()
    monkeypatch.setenv("MHC_CUTE_BACKEND", "half_fma")
    monkeypatch.setenv("MHC_CUTE_TACTIC", "half_fma:k56:t1:n6:w256:s1:b1:flat")
    backend, tactic = sel.resolve(torch.device("cpu"), 3, 7168, "fp32", True)
    assert backend == "half_fma" and tactic.split_k == 56 and tactic.tokens_per_cta == 1
    monkeypatch.delenv("MHC_CUTE_BACKEND")
    assert sel.resolve(torch.device("cpu"), 4, 7168, "fp32", True)[0] == "half_fma"  # same bucket: memoised
    sel.reload()
    assert sel.resolve(torch.device("cpu"), 4, 7168, "fp32", True)[0] == "torch"


@pytest.mark.parametrize("backend", ["half_fma", "all_fma"])
@pytest.mark.parametrize("m", [1, 16, 256, 4096])
@pytest.mark.parametrize("h", [512, 7168])
def test_fma_candidates_are_valid_and_include_the_default(backend, m, h):
    from mhc_cute import tactics

    cands = autotune.candidate_tactics(backend, m, h, 132)
    assert tactics.default_fma_tactic(backend, m, h, 132) == cands[0]
    assert len(cands) == len(set(cands)) >= 2
    assert all(c.invalid_reason(h) is None for c in cands)
    assert all(tactics.parse_tactic(c.name) == c for c in cands)


def test_fma_candidates_include_the_warp_mma_shapes():
    """From M = 8 the FMA candidates include the warp-MMA projection at 256 threads and at 128 threads with the
    default's chunk and one twice as wide (the shape the shipped table has at H = 7168, M = 16)."""
    names = {c.name for c in autotune.candidate_tactics("half_fma", 16, 7168, 132)}
    assert {"half_fma:k112:t16:n6:w256:s1:b1:flatp:mma", "half_fma:k224:t16:n6:w128:s1:b1:flatp:mma",
            "half_fma:k112:t16:n12:w128:s1:b1:flatp:mma"} <= names
    assert not any(c.warp_mma for c in autotune.candidate_tactics("half_fma", 4, 7168, 132))


def test_fma_candidates_put_one_wave_grids_one_to_an_sm():
    """Each candidate whose grid is one wave comes with its CTAs one to an SM too (``one_per_sm``); others do not."""
    from mhc_cute import tactics

    for m in (1, 16, 32, 128):
        cands = autotune.candidate_tactics("half_fma", m, 7168, 132)
        for c in cands:
            twin = replace(c, one_per_sm=not c.one_per_sm)
            assert (twin in cands) == tactics.fits_one_wave(c, m, 132), (m, c.name)
    names = {c.name for c in autotune.candidate_tactics("half_fma", 32, 7168, 132)}
    assert "half_fma:k112:t32:n6:w256:s1:b1:flat:mma:o1" in names
    assert "half_fma:k112:t16:n6:w256:s1:b1:flat:mma:o1" not in names  # 224 CTAs at M = 32
    assert not any(c.one_per_sm for c in autotune.candidate_tactics("all_fma", 16, 7168, 132))


def test_candidates_of_a_backend_without_tactics():
    assert autotune.candidate_tactics("triton", 64, 4096, 132) == [None]


def test_shipped_tables_parse_and_name_real_backends():
    from mhc_cute import backends

    tables = selector.load_shipped_tables()
    assert any(k.startswith("NVIDIA H200|132|H7168|fp32|") for k in tables)
    for rows in tables.values():
        assert rows and all(bucket_of(b) == b for b in rows)
        assert all(c.backend in backends.BACKENDS for c in rows.values())


def _fake_gpu(monkeypatch, tmp_path, name, sm_count, capability):
    import types

    import torch

    monkeypatch.setenv("MHC_CUTE_CACHE_DIR", str(tmp_path))  # no user tables but the test's own
    props = types.SimpleNamespace(name=name, multi_processor_count=sm_count)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: props)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev: capability)
    return torch.device("cuda", 0)


def _shipped_row(gpu, hidden, norm, m):
    from mhc_cute import __version__

    key = selector.TuneKey(gpu, 132, hidden, "fp32", norm, __version__).as_str()
    return selector.nearest(selector.load_shipped_tables()[key], bucket_of(m))


@pytest.mark.parametrize("m,hidden,norm", [(1, 7168, False), (32, 7168, True), (100, 4096, False), (9000, 4096, True)])
@pytest.mark.parametrize("gpu", ["NVIDIA H100 80GB HBM3", "NVIDIA H200"])
def test_a_shipped_gpu_takes_its_own_table(monkeypatch, tmp_path, gpu, m, hidden, norm):
    device = _fake_gpu(monkeypatch, tmp_path, gpu, 132, (9, 0))
    sel = selector.Selector()
    assert sel.choose(device, m, hidden, "fp32", norm) == _shipped_row(gpu, hidden, norm, m)
    assert selector.TuneKey.parse(sel.table_key(device, hidden, "fp32", norm)).gpu == gpu


@pytest.mark.parametrize("m,hidden,norm", [(1, 7168, False), (32, 7168, True), (100, 4096, False), (9000, 4096, True)])
def test_a_gpu_of_the_shipped_architecture_and_sm_count_takes_its_table(monkeypatch, tmp_path, m, hidden, norm):
    """Another sm_90 GPU of 132 SMs (an H800) takes the first shipped file's table by name: the H100's."""
    device = _fake_gpu(monkeypatch, tmp_path, "NVIDIA H800", 132, (9, 0))
    sel = selector.Selector()
    choice = sel.choose(device, m, hidden, "fp32", norm)
    assert choice is not None and choice == _shipped_row("NVIDIA H100 80GB HBM3", hidden, norm, m)
    assert selector.TuneKey.parse(sel.table_key(device, hidden, "fp32", norm)).gpu == "NVIDIA H100 80GB HBM3"


@pytest.mark.parametrize("sm_count,capability,hidden", [(114, (9, 0), 7168), (132, (8, 0), 7168),
                                                       (132, (10, 0), 7168), (132, (9, 0), 6144)])
def test_no_stand_in_for_another_architecture_sm_count_or_h(monkeypatch, tmp_path, sm_count, capability, hidden):
    device = _fake_gpu(monkeypatch, tmp_path, "Some GPU", sm_count, capability)
    assert selector.Selector().choose(device, 32, hidden, "fp32", False) is None
    assert selector.Selector().table_key(device, hidden, "fp32", False) is None


def test_a_gpu_s_own_table_wins_over_the_stand_in(monkeypatch, tmp_path):
    from mhc_cute import __version__

    device = _fake_gpu(monkeypatch, tmp_path, "NVIDIA H800", 132, (9, 0))
    own = selector.TuneKey("NVIDIA H800", 132, 7168, "fp32", True, __version__).as_str()
    selector.save_user_tables({own: {32: Choice("triton", None, 9.0)}})
    # the GPU's own table with the norm serves a call without it before the H100's table without it
    assert selector.Selector().choose(device, 32, 7168, "fp32", False) == Choice("triton", None, 9.0)


def test_tune_key_round_trips():
    key = selector.TuneKey("NVIDIA H200", 132, 7168, "fp32", True, "0.2.0")
    assert key.as_str() == "NVIDIA H200|132|H7168|fp32|norm1|v0.2.0"  # the V4 seam's keys as before seams existed
    assert selector.TuneKey.parse(key.as_str()) == key
    delayed = replace(key, seam="delayed")
    assert delayed.as_str() == "NVIDIA H200|132|H7168|fp32|norm1|v0.2.0|delayed"
    assert selector.TuneKey.parse(delayed.as_str()) == delayed
    for bad in ("NVIDIA H200|132|H7168|fp32|norm1|v0.2.0|v4", "NVIDIA H200|132|H7168|fp32|norm1|v0.2.0|delayed|x"):
        with pytest.raises(ValueError, match="seam"):
            selector.TuneKey.parse(bad)


def test_the_delayed_seam_takes_its_own_table_from_its_smallest_bucket_up(monkeypatch, tmp_path):
    """The delayed seam's table (this GPU's, or a stand-in) serves M from its smallest tuned bucket up; below it,
    and wherever it has none, the V4 seam's table does. The V4 seam never reads the delayed seam's tables."""
    from mhc_cute import __version__

    device = _fake_gpu(monkeypatch, tmp_path, "NVIDIA H100 80GB HBM3", 132, (9, 0))
    v4_files = [f._replace(tables={k: rows for k, rows in f.tables.items() if "|delayed" not in k})
                for f in selector.shipped_files()]  # the shipped V4 tables alone
    monkeypatch.setattr(selector, "shipped_files", lambda: v4_files)
    own = selector.TuneKey("NVIDIA H100 80GB HBM3", 132, 7168, "fp32", False, __version__)
    delayed_pick, v4_pick = Choice("half_mma", "half_mma:k4:m64:s4:fbw", 480.0), Choice("triton", None, 9.0)
    norm_pick = Choice("half_mma", "half_mma:k2:m64:s3:fbw", 500.0)
    selector.save_user_tables({replace(own, seam="delayed").as_str(): {256: Choice("all_mma", None, 30.0),
                                                                       8192: delayed_pick},
                               replace(own, seam="delayed", norm=True).as_str(): {4096: norm_pick},
                               own.as_str(): {32: v4_pick, 8192: Choice("half_fma", None, 600.0)}})
    sel = selector.Selector()
    assert sel.choose(device, 9000, 7168, "fp32", False, "delayed") == delayed_pick
    assert sel.choose(device, 5000, 7168, "fp32", True, "delayed") == norm_pick
    # below the norm table's smallest bucket, the other norm flag's delayed table, which covers M = 300
    assert sel.choose(device, 300, 7168, "fp32", True, "delayed").backend == "all_mma"
    assert sel.choose(device, 100, 7168, "fp32", False, "delayed") == v4_pick  # below the delayed table's buckets
    assert sel.choose(device, 9000, 7168, "fp32", False) == Choice("half_fma", None, 600.0)
    assert sel.resolve(device, 9000, 7168, "fp32", False)[0] == "half_fma"  # memoised apart from the delayed seam
    assert sel.resolve(device, 9000, 7168, "fp32", False, "delayed") == ("half_mma",
                                                                         selector.tactic_or_none(delayed_pick))
    # no delayed table at this H: the V4 seam's (here the H100's shipped one)
    assert sel.choose(device, 9000, 4096, "fp32", False, "delayed") == _shipped_row("NVIDIA H100 80GB HBM3", 4096,
                                                                                   False, 9000)
    # a shipped delayed table of another GPU of this architecture stands in for this GPU's
    h200 = replace(own, gpu="NVIDIA H200", hidden=5120, seam="delayed").as_str()
    files = [selector.ShippedFile("nvidia_h200.json", "9.0", {h200: {2048: delayed_pick}})]
    monkeypatch.setattr(selector, "shipped_files", lambda: files)
    assert selector.Selector().choose(device, 4096, 5120, "fp32", True, "delayed") == delayed_pick


def test_shipped_tactics_are_valid_for_their_backend_and_h():
    from mhc_cute import __version__, tactics

    tables = selector.load_shipped_tables()
    assert all(selector.TuneKey.parse(k).version == __version__ for k in tables), \
        "a shipped table from another version never matches"
    for key, rows in tables.items():
        h = selector.TuneKey.parse(key).hidden
        for c in rows.values():
            if c.tactic is not None:
                t = tactics.parse_tactic(c.tactic)
                assert t.path == c.backend and t.invalid_reason(h) is None, (key, c)


def test_tuner_keeps_the_fastest_and_skips_failures(monkeypatch):
    """The tuning loop with the GPU parts stood in for: times come from a table, one candidate raises."""
    import torch

    from mhc_cute import benchmark as bm

    _fake_tuning_gpu(monkeypatch)
    fake_us = {"half_fma": 5.0, "all_fma": 4.0, "triton": 7.0}

    def call(name, precision, tactic, delayed=False):
        return (name, tactic)

    def time_graph(c, sets):
        name, tactic = c
        if name == "all_fma" and sets[0] >= 64:
            raise RuntimeError("this candidate fails")
        return fake_us[name] + (0.5 if tactic is not None and tactic.split_k % 2 else 0.0) + sets[0] / 1000

    monkeypatch.setattr(bm, "mhc_cute_call", call)
    monkeypatch.setattr(bm, "time_graph", time_graph)
    compiled = []  # compiled ahead in parallel processes: the (H, tactic) of every CuTe candidate, once
    monkeypatch.setattr(autotune, "precompile_candidates",
                        lambda cands, precision, norm, variants: compiled.extend(cands))
    _contract_passes(monkeypatch)
    tables = autotune.tune(torch.device("cuda", 0), [512], [1, 3, 100], "fp32", False,
                           ["half_fma", "all_fma", "triton"], log=lambda *a: None, measure="back-to-back")
    (key, rows), = tables.items()
    assert key.startswith("Fake GPU|132|H512|fp32|norm0|")
    assert sorted(rows) == [1, 4, 128]
    assert rows[1].backend == "all_fma" and rows[4].backend == "all_fma"
    assert rows[128].backend == "half_fma"  # all_fma failed there
    assert all(r.tactic is not None and r.us is not None for r in rows.values())
    assert compiled and all(h == 512 and t.path in ("half_fma", "all_fma") for h, t in compiled)


def test_tuner_ranks_small_buckets_by_their_worst_context(monkeypatch):
    """With ``measure="contexts"`` a bucket up to benchmark.CONTEXT_MAX_M is won by the candidate whose slowest
    context (back to back, after each predecessor kernel) is fastest; only the shortlist and the defaults are timed
    in context; larger buckets keep the back-to-back ranking."""
    import torch

    from mhc_cute import benchmark as bm

    _fake_tuning_gpu(monkeypatch)
    _contract_passes(monkeypatch)
    names = ["default", "fast_b2b", "robust"] + [f"filler{i}" for i in range(autotune.CONTEXT_SHORTLIST)]
    monkeypatch.setattr(autotune, "candidate_tactics", lambda name, m, h, sms: [None])
    monkeypatch.setattr(bm, "mhc_cute_call", lambda name, precision, tactic, delayed=False: name)
    b2b = {"default": 6.0, "fast_b2b": 4.0, "robust": 4.5, **{f"filler{i}": 5.0 for i in range(8)}}
    after = {"after-kernel": {"fast_b2b": 5.0, "robust": 5.0},
             "after-gemm": {"fast_b2b": 7.0, "robust": 5.2, "default": 6.5}}
    monkeypatch.setattr(bm, "time_graph", lambda name, sets: b2b[name])
    monkeypatch.setattr(bm, "context_predecessors", lambda sets: {p: p for p in after})
    timed_in_context = []

    def time_after(name, sets, predecessor):
        timed_in_context.append(name)
        return bm.AfterTiming(after[predecessor].get(name, 6.0), 0.0, 1.0)
    monkeypatch.setattr(bm, "time_after", time_after)

    def tuned(m, measure):
        timed_in_context.clear()
        (rows,) = autotune.tune(torch.device("cuda", 0), [512], [m], "fp32", False, names, log=lambda *a: None,
                                measure=measure).values()
        return rows[selector.bucket_of(m)]

    # every name is its backend's default here (one candidate each): the plain minimum decides
    assert tuned(16, "contexts") == selector.Choice("robust", None, 5.2)
    assert len(set(timed_in_context)) == len(names) and "filler7" in timed_in_context
    monkeypatch.setattr(autotune, "CONTEXT_SHORTLIST", 2)
    assert tuned(16, "contexts").backend == "robust"
    assert set(timed_in_context) == {"fast_b2b", "robust", *names}  # defaults always join the shortlist
    assert tuned(16, "back-to-back") == selector.Choice("fast_b2b", None, 4.0) and not timed_in_context
    assert tuned(bm.CONTEXT_MAX_M + 1, "contexts").backend == "fast_b2b" and not timed_in_context
    with pytest.raises(ValueError, match="measure"):
        tuned(16, "fastest")


def test_cli_tune_measures_match_the_tuner():
    from mhc_cute import cli

    assert cli.TUNE_MEASURES == autotune.MEASURES


@pytest.mark.parametrize("measure", ["contexts", "back-to-back"])
def test_cli_tune_passes_the_measure_and_says_what_the_times_are(monkeypatch, tmp_path, capsys, measure):
    import torch

    from mhc_cute import backends, cli

    seen = {}

    def tune(dev, hiddens, ms, precision, norm, names, measure, seam):
        seen.update(hiddens=hiddens, ms=ms, names=names, measure=measure, seam=seam)
        return {"Fake GPU|132|H512|fp32|norm0|v0": {16: Choice("half_fma", "half_fma:k8:t8:n6:w256:s1:b1:flat", 7.5)}}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(backends, "available", lambda dev: ["torch", "half_fma"])
    monkeypatch.setattr(autotune, "tune", tune)
    out = tmp_path / "tuned.json"
    argv = ["tune", "--hidden", "512", "--m", "16", "--out", str(out)]
    argv += [] if measure == "contexts" else ["--measure", measure]  # contexts is the default
    assert cli.main(argv) == 0
    assert seen == dict(hiddens=[512], ms=[16], names=["half_fma"], measure=measure, seam="v4")
    text = capsys.readouterr().out
    assert ("worst of back to back" in text) == (measure == "contexts")
    assert "half_fma:k8:t8:n6:w256:s1:b1:flat     7.50 us" in text
    assert selector.load_user_tables(str(out))["Fake GPU|132|H512|fp32|norm0|v0"][16].us == 7.5
    assert cli.main(["tune", "--m", "16", "--out", str(out)]) == 0
    assert seen["hiddens"] == [4096, 5120, 7168]  # DeepSeek-V4-Flash, V4.1, V4-Pro by default
    assert cli.main(["tune", "--delayed", "--m", "16", "--out", str(out)]) == 0
    assert seen["seam"] == "delayed"


def test_a_tuned_tactic_this_version_cannot_parse_falls_back_to_the_default():
    with pytest.warns(UserWarning, match="not understood"):
        assert selector.tactic_or_none(selector.Choice("half_mma", "half_mma:k8:m128:s3")) is None
    assert selector.tactic_or_none(selector.Choice("half_mma", "half_mma:k8:m128:s3:fbw")).split_k == 8
    assert selector.tactic_or_none(selector.Choice("triton", None)) is None


def test_bench_summary_compares_auto_with_the_fastest_backend_of_the_same_run():
    from mhc_cute import benchmark as bm

    rows = [bm.Result("auto", 1, 512, graph_us=10.5), bm.Result("half_fma", 1, 512, graph_us=10.0),
            bm.Result("half_mma", 1, 512, graph_us=12.0), bm.Result("tilekernels", 1, 512, graph_us=5.0)]
    summary = bm.auto_summary(rows, ["half_fma", "half_mma"])
    assert "auto / the fastest of half_fma, half_mma" in summary
    assert "H=512 M=1: 1.050 (fastest: half_fma)" in summary
    # auto faster than every backend timed beside it (a run timing Triton alone): below 1, and the header says so
    summary = bm.auto_summary(rows[:1] + [bm.Result("triton", 1, 512, graph_us=21.0)], ["triton"])
    assert "H=512 M=1: 0.500 (fastest: triton)" in summary and "below 1: auto is faster than each" in summary


def test_alternating_rounds_reverse_the_order_and_keep_a_failing_timer_out():
    from mhc_cute import benchmark as bm

    order = []

    def timer(key, us):
        def run():
            order.append(key)
            if us is None:
                raise RuntimeError("does not launch")
            return us
        return run
    times = bm.alternating_rounds({"a": timer("a", 1.0), "bad": timer("bad", None), "b": timer("b", 2.0)}, 3)
    assert order == ["a", "bad", "b", "b", "a", "a", "b"]
    assert times["a"] == [1.0] * 3 and times["b"] == [2.0] * 3 and isinstance(times["bad"], RuntimeError)


def test_bench_table_shows_the_context_times_where_they_were_measured():
    from mhc_cute import benchmark as bm

    rows = [bm.Result("auto", 1, 512, graph_us=4.4, context_us={"after-kernel": 6.1, "after-gemm": 5.9}, eager_us=30.0,
                      floor_frac=0.1),
            bm.Result("auto", 2048, 512, graph_us=40.0, eager_us=60.0, floor_frac=0.5)]
    lines = bm.format_table(rows, 4e12, "Fake GPU").splitlines()
    assert lines[3].split("|")[1].split() == ["4.40", "6.10", "5.90", "30.0", "10%"]
    assert lines[4].split("|")[1].split() == ["40.00", "-", "-", "60.0", "50%"]
    assert lines[-1] == "cells: graph µs, after-kernel µs, after-gemm µs, eager µs, % of floor"


def test_bench_cell_times_each_context_after_its_predecessor(monkeypatch):
    """``bench_one`` with contexts: the back-to-back graph time and, per context, ``time_after`` with that
    context's predecessor; without contexts none are timed."""
    from mhc_cute import benchmark as bm

    monkeypatch.setattr(bm, "time_graph", lambda call, sets: 4.0)
    monkeypatch.setattr(bm, "time_after", lambda call, sets, pre: bm.AfterTiming({"k": 6.0, "g": 5.5}[pre], 0.0, 1.0))
    r = bm.bench_one("auto", None, 1, 512, "cpu", False, 4e12, sets=[{}], eager=False,
                     contexts={"after-kernel": "k", "after-gemm": "g"})
    assert (r.error, r.graph_us, r.context_us) == (None, 4.0, {"after-kernel": 6.0, "after-gemm": 5.5})
    assert bm.bench_one("auto", None, 1, 512, "cpu", False, 4e12, sets=[{}], eager=False).context_us == {}


@pytest.mark.parametrize("other_us,want_default", [(4.95, True), (4.5, False)])
def test_tuner_keeps_the_default_tactic_unless_another_is_clearly_faster(monkeypatch, other_us, want_default):
    import torch

    from mhc_cute import benchmark as bm, tactics

    _fake_tuning_gpu(monkeypatch)
    _contract_passes(monkeypatch)
    default = tactics.default_fma_tactic("half_fma", 1, 512, 132)
    monkeypatch.setattr(bm, "mhc_cute_call", lambda name, precision, tactic, delayed=False: tactic)
    monkeypatch.setattr(bm, "time_graph", lambda tactic, sets: 5.0 if tactic == default else other_us)
    tables = autotune.tune(torch.device("cuda", 0), [512], [1], "fp32", False, ["half_fma"], log=lambda *a: None,
                           measure="back-to-back")
    (rows,) = tables.values()
    assert (rows[1].tactic == default.name) == want_default


def _fake_tuning_gpu(monkeypatch):
    """Stand in for the GPU parts of ``autotune.tune``: a 132-SM "Fake GPU" whose input sets are just M, and no
    compilation ahead (tests replace the timing functions themselves)."""
    import types

    import torch

    from mhc_cute import benchmark as bm

    props = types.SimpleNamespace(name="Fake GPU", multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: props)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(bm, "make_sets", lambda m, h, n, dev, norm: [m])
    monkeypatch.setattr(autotune, "precompile_candidates", lambda *a: None)


def _contract_passes(monkeypatch, wrong=()):
    """Stand in for the tuner's float64 check: the (backend, tactic) pairs in ``wrong`` fail it."""
    from mhc_cute import accuracy

    monkeypatch.setattr(accuracy, "problem_of", lambda inputs, precision: inputs)
    monkeypatch.setattr(accuracy, "failure_of",
                        lambda problem, name, tactic: "wrong" if (name, tactic) in wrong else None)


@pytest.mark.gpu
@pytest.mark.parametrize("seam", ["v4", "delayed"])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("h", [4096, 5120, 7168])
@pytest.mark.parametrize("m", [1, 5, 32, 100, 300, 2048, 8192])
def test_gpu_auto_where_the_seams_tables_serve(m, h, norm, seam):
    """``auto`` of each seam where the shipped tables serve an H100 or an H200 (its own; another sm_90 GPU of 132 SMs
    the H100's as a stand-in), from the latency buckets to prefill: it runs the table's pick, which meets the contract
    (its backend's tolerances) twice bit for bit."""
    import torch

    from mhc_cute.accuracy import check_backend, make_inputs, problem_of

    dev = torch.device("cuda")
    backend, tactic = selector.SELECTOR.resolve(dev, m, h, "fp32", norm, seam)
    key = selector.SELECTOR.table_key(dev, h, "fp32", norm, seam)
    if key is not None:  # a GPU with a table of its own or a stand-in
        want = selector.nearest(selector.SELECTOR.tables()[key], selector.bucket_of(m))
        assert (backend, tactic) == (want.backend, selector.tactic_or_none(want))
    inputs = make_inputs(m, h, seed=m + h, device="cuda", norm=norm, pre="carried" if seam == "delayed" else None)
    check_backend(problem_of(inputs), backend, tactic)


@pytest.mark.parametrize("gpu, table_gpu", [("NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3"),
                                            ("NVIDIA H200", "NVIDIA H200"), ("NVIDIA H800", "NVIDIA H100 80GB HBM3")])
def test_the_shipped_delayed_tables_serve_every_size(monkeypatch, tmp_path, gpu, table_gpu):
    """The shipped tables of the delayed seam (tuned from M = 1 to 16384, with and without the fused norm) serve its
    calls at every M: the H100's and the H200's on their GPU, the H100's as a stand-in on another of the same
    architecture and SM count."""
    from mhc_cute import __version__

    device = _fake_gpu(monkeypatch, tmp_path, gpu, 132, (9, 0))
    sel = selector.Selector()
    tables = selector.load_shipped_tables()
    for hidden in (4096, 5120, 7168):
        for norm in (False, True):
            key = selector.TuneKey(table_gpu, 132, hidden, "fp32", norm, __version__, "delayed").as_str()
            assert min(tables[key]) == 1
            for m in (1, 32, 8192):
                assert sel.choose(device, m, hidden, "fp32", norm, "delayed") == tables[key][m]


def test_tuner_of_the_delayed_seam(monkeypatch):
    """``seam="delayed"`` times ``mhc_fused_hc_delayed`` on sets with carried gates, compiles the kernels with the
    carried-gates flag and writes tables under the delayed seam's keys."""
    import torch

    from mhc_cute import benchmark as bm

    _fake_tuning_gpu(monkeypatch)
    _contract_passes(monkeypatch)
    def sets(m, *_):
        return [{"fn": torch.zeros(1), "residual_prev": torch.zeros(m, 4, 1)}]
    monkeypatch.setattr(bm, "make_sets", sets)
    monkeypatch.setattr(bm, "rotated_sets", sets)
    calls, variants = [], []
    monkeypatch.setattr(autotune, "precompile_candidates", lambda cands, precision, norm, v: variants.append(v))

    def call(name, precision, tactic, delayed=False):
        calls.append(delayed)
        return name

    def time_graph(name, sets):
        assert all("pre_mix_prev" in s for s in sets)
        return {"half_mma": 5.0, "triton": 4.0}[name]
    monkeypatch.setattr(bm, "mhc_cute_call", call)
    monkeypatch.setattr(bm, "time_graph", time_graph)
    tables = autotune.tune(torch.device("cuda", 0), [512], [2048], "fp32", False, ["half_mma", "triton"],
                           log=lambda *a: None, seam="delayed")
    (key, rows), = tables.items()
    assert selector.TuneKey.parse(key).seam == "delayed" and rows[2048].backend == "triton"
    assert calls and all(calls) and variants == [(("carried", "regular"),)]
    with pytest.raises(ValueError, match="seam"):
        autotune.tune(torch.device("cuda", 0), [512], [16], "fp32", False, ["triton"], seam="v41")


def test_tuner_drops_a_fast_but_wrong_pick(monkeypatch):
    import torch

    from mhc_cute import benchmark as bm

    _fake_tuning_gpu(monkeypatch)
    _contract_passes(monkeypatch, wrong={("all_fma", None)})
    monkeypatch.setattr(bm, "mhc_cute_call", lambda name, precision, tactic, delayed=False: name)
    monkeypatch.setattr(bm, "time_graph", lambda name, sets: {"all_fma": 3.0, "triton": 4.0}[name])
    monkeypatch.setattr(autotune, "candidate_tactics", lambda name, m, h, sms: [None])
    with pytest.warns(UserWarning, match="is wrong"):
        tables = autotune.tune(torch.device("cuda", 0), [512], [1], "fp32", False, ["all_fma", "triton"],
                               log=lambda *a: None, measure="back-to-back")
    (rows,) = tables.values()
    assert rows[1].backend == "triton"


def test_tuner_checks_after_all_timing(monkeypatch):
    """A float64 check slows the timings right after it (up to 8% on the H200), so no bucket is timed after one."""
    import torch

    from mhc_cute import accuracy, benchmark as bm

    _fake_tuning_gpu(monkeypatch)
    events = []
    monkeypatch.setattr(accuracy, "problem_of", lambda inputs, precision: inputs)
    monkeypatch.setattr(accuracy, "failure_of", lambda problem, name, tactic: events.append(("check", problem)))
    monkeypatch.setattr(bm, "mhc_cute_call", lambda name, precision, tactic, delayed=False: name)
    monkeypatch.setattr(bm, "time_graph", lambda name, sets: events.append(("time", sets[0])) or 1.0)
    monkeypatch.setattr(autotune, "candidate_tactics", lambda name, m, h, sms: [None])
    tables = autotune.tune(torch.device("cuda", 0), [512], [1, 100, 3000], "fp32", False, ["triton"],
                           log=lambda *a: None, measure="back-to-back")
    kinds = [kind for kind, _ in events]
    assert kinds == ["time"] * 3 + ["check"] * 3
    # each bucket's pick is checked on that bucket's own first input set
    assert [m for kind, m in events if kind == "check"] == [m for kind, m in events if kind == "time"]
    (rows,) = tables.values()
    assert sorted(rows) == sorted(m for kind, m in events if kind == "check")


def test_info_names_the_table_auto_uses(monkeypatch, tmp_path, capsys):
    import types

    import torch

    from mhc_cute import backends, cli

    monkeypatch.setenv("MHC_CUTE_CACHE_DIR", str(tmp_path))
    props = types.SimpleNamespace(name="NVIDIA H800", multi_processor_count=132, major=9, minor=0,
                                  total_memory=80 * 2**30)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: props)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev: (9, 0))
    monkeypatch.setattr(backends, "unavailable_reason", lambda name, dev: None)
    monkeypatch.setattr(selector, "SELECTOR", selector.Selector())
    assert cli.cmd_info(None) == 0
    out = capsys.readouterr().out
    assert "H=7168 fp32 norm=0: NVIDIA H100 80GB HBM3|132|H7168|fp32|norm0" in out and "a stand-in" in out
    assert "H=5120 fp32 norm=1: NVIDIA H100 80GB HBM3|132|H5120|fp32|norm1" in out


# --- mhc-cute precompile: every kernel auto may run, compiled ahead -------------------------------------------

def test_auto_candidates_cover_the_tables_and_the_defaults(monkeypatch, tmp_path):
    from mhc_cute import tactics

    monkeypatch.setenv("MHC_CUTE_CACHE_DIR", str(tmp_path))  # no user cache: the shipped tables only
    names = {t.name for _, t in autotune.auto_candidates(7168, 64, "fp32", 132)}
    picks = {c.tactic for key, rows in selector.load_shipped_tables().items() if "|132|H7168|fp32|" in key
             for b, c in rows.items() if b <= 64 and c.tactic}
    assert picks and picks <= names
    for m in range(1, 65):
        assert tactics.default_fma_tactic("half_fma", m, 7168, 132).name in names
        assert tactics.default_mma_tactic("half_mma", m, 7168, 132).name in names
    # another SM count: the H200's tables do not apply, only the defaults
    other = {t.name for _, t in autotune.auto_candidates(7168, 64, "fp32", 114)}
    assert other == {d(p, m, 7168, 114).name for m in range(1, 65)
                     for p, d in (("half_fma", tactics.default_fma_tactic), ("half_mma", tactics.default_mma_tactic))}


def test_precompile_command_fills_the_kernel_cache(tmp_path, monkeypatch):
    from mhc_cute import cli

    monkeypatch.setenv("MHC_CUTE_CACHE_DIR", str(tmp_path / "tables"))
    monkeypatch.delenv("MHC_CUTE_KERNEL_CACHE", raising=False)
    folder = tmp_path / "kernels"
    assert cli.main(["precompile", "--hidden", "512", "--max-m", "1", "--norm", "none", "--sm-count", "132",
                     "--cache", str(folder), "--ops", "mhc_head", "mhc_post"]) == 0
    # the default tactics of half_fma and half_mma at M = 1 (no table for H = 512) in the head's seam form, and the
    # post kernel
    assert sorted(p.name.split("_")[1] for p in folder.glob("*.o")) == ["fma", "mma", "post"]


def test_precompile_command_compiles_every_form_auto_may_run(tmp_path, monkeypatch, capsys):
    """By default every op of a forward pass: both seams in each form (V4.1's with carried and identity gates; the
    broadcast entry only where the path runs it at that H), the head's seam form, the post and the collapse (the
    collapse's prefetch as ``run_collapse`` chooses it)."""
    from mhc_cute import cli
    from mhc_cute.kernels import collapse, fma, mma, post

    monkeypatch.setenv("MHC_CUTE_CACHE_DIR", str(tmp_path / "tables"))
    specs = {"fma": [], "mma": [], "post": [], "collapse": []}
    for name, module in (("fma", fma), ("mma", mma), ("post", post), ("collapse", collapse)):
        monkeypatch.setattr(module, "precompile", lambda s, *a, name=name, **k: specs[name].extend(s) or list(s))
    assert cli.main(["precompile", "--hidden", "512", "320", "--max-m", "1", "--norm", "none", "bfloat16",
                     "--sm-count", "132", "--cache", str(tmp_path / "k")]) == 0
    total = sum(map(len, specs.values()))
    assert f"{total} CuTe kernel variants ready" in capsys.readouterr().out  # the broadcast entries skipped not counted
    assert set(cli.PRECOMPILE_OPS) == set(autotune.SEAM_VARIANTS) | {"mhc_post", "mhc_collapse"}
    tails = {()} | {(None, f) for f in ("no_post", "broadcast")} | {(s,) for s in ("carried", "identity")} \
        | {(s, f) for s in ("carried", "identity") for f in ("no_post", "broadcast")}
    want = {(h, norm, tail) for h in (512, 320) for norm in (None, "bfloat16") for tail in tails}
    assert {(h, norm, tuple(tail)) for _, h, norm, *tail in specs["fma"]} == \
        {w for w in want if not (w[0] == 320 and "broadcast" in w[2])}  # paths E/F: H % 256 for the entry
    assert {(h, norm, tuple(tail)) for _, h, _, norm, *tail in specs["mma"]} == want
    assert sorted(specs["post"]) == [320, 512]
    assert sorted(specs["collapse"], key=str) == sorted([(h, n) for h in (512, 320) for n in (None, "bfloat16")],
                                                        key=str)


def test_precompile_command_needs_a_folder_and_a_target(monkeypatch, capsys):
    import torch

    from mhc_cute import cli

    monkeypatch.delenv("MHC_CUTE_KERNEL_CACHE", raising=False)
    assert cli.main(["precompile", "--hidden", "512", "--sm-count", "132"]) == 2
    assert "--cache" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["precompile", "--hidden", "512", "--cache", "unused"]) == 2
    assert "--sm-count" in capsys.readouterr().err


_AUTO_AT_EVERY_M = """
import sys
import torch
from mhc_cute import mhc_fused_hc
from mhc_cute.accuracy import make_inputs
hidden, max_m = int(sys.argv[1]), int(sys.argv[2])
for m in range(1, max_m + 1):
    mhc_fused_hc(**make_inputs(m, hidden, device="cuda"))
torch.cuda.synchronize()
"""


@pytest.mark.gpu
@pytest.mark.slow
def test_precompiled_folder_covers_auto_on_this_gpu(tmp_path):
    """On a GPU: `mhc-cute precompile` for this GPU, then a fresh process calling `auto` at every M up to the
    bound with that folder as its kernel cache compiles nothing (a kernel it lacked would be compiled and added)."""
    import subprocess
    import sys

    folder = tmp_path / "kernels"
    env = dict(os.environ, MHC_CUTE_CACHE_DIR=str(tmp_path / "tables"), MHC_CUTE_KERNEL_CACHE=str(folder))
    env.pop("MHC_CUTE_BACKEND", None)
    env.pop("MHC_CUTE_TACTIC", None)
    subprocess.run([sys.executable, "-m", "mhc_cute.cli", "precompile", "--hidden", "4096", "--max-m", "40",
                    "--norm", "none", "--precision", "fp32"], env=env, check=True, timeout=1200)
    compiled = sorted(p.name for p in folder.glob("*.o"))
    assert compiled
    subprocess.run([sys.executable, "-c", _AUTO_AT_EVERY_M, "4096", "40"], env=env, check=True, timeout=600)
    assert sorted(p.name for p in folder.glob("*.o")) == compiled


@pytest.mark.gpu
def test_tuner_on_the_gpu_ranks_by_context(monkeypatch):
    """On a GPU: the contexts measure runs end to end (CUPTI timestamps after a non-PDL kernel and after a cuBLAS
    GEMM), scores each candidate by its slowest context, and stores the best correct one."""
    from dataclasses import replace

    import torch

    from mhc_cute import benchmark as bm, tactics

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    base = tactics.default_fma_tactic("half_fma", 16, 512, sms)
    cands = [base, replace(base, tokens_per_cta=4)]
    assert all(t.invalid_reason(512) is None for t in cands)
    monkeypatch.setattr(autotune, "candidate_tactics", lambda name, m, h, sm_count: cands)
    b2b, after = {}, {}
    mhc_cute_call, time_graph, time_after = bm.mhc_cute_call, bm.time_graph, bm.time_after

    def call_of(name, precision, tactic, delayed=False):
        call = mhc_cute_call(name, precision, tactic, delayed)
        call.tactic_name = tactic.name
        return call

    def graph_us(call, sets, reps=20):
        b2b[call.tactic_name] = time_graph(call, sets, reps)
        return b2b[call.tactic_name]

    def after_us(call, sets, predecessor, reps=5):
        timing = time_after(call, sets, predecessor, reps)
        assert 0 < timing.first_kernel_us < timing.after_us < 1000, timing
        after.setdefault(call.tactic_name, []).append(timing.after_us)
        return timing
    monkeypatch.setattr(bm, "mhc_cute_call", call_of)
    monkeypatch.setattr(bm, "time_graph", graph_us)
    monkeypatch.setattr(bm, "time_after", after_us)
    (rows,) = autotune.tune(dev, [512], [16], "fp32", False, ["half_fma"], log=lambda *a: None).values()
    choice = rows[16]
    assert choice.backend == "half_fma" and choice.tactic in {t.name for t in cands}
    assert sorted(after) == sorted(b2b) and all(len(v) == 2 for v in after.values())  # each candidate, context
    assert choice.us == pytest.approx(max([b2b[choice.tactic], *after[choice.tactic]]))


def test_readme_tables_show_the_context_columns_or_an_older_files_sep(tmp_path):
    """``bench/merge_measured.py`` renders a file of this bench with `auto`'s two context columns, and a file written
    before them (``sep_us``) with its one "auto sep" column."""
    import subprocess
    import sys

    from mhc_cute import benchmark as bm

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    new = [bm.Result("auto", 1, 512, graph_us=4.4, context_us={"after-kernel": 6.1, "after-gemm": 5.9}, eager_us=30.0,
                     floor_frac=0.1), bm.Result("half_fma", 1, 512, graph_us=4.5, floor_frac=0.1)]
    bm.write_json(new, str(tmp_path / "new.json"), 4e12, "Fake GPU", {})
    old = json.load(open(tmp_path / "new.json"))
    for r in old["results"]:
        r["sep_us"] = r.pop("context_us").get("after-kernel")
    json.dump(old, open(tmp_path / "old.json", "w"))
    env = dict(os.environ, PYTHONPATH=root)

    def rows(name):
        out = subprocess.run([sys.executable, os.path.join(root, "bench", "merge_measured.py"), str(tmp_path / name)],
                             env=env, capture_output=True, text=True, check=True).stdout
        return [line.strip("|").split(" | ") for line in out.splitlines() if line.startswith("|")]
    head, _, row = rows("new.json")
    assert dict(zip(head, row))["auto after kernel"] == "6.1" and dict(zip(head, row))["auto after GEMM"] == "5.9"
    head, _, row = rows("old.json")
    assert dict(zip(head, row))["auto sep"] == "6.1" and "auto after GEMM" not in head


def test_time_after_profiles_each_predecessor_alone_once(monkeypatch):
    """The predecessor's own kernel count comes from one profile of it alone, reused for every call timed after it;
    the call's time runs from the predecessor's last kernel end to the call's last kernel end."""
    from mhc_cute import benchmark as bm

    def predecessor(s):
        pass
    profiled = []

    def kernel_records(step, sets, reps):
        profiled.append(step is predecessor)
        pre = {"ts": 0.0, "dur": 2.0}
        return [[pre]] if step is predecessor else [[pre, {"ts": 1.5, "dur": 3.0}, {"ts": 5.0, "dur": 1.0}]] * reps
    monkeypatch.setattr(bm, "kernel_records", kernel_records)
    timings = [bm.time_after(lambda s: None, [{}], predecessor) for _ in range(3)]
    assert timings[0] == bm.AfterTiming(after_us=4.0, gap_us=-0.5, first_kernel_us=3.0)
    assert profiled == [True, False, False, False]


def test_ship_table_merges_a_later_tune_into_a_shipped_file():
    """bench/ship_table.py --into: the tune's rows of that GPU replace the file's rows of the same key and bucket,
    every other row stays, the sources are both kept and the compute capability carries over."""
    from conftest import bench_script

    key = "NVIDIA H100 80GB HBM3|132|H7168|fp32|norm0|v0.2.0|delayed"
    row = {"backend": "half_mma", "tactic": "half_mma:k4:m64:s3:fbw", "us": 1.0}
    shipped_file = {"format": 1, "source": "first tune.", "compute_capability": "9.0",
                    "tables": {key: {"256": row, "8192": row}}}
    new = dict(row, us=2.0)
    tuned = {"format": 1, "tables": {key: {"1": new, "8192": new}, key.replace("norm0", "norm1"): {"32": new},
                                     "NVIDIA H200|132|H7168|fp32|norm0|v0.2.0": {"1": new}}}
    with bench_script("ship_table.py") as ship:
        out = ship.shipped(tuned, "NVIDIA H100 80GB HBM3", "second tune.", None, shipped_file)
    assert out["tables"] == {key: {"1": new, "256": row, "8192": new}, key.replace("norm0", "norm1"): {"32": new}}
    assert list(out["tables"][key]) == ["1", "256", "8192"]
    assert out["source"] == "first tune. second tune." and out["compute_capability"] == "9.0"
