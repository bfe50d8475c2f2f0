"""tests/spawned_group.py: a rank that crashes by a signal (here os.abort) reruns its group once, from empty
output folders, the crashed try's kept beside them."""
import os
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
