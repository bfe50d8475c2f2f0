"""The trainers run the doctor's rules on their own step metrics (trainer.monitor_every): a healthy run logs
no warning, a starved one warns once with its fix, a rank slowed at world 2 is named as the straggler (from
comm accounting's waits), and the levels reach the metric sinks as health/*."""

import json
import logging
import time
from pathlib import Path

from scalerl.data.sources import PromptStream
from scalerl.trainer.rl_trainer import train
from scalerl.trainer.sft_trainer import train_sft


def _rows(output_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]


def test_healthy_rl_run_reports_levels_and_no_warning(tiny_config, length_reward, caplog):
    cfg = tiny_config("trainer.total_steps=4", "trainer.monitor_every=2", length_reward)
    with caplog.at_level(logging.WARNING, logger="scalerl.health"):
        train(cfg)
    assert [r.message for r in caplog.records if r.name == "scalerl.health"] == []
    rows = {r["step"]: r for r in _rows(cfg.trainer.output_dir)}
    health = {k: v for k, v in rows[4].items() if k.startswith("health/")}
    assert health["health/training/non_finite"] == 0.0 and health["health/resources/storage_io"] == 0.0
    assert set(health.values()) == {0.0}
    assert not any(k.startswith("health/") for k in rows[3])  # checked every 2 steps
    assert "timing_s/data" in rows[1] and "perf/update_tokens/max" in rows[1]


def test_a_starving_data_loader_warns_once_with_its_fix(tiny_config, monkeypatch, caplog):
    slow = PromptStream.next_batch

    def delayed(self):
        time.sleep(0.4)
        return slow(self)

    monkeypatch.setattr(PromptStream, "next_batch", delayed)
    cfg = tiny_config("trainer.total_steps=3", "trainer.monitor_every=1")
    with caplog.at_level(logging.WARNING, logger="scalerl.health"):
        train(cfg)
    warned = [r.message for r in caplog.records if "storage I/O" in r.message]
    assert warned and "fetching and encoding prompts" in warned[0] and "fix: read data.train_files" in warned[0]
    # once per status: a warning may escalate to a fault once (a loaded machine stretches the first step, so
    # the same 0.4 s is 50% of it and 79% of the next), but nothing repeats step after step
    statuses = [m.split(": ")[2] for m in warned]
    assert len(statuses) == len(set(statuses)) and statuses in (["warning"], ["fault"], ["warning", "fault"])
    rows = {r["step"]: r for r in _rows(cfg.trainer.output_dir)}
    assert all(rows[s]["health/resources/storage_io"] >= 1.0 for s in (1, 2, 3))


def test_sft_is_monitored_too(tiny_config):
    cfg = tiny_config("sft.steps=2", "trainer.monitor_every=1")
    train_sft(cfg)
    rows = [json.loads(line) for line in (Path(cfg.trainer.output_dir) / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["health/training/non_finite"] == 0.0 and "timing_s/data" in rows[-1]


def _train_twice(rank: int, output_dir: str, slow_rank: int) -> dict[str, list[str]]:
    """Two world-2 GRPO runs in one group, each checked once at its last step: healthy, then with
    ``slow_rank``'s reward delayed. Returns the health warnings this rank logged in each."""
    from scalerl.core.config import load_config
    from scalerl.data.rewards.computer import RewardComputer
    from tests.trainer.conftest import TINY

    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("scalerl.health").addHandler(handler)
    out = {}
    for name in ("healthy", "slowed"):
        if name == "slowed" and rank == slow_rank:
            compute = RewardComputer.compute

            def slow_compute(self, *args, compute=compute, **kwargs):
                time.sleep(0.6)
                return compute(self, *args, **kwargs)

            RewardComputer.compute = slow_compute
        cfg = load_config(None, [*TINY, f"trainer.output_dir={output_dir}/{name}", "trainer.total_steps=4",
                                 "trainer.monitor_every=4", "trainer.batch_size=8", "actor.ppo_mini_batch_size=16"])
        train(cfg)
        out[name], messages[:] = list(messages), []
    return out


def test_online_monitor_names_a_slow_rank_and_stays_quiet_without_one(tmp_path):
    from tests.spawned_group import run_in_group

    results = run_in_group(_train_twice, 2, str(tmp_path), 1)
    assert [r["healthy"] for r in results] == [[], []]
    (warning,) = results[0]["slowed"]
    assert "uneven work across ranks (stragglers)" in warning and "rank 1" in warning and "fix:" in warning
    assert results[1]["slowed"] == []  # only rank 0 logs
    rows = {r["step"]: r for r in _rows(tmp_path / "slowed")}
    assert rows[4]["health/compute/stragglers"] >= 1.0 and rows[4]["timing_s/busy/slowest_rank"] == 1.0
