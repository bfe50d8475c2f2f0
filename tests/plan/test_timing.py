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


def test_activation_checkpointing_pays_each_micro_batchs_forward_again_in_the_update():
    setup = PlanSetup(model=tiny_model_config(), layout=Layout(), rows=16, prompt_width=16, new_tokens=8,
                      micro_rows=4, mini_rows=16, epochs=2)
    cal = Calibration(RATES, 0.0, 0.0, LINK, LINK)
    plain = phase_seconds(setup, cal)
    recomputed = phase_seconds(setup.replace(activation_checkpointing=True), cal)
    assert plain["update"] == pytest.approx(2 * 4 * 0.02)  # 2 epochs x 4 micro-batches x a training call
    assert recomputed["update"] == pytest.approx(2 * 4 * (0.02 + 0.01))  # and a forward call again each
    assert {k: v for k, v in recomputed.items() if k != "update"} == {k: v for k, v in plain.items() if k != "update"}


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


def test_a_model_probed_with_fewer_layers_scales_its_optimizer_step_by_the_parameters(monkeypatch):
    # a 4-layer model probed at 1 layer: a step of the probe's parameters at 3 ns each (AdamW 2 ns, the clip 1)
    # stands for the whole model's at the same 3 ns; its fixed part is what AdamW's 2 ns leave, 1 ns a parameter
    # (scaled by the layers, the embedding's per-parameter time counted 2.5 times)
    from scalerl.plan import timing
    from scalerl.plan.memory import policy_counts
    from tests.tiny import tiny_model

    setup = PlanSetup(model=tiny_model_config(num_hidden_layers=4), layout=Layout(), rows=4, prompt_width=8,
                      new_tokens=2, micro_rows=4, mini_rows=4)
    counted = {}

    def step(model):
        counted["params"] = sum(p.numel() for p in model.parameters())
        return counted["params"] * 3e-9

    monkeypatch.setattr(timing, "PROBE_MAX_PARAMS", 1)  # any model is probed at one layer
    monkeypatch.setattr(timing, "time_optimizer_step", step)
    monkeypatch.setattr(timing, "PROBE_REPEATS", 1)
    _, fixed, _ = timing.probe_rates(setup, 2e-9)
    params = policy_counts(setup)[0]
    assert counted["params"] < params == sum(p.numel() for p in tiny_model(num_hidden_layers=4).parameters())
    assert fixed == pytest.approx(params * 1e-9)


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


def test_the_checkpoint_write_rate_is_timed_on_a_checkpoints_own_writes_and_leaves_nothing(tmp_path, monkeypatch):
    """A save's bytes go at the rate of torch.save + fsync + the manifest's sha256 (each called once on the
    probe's file, which is gone after), in the run's output directory."""
    from scalerl.checkpoint import atomic
    from scalerl.plan import timing

    called = []
    for name in ("save_torch_state", "sha256_of"):
        real = getattr(atomic, name)
        monkeypatch.setattr(atomic, name, lambda *a, real=real, name=name: called.append((name, a[-1])) or real(*a))
    rate = timing.checkpoint_write_rate(str(tmp_path / "run"), nbytes=4 * 2**20)
    assert 0 < rate < float("inf")
    assert [name for name, _ in called] == ["save_torch_state", "sha256_of"]
    assert called[0][1] == called[1][1] and called[0][1].parent == tmp_path  # the run's directory's nearest
    assert not list(tmp_path.iterdir())


def test_a_busy_machine_slows_the_ranks_by_what_they_add_to_it(tmp_path):
    from scalerl.plan.timing import cpu_contention, other_runnable

    assert cpu_contention(2, 1, 0.0, cores=2) == 1.0  # a core each
    assert cpu_contention(4, 1, 0.0, cores=2) == 2.0  # two ranks per core
    # one busy process: the probes ran beside it with a core each (1x), the two ranks share 2 cores with it
    assert cpu_contention(2, 1, 1.0, cores=2) == pytest.approx(1.5)
    assert cpu_contention(1, 1, 3.0, cores=2) == 1.0  # one rank: as loaded as its probes were
    stat = tmp_path / "stat"
    stat.write_text("cpu  1 2 3\nprocs_running 3\nprocs_blocked 0\n")
    assert other_runnable(samples=3, interval_s=0.0, stat_path=str(stat)) == 2.0  # less the reader itself
    assert other_runnable(samples=1, interval_s=0.0, stat_path=str(tmp_path / "absent")) == 0.0
    slow = dataclasses.replace(RATES, gen_step_s=0.05)
    setup = PlanSetup(model=tiny_model_config(), layout=Layout(), rows=16, prompt_width=16, new_tokens=8,
                      micro_rows=4, mini_rows=16)
    alone, busy = (phase_seconds(setup, Calibration(slow, 0.0, 0.0, LINK, LINK), c) for c in (1.0, 1.5))
    assert busy["generation"] == pytest.approx(1.5 * alone["generation"])


