"""bench/gpu_tests_summary.py: the outcomes of GPU test runs split over several calls (no GPU needed)."""

from conftest import bench_script

IDS = ["tests/test_a.py::t[half_mma-1-512]", "tests/test_a.py::t[triton-8192-5120-False]",
       "tests/test_b.py::u[mhc_post-cute-1-512-True]", "tests/test_b.py::v"]
FIRST = ["[gw0] [ 10%] PASSED tests/test_a.py::t[half_mma-1-512] ",
         "[gw1] [ 20%] FAILED tests/test_a.py::t[triton-8192-5120-False] ", "some other line"]
SECOND = ["tests/test_a.py::t[triton-8192-5120-False] PASSED", "tests/test_b.py::v SKIPPED (no second GPU)"]


def test_the_last_outcome_wins_and_the_rest_is_what_no_log_reached(tmp_path, capsys):
    with bench_script("gpu_tests_summary.py") as summary:
        assert summary.outcomes(FIRST + SECOND) == {IDS[0]: "PASSED", IDS[1]: "PASSED", IDS[3]: "SKIPPED"}
        assert [summary.backend_of(i) for i in IDS] == ["half_mma", "triton", "cute", "-"]
        ids, first, second, rest = (tmp_path / n for n in ("ids", "first", "second", "rest"))
        ids.write_text("\n".join(IDS) + "\n")
        first.write_text("\n".join(FIRST) + "\n")
        second.write_text("\n".join(SECOND) + "\n")
        assert summary.main(["--ids", str(ids), str(first), "--rest", str(rest)]) == 1  # a failure
        assert rest.read_text().splitlines() == IDS[2:]
        assert summary.main(["--ids", str(ids), str(first), str(second), "--rest", str(rest)]) == 0
        assert rest.read_text().splitlines() == [IDS[2]]
        out = capsys.readouterr().out.split("totals: ")[-1]
        assert out.startswith("NOT RUN 1, PASSED 2, SKIPPED 1")
        assert "  cute NOT RUN 1" in out and "       1 tests/test_b.py::u" in out
