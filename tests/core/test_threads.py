"""The thread governor: free cores from the kernel's counters, the thread count that follows them, and
results that do not depend on it."""

from pathlib import Path

import torch

from scalerl.core import threads
from scalerl.core.threads import (
    CpuCounters,
    ThreadGovernor,
    cores_used_by_others,
    read_cpu_counters,
    threads_for,
)
from tests.tiny import tiny_overrides


def _fake_proc(root: Path, busy_ticks: int, idle_ticks: int, own_ticks: int) -> Path:
    (root / "self").mkdir(parents=True, exist_ok=True)
    # cpu user nice system idle iowait irq softirq steal guest guest_nice
    (root / "stat").write_text(f"cpu  {busy_ticks} 0 0 {idle_ticks} 0 0 0 0 0 0\ncpu0 1 2 3 4\n")
    own = ["S"] + ["0"] * 10 + [str(own_ticks), "0"] + ["0"] * 30  # fields after "(comm)"
    (root / "self" / "stat").write_text("1234 (python (x)) " + " ".join(own) + "\n")
    return root


def test_counters_are_read_from_proc(tmp_path):
    c = read_cpu_counters(_fake_proc(tmp_path, busy_ticks=500, idle_ticks=300, own_ticks=200))
    tick = threads._CLOCK_TICKS
    assert c.system_busy == 500 / tick and c.own == 200 / tick


def test_missing_proc_files_leave_torch_alone(tmp_path):
    assert read_cpu_counters(tmp_path / "nothing") is None
    before = torch.get_num_threads()
    assert ThreadGovernor(proc=tmp_path / "nothing").update(force=True) == before


def test_others_are_the_system_minus_this_process():
    a, b = CpuCounters(10.0, 4.0, 100.0), CpuCounters(14.0, 5.0, 102.0)  # 4 core-s busy, 1 ours, over 2 s
    assert cores_used_by_others(a, b) == 1.5


def test_thread_count_follows_the_free_cores():
    assert threads_for(available=2, others=0.0) == 2
    assert threads_for(available=2, others=0.4) == 2
    assert threads_for(available=2, others=0.6) == 1  # half a core taken counts as taken
    assert threads_for(available=2, others=5.0) == 1  # never below one
    assert threads_for(available=8, others=2.2) == 6


def test_governor_sets_torch_threads_from_the_counters(tmp_path, monkeypatch):
    proc = _fake_proc(tmp_path, busy_ticks=0, idle_ticks=0, own_ticks=0)
    original = torch.get_num_threads()
    monkeypatch.setattr(threads, "available_cpus", lambda: 2)
    clock = iter([0.0, 1.0, 2.0, 3.0, 4.0, 5.0])
    monkeypatch.setattr(threads.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(threads.time, "sleep", lambda s: None)
    try:
        tick = threads._CLOCK_TICKS
        _fake_proc(tmp_path, busy_ticks=0, idle_ticks=0, own_ticks=0)
        governor = ThreadGovernor(max_threads=2, proc=proc)  # first look: nothing busy -> 2
        assert torch.get_num_threads() == 2
        _fake_proc(tmp_path, busy_ticks=2 * tick, idle_ticks=0, own_ticks=1 * tick)  # others: 1 core
        assert governor.update(force=True) == 1 and torch.get_num_threads() == 1
        _fake_proc(tmp_path, busy_ticks=3 * tick, idle_ticks=tick, own_ticks=2 * tick)  # others idle again
        assert governor.update(force=True) == 2
    finally:
        torch.set_num_threads(original)


def test_results_do_not_depend_on_the_thread_count(tmp_path):
    """Why following the load is safe for reproducibility: on this CPU a training step gives bitwise the same
    weights at 1 and 2 threads (so resumes stay bitwise identical whatever the load did)."""
    from scalerl.core.config import load_config
    from scalerl.trainer.rl_trainer import RLTrainer

    weights, original = [], torch.get_num_threads()
    for n in (1, 2):
        cfg = load_config(None, tiny_overrides(
            "data.num_train=64", "data.num_val=0", "actor.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size=8",
            "trainer.logger=[]", f"trainer.cpu_threads={n}", f"trainer.output_dir={tmp_path / str(n)}",
        ))
        try:
            trainer = RLTrainer.from_config(cfg)
            trainer.train_step()
        finally:
            torch.set_num_threads(original)
        weights.append(trainer.policy.model.state_dict())
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