def test_fsdp_copies_go_with_their_collectives_and_the_layout_cost_with_its_phase():
    from scalerl.bench.cost_model.step_traffic import step_collectives
    from scalerl.plan.timing import (
        fsdp_buffer_bytes,
        fsdp_copy_bytes,
        layout_residual,
        step_shape,
    )

    setup = PlanSetup(model=tiny_model_config(), layout=Layout(dp_shard=2, ranks_per_node=2), rows=16,
                      prompt_width=16, new_tokens=8, micro_rows=4, mini_rows=16)
    step, _ = step_shape(setup)
    collectives = step_collectives(setup.model, step, setup.layout)
    gathers = sum(c.count * c.payload_bytes for c in collectives if (c.kind, c.op) == ("param", "all_gather"))
    scatters = sum(c.count * c.payload_bytes for c in collectives if (c.kind, c.op) == ("grad", "reduce_scatter"))
    assert gathers > 0 and scatters > 0
    # the shard copied in and the whole copied out (1/2 + 1); the gradients in and the reduced half out
    assert fsdp_copy_bytes(collectives) == pytest.approx({"param": 1.5 * gathers, "grad": 1.5 * scatters})
    # the copies are timed at the largest buffer FSDP allocates: a layer's parameters gathered whole
    largest = max(c.payload_bytes for c in collectives if (c.kind, c.op) == ("param", "all_gather"))
    assert fsdp_buffer_bytes(collectives) == largest > 0
    assert fsdp_buffer_bytes(step_collectives(setup.model, step, Layout(tp=2, ranks_per_node=2))) == 0.0
    base = Calibration(RATES, 0.0, 0.0, LINK, LINK)
    plain = phase_seconds(setup, base)
    copied = phase_seconds(setup, dataclasses.replace(base, copy_bytes_per_s=1e6))
    total_copy_s = 1.5 * (gathers + scatters) / 1e6
    assert sum(copied.values()) - sum(plain.values()) == pytest.approx(total_copy_s)
    assert copied["update"] - plain["update"] > 0.8 * total_copy_s  # training gathers most; generation once
    layout = phase_seconds(setup, dataclasses.replace(base, layout_s={"update": 0.25, "other": 0.01}))
    assert layout["update"] == pytest.approx(plain["update"] + 0.25)
    assert layout["other"] == pytest.approx(plain["other"] + 0.01)
    assert layout_residual({"update": 0.3, "generation": 0.1}, {"update": 0.1, "generation": 0.2}) == {
        "generation": 0.0, "old_log_prob": 0.0, "ref_log_prob": 0.0, "update": pytest.approx(0.2),
        "weight_sync": 0.0, "other": 0.0}  # never negative
    stored = dataclasses.replace(base, layout_s={"update": 0.25}, other_runnable=1.5, copy_bytes_per_s=7e9,
                                 intra_ops={"all_gather": LinkCost(1e-4, 4e8, "fit")})
    again = Calibration.from_dict(stored.to_dict())
    assert (again.layout_s, again.other_runnable, again.copy_bytes_per_s) == ({"update": 0.25}, 1.5, 7e9)
    assert again.intra_ops == {"all_gather": LinkCost(1e-4, 4e8, "fit")}


def test_the_layout_probe_says_why_it_failed_and_leaves_no_rank_behind(tmp_path):
    import time
    from pathlib import Path

    from scalerl.plan.timing import measure_layout_run
    from tests.tiny import tiny_overrides

    with pytest.raises(RuntimeError, match="exited 2"):
        measure_layout_run(None, ["actor.lrr=1e-6"], 1, 1)  # a misspelt key: the train command's own error
    marker = "trainer.seed=987651"  # on the command line of this run's processes only
    # a reward of 2 s a step: the probe's 16 steps cannot end within the limit, and its ranks are up by then
    slow = tmp_path / "slow_reward.py"
    slow.write_text("import time\n\ndef compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    time.sleep(2)\n    return 0.0\n")
    with pytest.raises(RuntimeError, match="did not finish in 10 s"):
        measure_layout_run(None, [*tiny_overrides(), marker, f"data.reward={slow}:compute_score"], 2, 1,
                           timeout_s=10)
    time.sleep(0.5)
    left = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if marker.encode() in cmdline.read_bytes():
                left.append(cmdline.parent.name)
        except OSError:
            pass
    assert not left, f"processes of the timed-out probe still running: {left}"


def test_a_cap_on_rows_decoding_at_once_pays_each_decode_steps_fixed_cost_once_per_round():
    # rollout.max_num_seqs=4 of 16 rows: four rounds of decode steps, each paying the fixed cost per step (a GPU
    # reads the weights once per step), where the FLOPs stay those of 16 rows; evaluation alike
    slow = dataclasses.replace(RATES, gen_step_s=0.05)
    setup = PlanSetup(model=tiny_model_config(), layout=Layout(), rows=16, prompt_width=16, new_tokens=8,
                      micro_rows=4, mini_rows=16, eval_rows=16)
    cal = Calibration(slow, 0.0, 0.0, LINK, LINK)
    free, capped = phase_seconds(setup, cal), phase_seconds(setup.replace(max_num_seqs=4), cal)
    assert capped["generation"] - free["generation"] == pytest.approx(3 * 8 * 0.05)
    assert capped["evaluation"] - free["evaluation"] == pytest.approx(3 * 8 * 0.05)
    # responses of 5 tokens on average: the rounds before the last cost the mean (a finished row's slot takes the
    # next row), the last runs to the longest (8)
    mean = phase_seconds(setup.replace(max_num_seqs=4, response_len=5), cal)
    assert mean["generation"] - phase_seconds(setup.replace(response_len=5), cal)["generation"] == pytest.approx(
        3 * 5 * 0.05)
