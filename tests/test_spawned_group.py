"""tests/spawned_group.py: a rank that crashes by a signal (here os.abort) reruns its group once, from empty
output folders, the crashed try's kept beside them; ranks forked from the long-lived fork server still see
the starting test's environment and print into its capture."""
import os

import pytest

from tests.spawned_group import run_in_group


def _crash_once(rank, root):
    marker = os.path.join(root, "..", "crashed-once")
    if rank == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        os.abort()
    assert os.listdir(root) == [] or rank == 0
    return rank

def test_a_crashed_group_runs_once_more_from_empty_output_folders(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("1")
    assert run_in_group(_crash_once, 2, str(tmp_path / "out"), timeout_s=120) == [0, 1]
    assert (tmp_path / "out.crashed" / "x").exists()


def _cases_one_needs_a_missing_cpu_feature(rank, root):
    from tests.spawned_group import run_case

    def needs_avx512():  # the error oneDNN raises on an AVX2-only CPU, as the trainer wraps it
        try:
            raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert or "
                               "avx512bw, avx512vl and avx512dq")
        except RuntimeError as error:
            raise ValueError("engine build failed") from error

    run_case(os.path.join(root, "bf16"), needs_avx512)
    return run_case(os.path.join(root, f"fp32_{rank}"), lambda: open(os.path.join(root, f"done_{rank}"), "w").close()
                    or rank)


def test_a_case_needing_a_missing_cpu_feature_costs_that_case_not_the_group(tmp_path):
    import pytest

    from tests.spawned_group import run_case, skip_if_unsupported

    assert run_in_group(_cases_one_needs_a_missing_cpu_feature, 2, str(tmp_path), timeout_s=120) == [0, 1]
    assert (tmp_path / "done_0").exists() and (tmp_path / "done_1").exists()  # the later case still ran
    with pytest.raises(pytest.skip.Exception, match="case bf16 needs what this CPU lacks: RuntimeError: "
                                                    "mkldnn_reorder_linear_weight"):
        skip_if_unsupported(tmp_path / "bf16")
    skip_if_unsupported(tmp_path / "fp32_0")  # no marker: the test runs
    with pytest.raises(ZeroDivisionError):  # any other failure still fails the group
        run_case(tmp_path / "other", lambda: 1 / 0)
    assert not (tmp_path / "other").exists()


def _report_environment(rank, name):
    print(f"rank {rank} says hello")
    return os.environ.get(name)


@pytest.fixture(scope="module")
def server_started_before():
    """A group run before the test below sets its variable and captures its output: the fork server the
    ranks come from has neither (where no earlier test started it, this one does)."""
    assert run_in_group(_report_environment, 2, "SPAWNED_GROUP_PROBE", timeout_s=120) == [None, None]


def test_ranks_get_the_tests_environment_and_output_streams(server_started_before, monkeypatch, capfd):
    # Each rank must see this test's variable and print into this test's capture, as a spawned process would.
    monkeypatch.setenv("SPAWNED_GROUP_PROBE", "set-by-this-test")
    assert run_in_group(_report_environment, 2, "SPAWNED_GROUP_PROBE", timeout_s=120) == ["set-by-this-test"] * 2
    out = capfd.readouterr().out
    assert "rank 0 says hello" in out and "rank 1 says hello" in out
