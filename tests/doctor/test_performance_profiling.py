"""`--performance-profiling` at world 4 on gloo (data parallel, tiny model), by fault injection: one spawned
group runs the profile five times: healthy; rank 2 slowed by a delay in generation (straggler, named);
a data loader that sleeps on every rank (data wait); rank 0 alone generating long responses, without and
then with rollout balancing (data sharding imbalance, then cleared). Each must land on its leaf alone."""

from __future__ import annotations

import dataclasses
import time
from unittest import mock

import pytest

from scalerl.core.net import free_port
from tests.doctor.test_distributed_check import alarms
from tests.spawned_group import run_in_group
from tests.tiny import tiny_overrides

TINY = tiny_overrides("trainer.batch_size=8", "rollout.max_new_tokens=24", "actor.ppo_mini_batch_size=32",
                      "actor.ppo_micro_batch_size=8")
SCENARIOS = ("healthy", "straggler", "data_wait", "skewed", "skewed_balanced")
STRAGGLER_RANK, DELAY_S = 2, 1.5


def _profile(port: int, scratch: str, *overrides: str) -> dict:
    import os

    from scalerl.doctor.diagnose import DoctorOptions, diagnose

    os.environ["MASTER_PORT"] = str(port)
    options = DoctorOptions(distributed_check=False, profile=True, overrides=[*TINY, *overrides], steps=2, warmup=1,
                            join_timeout_s=30, timeout_s=300, scratch_dir=scratch, max_size=2**20)
    code, report = diagnose(options)
    return {"code": code, "report": report.to_json() if report is not None else None}


def _skewed_generate(rank: int):
    """Rank 0 never meets a stop token (responses run to max_new_tokens); the others stop at their first."""
    from scalerl.rollout.engines.builtin import BuiltinEngine

    original = BuiltinEngine.generate

    def generate(self, prompts, sampling):
        vocab = self.model.config.vocab_size
        stops = (vocab + 7,) if rank == 0 else tuple(range(vocab))  # an id never sampled keeps the stop votes
        return original(self, prompts, dataclasses.replace(sampling, stop_token_ids=stops))

    return mock.patch.object(BuiltinEngine, "generate", generate)


def _delayed(cls, name: str, seconds: float):
    original = getattr(cls, name)

    def delayed(self, *args, **kwargs):
        time.sleep(seconds)
        return original(self, *args, **kwargs)

    return mock.patch.object(cls, name, delayed)


def _scenarios(rank: int, ports: list[int], scratch: str) -> dict:
    from scalerl.data.sources import PromptStream
    from scalerl.rollout.engines.builtin import BuiltinEngine

    out = {"healthy": _profile(ports[0], scratch)}
    with _delayed(BuiltinEngine, "generate", DELAY_S if rank == STRAGGLER_RANK else 0.0):
        out["straggler"] = _profile(ports[1], scratch)
    with _delayed(PromptStream, "next_batch", 0.8):
        out["data_wait"] = _profile(ports[2], scratch)
    with _skewed_generate(rank):
        out["skewed"] = _profile(ports[3], scratch, "trainer.balance_batch=false")
        out["skewed_balanced"] = _profile(ports[4], scratch, "trainer.balance_batch=true")
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    scratch = str(tmp_path_factory.mktemp("doctor"))
    ports = [free_port() for _ in SCENARIOS]
    results = run_in_group(_scenarios, 4, ports, scratch, timeout_s=1200, init_group=False)
    return {name: [r[name] for r in results] for name in SCENARIOS}


def _finding(report: dict, leaf_id: str) -> dict:
    return next(f for b in report["tree"] for leaf in b["leaves"] if leaf["id"] == leaf_id for f in leaf["findings"]
                if f["status"] in ("warning", "fault"))


def test_healthy_profile_raises_nothing(runs):
    assert [r["code"] for r in runs["healthy"]] == [0, 0, 0, 0]
    report = runs["healthy"][0]["report"]
    assert alarms(report) == {}, alarms(report)
    profile = report["measurements"]["profile"]
    assert [r["rank"] for r in profile["per_rank"]] == [0, 1, 2, 3]
    phases = set(profile["per_rank"][0]["phases"])
    assert {"data", "gen", "reward", "old_log_prob", "adv", "balance", "update_actor", "other"} <= phases
    for r in profile["per_rank"]:
        assert r["busy_s"] + r["wait_s"] == pytest.approx(r["step_s"], rel=1e-6) and r["capacity_gb"] > 0
    assert profile["context"]["link_busbw"] > 0 and profile["context"]["dp_size"] == 4


def test_a_delayed_rank_is_the_straggler_named(runs):
    report = runs["straggler"][0]["report"]
    assert set(alarms(report)) == {"compute/stragglers"}, alarms(report)
    f = _finding(report, "compute/stragglers")
    assert f["ranks"] == [STRAGGLER_RANK] and f"rank {STRAGGLER_RANK}" in f["summary"] and "gen" in f["summary"]
    assert f["evidence"]["ratio"] > 2


def test_a_sleeping_data_loader_is_a_data_wait(runs):
    report = runs["data_wait"][0]["report"]
    assert alarms(report) == {"resources/storage_io": "fault"}, alarms(report)
    f = _finding(report, "resources/storage_io")
    assert f["rule"] == "data_wait" and "data.train_files" in f["fix"]


def test_skewed_lengths_are_an_imbalance_until_balancing_is_on(runs):
    skewed = runs["skewed"][0]["report"]
    # The forced lengths also make a generation tail (mean far below max); that leaf may warn beside it.
    tail = {"rollout/generation_tail"}
    assert "compute/data_sharding" in alarms(skewed) and set(alarms(skewed)) - tail == {"compute/data_sharding"}, \
        alarms(skewed)
    f = _finding(skewed, "compute/data_sharding")
    assert "trainer.balance_batch=true" in f["fix"] and f["evidence"]["max_over_mean"] > 1.5
    balanced = runs["skewed_balanced"][0]["report"]
    assert set(alarms(balanced)) - tail == set(), alarms(balanced)
    leaf = next(leaf for b in balanced["tree"] for leaf in b["leaves"] if leaf["id"] == "compute/data_sharding")
    assert leaf["status"] == "ok" and leaf["findings"][0]["evidence"]["balance/token_imbalance_before"] > 1.5
