"""Standalone rollout workers running agent episodes (rollout.agent.env): the worker builds the environment from
the config, runs `AgentLoop` on its own engine and sends trajectories back over the worker protocol.

One spawned group (a trainer-like rank 0, an in-order agent worker rank 1, a streaming one rank 2,
rollout.partial=true) runs the protocol scenarios; the checks run here on what rank 0 returns:

- in order, a seeded request's trajectories are the ones the same loop gives in one process, token for token
  (prompt, response, loss mask, log-probs, the environment's rewards), tagged with the pushed version;
- streaming, a weight push that lands while the episodes wait in their environment's first step reaches their
  later turns: the first turn keeps the version before the push, the last the version after it, each token its
  own (a trajectory spanning a push keeps its per-segment versions), masks and lengths agreeing.

Then whole runs (`train`): a standalone agent run trains what the colocated agent run trains (same scores,
lengths and turns; weights within 1e-5), and an asynchronous one (staleness 1, partial rollouts) trains within
its bound with the agent metrics reported.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

from tests.spawned_group import run_in_group
from tests.tiny import tiny_overrides

MAX_NEW = 6
TURNS = 3
ENV = textwrap.dedent('''
    import os
    import tempfile
    import time


    class Turns:
        """Three turns: the row's prompt, then "more" twice. With a "gate" in the row, the first step marks its
        arrival in the gate's folder and waits (60 s at most) for the gate file before it answers."""

        def reset(self, row):
            self.row, self.turn = row, 0
            return [{"role": "user", "content": row["prompt"]}]

        def step(self, message):
            self.turn += 1
            gate = self.row.get("gate")
            if gate and self.turn == 1:
                tempfile.mkstemp(dir=os.path.dirname(gate), prefix="arrived_")
                deadline = time.monotonic() + 60
                while not os.path.exists(gate) and time.monotonic() < deadline:
                    time.sleep(0.02)
                time.sleep(0.3)  # the push announced before the gate opened has reached the worker's inbox
            if self.turn < 3:
                return [{"role": "user", "content": "more"}], None, False, {}
            odd = int(self.row["ground_truth"]) % 2
            return [], (None if odd else float(len(message["content"]))), True, {}
