"""Phase times from a calibration: asynchronous rollouts (standalone workers, staleness >= 1) hide generation
behind the trainer's own work, so the trainer waits only for the rest."""

from __future__ import annotations

import dataclasses

import pytest

from scalerl.bench.cost_model.collective_cost import LinkCost
from scalerl.bench.cost_model.step_projection import ComputeRates
from scalerl.bench.cost_model.step_traffic import Layout
from scalerl.plan.memory import PlanSetup
from scalerl.plan.timing import Calibration, phase_seconds, step_seconds
from tests.tiny import tiny_model_config

# Fixed costs only (no FLOP cost, no links): generation 8 decode steps x 0.05 s, update 4 micro-batches x 0.02 s,
# one old-log-prob pass x 0.01 s over 4 micro-batches; no AdamW, disk or link cost.
RATES = ComputeRates(gen_flops_per_s=float("inf"), train_flops_per_s=float("inf"),
                     forward_flops_per_s=float("inf"), other_s_per_row=0.0, gen_step_s=0.05, train_call_s=0.02,
                     forward_call_s=0.01)
LINK = LinkCost(0.0, float("inf"), "none")


def _seconds(staleness: int) -> dict[str, float]:
    setup = PlanSetup(model=tiny_model_config(), layout=Layout(rollout_workers=1, ranks_per_node=2), rows=16,
                      prompt_width=16, new_tokens=8, micro_rows=4, mini_rows=16, standalone=True, old_pass=True,
                      staleness=staleness)
    return phase_seconds(setup, Calibration(RATES, 0.0, 0.0, LINK, LINK))


def test_async_generation_is_hidden_behind_the_trainers_work():
    sync, async_ = _seconds(0), _seconds(1)
    trainer = 4 * 0.02 + 4 * 0.01  # update + old log-probs
    assert sync["generation"] == pytest.approx(8 * 0.05)
    assert sync["update"] == pytest.approx(4 * 0.02) and sync["old_log_prob"] == pytest.approx(4 * 0.01)
    # the trainer waits for what generation takes beyond its own work: 0.40 - 0.12 s
    assert async_["generation"] == pytest.approx(8 * 0.05 - trainer)
    assert step_seconds(async_) == pytest.approx(max(8 * 0.05, trainer))
    assert step_seconds(sync) == pytest.approx(8 * 0.05 + trainer)


def test_an_optimizer_step_is_a_fixed_part_plus_a_part_per_parameter():
    from scalerl.plan.timing import optimizer_step_fixed_s
    from tests.tiny import tiny_model

    # a step of 30,000 parameters that took 5 ms, at 2 ns per parameter: 4.94 ms are fixed (launches, the clip)
    assert optimizer_step_fixed_s(5e-3, 30_000, 2e-9) == pytest.approx(5e-3 - 30_000 * 2e-9)
    assert optimizer_step_fixed_s(1e-3, 10**9, 2e-9) == 0.0  # never negative
    cal = Calibration(RATES, 2e-9, 0.0, LINK, LINK, optimizer_step_s=4e-3)
    setup = PlanSetup(model=tiny_model_config(), layout=Layout(), rows=16, prompt_width=16, new_tokens=8,
                      micro_rows=4, mini_rows=8)  # 2 optimizer steps
    params = sum(p.numel() for p in tiny_model().parameters())
    update = phase_seconds(setup, cal)["update"]
    assert update == pytest.approx(4 * 0.02 + 2 * (params * 2e-9 + 4e-3))
    assert Calibration.from_dict(cal.to_dict()).optimizer_step_s == 4e-3


def test_the_runtime_probe_reads_its_own_peak_not_the_parents():
    # ru_maxrss carries the parent's resident set at the fork across exec: a plan that had built a large probe
    # model read it as the runtime of every rank. The probe reads the child's own VmHWM.
    import torch

    from scalerl.plan.timing import measure_runtime

    held = torch.ones(64 * 2**20)  # 256 MiB in this process when the probe forks
    probe = measure_runtime(None, ["data.num_train=16"])
    runtime, reward_s = probe.runtime_bytes, probe.reward_s
    assert probe.worked == "steps"  # two steps of the run's trainer on a 32-wide model ran (the runtime once it ran)
    assert 0 < probe.checkpoint_s < 30  # and its checkpoint save was timed
    # an asynchronous standalone config's settings are the one-process run's (they were refused: ConfigError)
    async_run = measure_runtime(None, ["data.num_train=16", "rollout.placement=standalone", "rollout.workers=2",
                                       "rollout.staleness=1", "rollout.stream_groups=true", "rollout.dtype=bf16"])
    assert async_run.worked == "steps"
    assert 0 < probe.host_step_s < 1  # data, advantages, metrics of a 4-row step: milliseconds
    cal = Calibration(RATES, 0.0, 0.0, LINK, LINK, host_step_s=0.25)
    setup = PlanSetup(model=tiny_model_config(), layout=Layout(), rows=16, prompt_width=16, new_tokens=8,
                      micro_rows=4, mini_rows=16)
    assert phase_seconds(setup, cal)["other"] == pytest.approx(0.25)  # in the step, as "other"
    assert Calibration.from_dict(cal.to_dict()).host_step_s == 0.25
    import resource
    parent_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert runtime < parent_peak - 200 * 2**20 < parent_peak and held.numel()
    assert 0 < reward_s < 0.1  # the built-in task's scorer: well under 100 ms a response


def test_a_colocated_sync_lays_the_decode_copy_out_again_and_a_save_has_a_fixed_cost():
    from scalerl.plan.memory import decode_layout_bytes
    from scalerl.plan.timing import time_layout_refresh
    from tests.tiny import tiny_model

    cal = Calibration(RATES, 0.0, 1e9, LINK, LINK, layout_refresh_s_per_byte=2e-9, checkpoint_fixed_s=0.3)
    colocated = PlanSetup(model=tiny_model_config(), layout=Layout(), rows=16, prompt_width=16, new_tokens=8,
                          micro_rows=4, mini_rows=16)
    standalone = dataclasses.replace(colocated, layout=Layout(rollout_workers=1, ranks_per_node=2), standalone=True)
    layout = decode_layout_bytes(colocated)
    assert layout > 0 and decode_layout_bytes(standalone) == 0  # workers hold their own copy
    assert phase_seconds(colocated, cal)["weight_sync"] == pytest.approx(layout * 2e-9)
    assert phase_seconds(standalone, cal)["weight_sync"] < layout * 2e-9  # the push, not a layout
    save = phase_seconds(colocated, cal)["checkpoint_save"]
    assert 0.3 < save < 0.3 + 0.01  # the fixed part + the tiny model's bytes at 1 GB/s
    again = Calibration.from_dict(cal.to_dict())
    assert (again.layout_refresh_s_per_byte, again.checkpoint_fixed_s) == (2e-9, 0.3)
    # measured on the built-in model: a positive time per byte, well under a second per GiB's worth of it here
    assert 0 < time_layout_refresh(tiny_model(), __import__("torch").float32) * 2**30 < 60