''')


def _config(env: str, *changes: str) -> list[str]:
    return tiny_overrides(f"rollout.agent.env={env}:Turns", f"rollout.agent.max_turns={TURNS}",
                          f"rollout.max_new_tokens={MAX_NEW}", "rollout.placement=standalone",
                          "data.reward=scalerl.verify:response_length_reward", *changes)


ROWS = [{"prompt": f"{a}+{a + 1}=", "ground_truth": str(2 * a + 1 + (a % 2))} for a in range(1, 5)]


def _scenarios(rank: int, out: str) -> dict | None:
    import time
    from types import SimpleNamespace

    import torch.distributed as dist

    from scalerl.comm.counting.accounting import CommCounter
    from scalerl.comm.weights.channel import BroadcastChannel
    from scalerl.comm.weights.sender import WeightSender
    from scalerl.core.config import load_config
    from scalerl.models.load import load_model_and_tokenizer
    from scalerl.rollout.agent.source import agent_limits, agent_loop
    from scalerl.rollout.engines.builtin import BuiltinEngine
    from scalerl.rollout.engines.engine import SamplingParams, left_pad
    from scalerl.rollout.sources import workers_compute_dtype
    from scalerl.rollout.trajectory import trajectories_to_output
    from scalerl.rollout.worker.protocol import WorkerDriver
    from scalerl.rollout.worker.worker import RolloutWorker

    env = f"{out}/turns_env.py"
    in_order = load_config(None, _config(env))
    streaming = load_config(None, _config(env, "rollout.staleness=1", "rollout.partial=true"))
    group = dist.new_group([0, 1, 2])
    cpu = torch.device("cpu")
    if rank:
        RolloutWorker(in_order if rank == 1 else streaming, cpu, group).serve()
        return None
    cfg = in_order
    model, tokenizer = load_model_and_tokenizer(cfg.model, None, cpu, cfg.trainer.seed)
    model.eval().requires_grad_(False)
    pad = tokenizer.pad_token_id
    driver = WorkerDriver(SimpleNamespace(rollout_ranks=[1, 2], device=cpu, comm=CommCounter()))
    sender = WeightSender.from_config(cfg.weight_sync, "fp32", BroadcastChannel(group, src=0))
    version = 0

    def push():
        nonlocal version
        driver.announce_weights(version)
        sender.sync(list(model.named_parameters()))
        version += 1

    def request(worker, step, rows, sampling):
        ids, mask = left_pad([tokenizer.encode(r["prompt"]) for r in rows], pad)
        driver.request_generation(worker, step, sampling, ids, mask.sum(-1), tokens=0, rows=rows)

    results = {}
    push()
    push()  # the workers hold version 1
    rows = [r for r in ROWS for _ in range(2)]  # 2 samples per prompt, as the trainer sends them
    sampling = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, seed=5, row_offset=2, total_rows=10,
                              stop_token_ids=[tokenizer.eos_token_id])

    # 1. In order: the worker's episodes are the ones the same loop gives here, on the same weights.
    request(1, 1, rows, sampling)
    reply = driver.collect(1, 2)
    engine = BuiltinEngine(model, pad, max_num_seqs=cfg.rollout.max_num_seqs,
                           dtype=workers_compute_dtype(cfg.rollout.dtype, cfg.trainer.precision))
    r = cfg.rollout
    loop = agent_loop(cfg, tokenizer, engine.continuous_engine(agent_limits(cfg).max_total_tokens, r.max_new_tokens,
                                                               r.max_num_seqs or cfg.trainer.batch_size * r.n))
    trajectories, _ = loop.run(rows, sampling, row_offset=2, total_rows=10)
    results["in_order"] = {"worker": reply.out, "local": trajectories_to_output(trajectories, pad),
                           "metrics": reply.metrics, "version": version - 1}

    # 2. Streaming: a push lands while every episode waits in its first environment step.
    gate = Path(out) / "gate" / "open"
    gate.parent.mkdir()
    gated = [{**row, "gate": str(gate)} for row in rows]
    request(2, 2, gated, sampling)
    deadline = time.monotonic() + 120
    while len(list(gate.parent.glob("arrived_*"))) < len(rows) and time.monotonic() < deadline:
        time.sleep(0.02)
    arrived = len(list(gate.parent.glob("arrived_*")))
    before = version - 1
    driver.announce_weights(version)
    gate.touch()
    with torch.no_grad():
        model.norm.weight.mul_(-1.5)  # new logits: the later turns sample from other weights
    sender.sync(list(model.named_parameters()))
    version += 1
    results["streaming"] = {"out": driver.collect(2, 2).out, "before": before, "after": version - 1,
                            "arrived": arrived, "rows": len(rows)}
    driver.stop()
    return results


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory):
    out = tmp_path_factory.mktemp("agent_worker")
    (out / "turns_env.py").write_text(ENV)
    return run_in_group(_scenarios, 3, str(out), timeout_s=600)[0]


def _rows(out):
    """Per row: response ids, loss mask, log-probs and versions over its real tokens."""
    n = out.response_mask.sum(-1).tolist()
    return [(out.response_ids[i, :k], out.loss_mask[i, :k], out.logprobs[i, :k], out.weight_versions[i, :k])
            for i, k in enumerate(n)]


def test_a_standalone_worker_runs_the_episodes_one_process_runs(scenarios):
    worker, local = scenarios["in_order"]["worker"], scenarios["in_order"]["local"]
    assert torch.equal(worker.prompt_ids, local.prompt_ids) and torch.equal(worker.prompt_mask, local.prompt_mask)
    assert torch.equal(worker.response_mask, local.response_mask)
    assert torch.equal(worker.response_ids * worker.response_mask, local.response_ids * local.response_mask)
    assert torch.equal(worker.loss_mask, local.loss_mask)
    assert (worker.logprobs - local.logprobs).abs().max() < 1e-5
    assert worker.finish_reasons == local.finish_reasons
    assert [r.get("env_reward") for r in worker.reward_inputs] == [r["env_reward"] for r in local.reward_inputs]
    assert any(r.get("env_reward") is None for r in worker.reward_inputs)  # odd rows: the run's reward scores
    assert any(r.get("env_reward") is not None for r in worker.reward_inputs)
    version = scenarios["in_order"]["version"]
    for ids, loss, logprobs, versions in _rows(worker):
        assert len(ids) == len(loss) == len(logprobs) == len(versions)
        assert 0 < loss.sum() < len(loss)  # engine turns trained, the user's "more" turns not
        assert torch.equal(versions, torch.where(loss.bool(), version, -1).to(versions.dtype))
    metrics = scenarios["in_order"]["metrics"]
    assert metrics["agent/turns/max"] == TURNS and metrics["agent/environment_tokens"] > 0


def test_a_push_mid_trajectory_keeps_each_segments_version(scenarios):
    s = scenarios["streaming"]
    assert s["arrived"] == s["rows"]  # every episode waited in its first step while the push went out
    before, after = s["before"], s["after"]
    for ids, loss, logprobs, versions in _rows(s["out"]):
        assert len(ids) == len(loss) == len(logprobs) == len(versions)
        assert torch.equal(loss.bool(), versions >= 0)  # a version exactly on the engine's tokens
        generated = versions[versions >= 0].tolist()
        segments, at = [], 0  # the generated runs, in order
        for trained, run in _runs(loss.tolist()):
            if trained:
                segments.append(versions[at : at + run].tolist())
            at += run
        assert len(segments) == TURNS
        assert set(segments[0]) == {before} and set(segments[-1]) == {after}
        assert generated == sorted(generated)  # versions only go forward along the trajectory


def _runs(mask: list[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for m in mask:
        if out and out[-1][0] == m:
            out[-1] = (m, out[-1][1] + 1)
        else:
            out.append((m, 1))
    return out


# ------------------------------------------------------------------------------------------- whole runs
def _train(out: str, changes: list[str]) -> None:
    from scalerl.core.config import load_config
    from scalerl.trainer.rl_trainer import train

    train(load_config(None, [*_config(f"{Path(out).parent}/turns_env.py", *changes), f"trainer.output_dir={out}"]))


def _world2_runs(rank: int, out: str) -> None:
    _train(f"{out}/standalone", ["trainer.eval_every=2"])
    _train(f"{out}/async", ["rollout.staleness=1", "rollout.partial=true", "trainer.total_steps=3"])
    _train(f"{out}/ddp", ["rollout.placement=colocated", "parallel.dp_replicate=2"])  # both ranks train


def _sharded_trainers(rank: int, out: str) -> None:
    """Two trainer ranks (FSDP2, then tensor parallel) and one worker: the worker holds whole weights."""
    _train(f"{out}/fsdp", ["parallel.dp_replicate=1", "parallel.dp_shard=2", "data.num_val=0"])
    _train(f"{out}/tp", ["parallel.dp_replicate=1", "parallel.tp=2", "data.num_val=0"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("agent_runs")
    (out / "turns_env.py").write_text(ENV)
    _train(str(out / "colocated"), ["rollout.placement=colocated", "trainer.eval_every=2"])
    run_in_group(_world2_runs, 2, str(out), timeout_s=600)
    run_in_group(_sharded_trainers, 3, str(out), timeout_s=600)
    return out


def _metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if json.loads(x)["step"] > 0]


def test_a_standalone_agent_run_evaluates_in_episodes_as_the_colocated_one_does(runs):
    """The workers run the training episodes; the trainer evaluates on its own engine, in episodes of the same
    environment (not one answer per prompt): the colocated run's evaluation, value for value."""
    def evaluation(run: str) -> dict:
        (last,) = [r for r in _metrics(runs / run) if "val/score/mean" in r]
        return {k: v for k, v in last.items() if k.startswith("val/")}

    colocated, standalone = evaluation("colocated"), evaluation("standalone")
    assert standalone == pytest.approx(colocated, rel=1e-6)
    assert standalone["val/response_length/mean"] > MAX_NEW  # several turns per answer: episodes, not one reply


@pytest.mark.parametrize("run", ["standalone", "ddp", "fsdp", "tp"])
def test_an_agent_run_trains_what_the_single_process_colocated_one_trains(runs, run):
    """Standalone workers, and the trainer's layouts (colocated DDP over 2 ranks; FSDP2 and tensor parallel over 2
    trainer ranks with a worker, whose agent metrics each rank reports as its share): the same episodes, scores
    and weights (`scalerl verify`'s distributed = single, for an agent run)."""
    from safetensors.torch import load_file

    colocated, other = _metrics(runs / "colocated"), _metrics(runs / run)
    assert len(other) == len(colocated) == 2
    for key in ("critic/score/mean", "response_length/mean", "agent/turns/mean", "agent/turns/max",
                "agent/generated_tokens", "agent/environment_tokens"):
        assert [r[key] for r in other] == pytest.approx([r[key] for r in colocated], rel=1e-6), key
    a, b = (load_file(str(runs / r / "final" / "model.safetensors")) for r in ("colocated", run))
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5


def test_colocated_agents_refuse_sharded_weights_naming_the_fix():
    from scalerl.core.config import ConfigError, load_config

    for layout in ("parallel.dp_shard=2", "parallel.tp=2"):
        with pytest.raises(ConfigError, match="rollout.placement=standalone"):
            load_config(None, tiny_overrides("rollout.agent.env=chat", "parallel.dp_replicate=1", layout))
        with pytest.raises(ConfigError, match="data.num_val=0"):  # standalone: evaluation needs whole weights
            load_config(None, tiny_overrides("rollout.agent.env=chat", "rollout.placement=standalone",
                                             "parallel.dp_replicate=1", layout))
        load_config(None, tiny_overrides("rollout.agent.env=chat", "rollout.placement=standalone",
                                         "parallel.dp_replicate=1", "data.num_val=0", layout))  # the fix it names


def test_an_asynchronous_agent_run_trains_within_its_bound(runs):
    rows = _metrics(runs / "async")
    assert len(rows) == 3
    assert all(r["rollout/dropped_stale"] == 0 and r["rollout/staleness/max"] <= 1 for r in rows)
    assert all(r["agent/turns/max"] == TURNS for r in rows)
    assert rows[-1]["rollout/staleness/mean"] > 0  # rollouts ran a step ahead of the update


def test_the_endpoint_routes_stay_colocated_on_the_builtin_engine():
    from scalerl.core.config import ConfigError, load_config

    for change in ("rollout.placement=standalone", "rollout.engine=vllm"):
        with pytest.raises(ConfigError, match="rollout.placement=colocated and rollout.engine=builtin"):
            load_config(None, tiny_overrides("rollout.agent.env=program", "rollout.agent.program=agent.py", change))
