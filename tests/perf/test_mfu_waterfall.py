"""The MFU waterfall: on synthetic step metrics where every slice is known by construction, each slice comes
out at its value and the slices and the ideal sum to the whole exactly; time inside a slice's own phase is
not counted again in another (the weight sync's collective wait), and a split of the waits that would count
time twice is caught; then a real run of the tiny model, whose timers must cover the step within a few
percent and whose padding counters must count the update's real tokens."""

from __future__ import annotations

import pytest

from scalerl.perf.mfu_waterfall import (
    SLICES,
    CollectiveWaitSplit,
    MfuWaterfall,
    pipeline_bubble_share,
    run_waterfall,
    step_waterfall,
)
from tests.tiny import tiny_overrides

# One step, seconds: 10 s of step with 9.5 s under phase timers (0.5 s untimed), an evaluation (1 s) and a
# save (0.5 s) charged to it. Gradient all-reduce waits 1.0 s on the mean rank, 0.6 s on the rank that
# waited least (the transfer); the metrics all-reduce 0.1 s on every rank. The weight sync's wait (0.35 s)
# lies inside its own phase (0.4 s). Responses average 6 of the longest 8 tokens; the update computed 1000
# token slots for 800 real tokens.
STEP = {
    "timing_s/step": 10.0, "perf/mfu": 0.05,
    "timing_s/data": 0.3, "timing_s/gen": 3.0, "timing_s/reward": 0.2, "timing_s/old_log_prob": 0.5,
    "timing_s/adv": 0.1, "timing_s/update_actor": 5.0, "timing_s/update_weights": 0.4,
    "timing_s/eval": 1.0, "timing_s/save": 0.5,
    "timing_s/comm/grad": 1.0, "timing_s/comm/grad/min": 0.6, "timing_s/comm/grad/max": 1.4,
    "timing_s/comm/metrics": 0.1, "timing_s/comm/metrics/min": 0.1,
    "timing_s/comm/weight_sync": 0.35, "timing_s/comm/weight_sync/min": 0.35,
    "response_length/mean": 6.0, "response_length/max": 8.0,
    "perf/token_slots/actor": 1000.0, "perf/real_tokens/actor": 800.0,
}
KNOWN = {
    "eval": 1.0, "checkpoint": 0.5, "data": 0.3, "reward": 0.2, "weight_sync": 0.4,
    "comm": 0.6 + 0.1,  # the least-waiting rank's waits: grad and metrics, not the weight sync's
    "imbalance": 1.0 - 0.6,  # the mean rank's grad wait beyond the least
    "bubble": 0.0,
    "long_tail": (1 - 6 / 8) * 3.0,  # idle decode slots of generation's time
    "padding": (1 - 800 / 1000) * (5.0 - 1.0),  # padded share of the update's time less its waits
    # the compute phases (gen, old log-probs, advantages, update) less the ideal and every slice inside them
    "compute": (3.0 + 0.5 + 0.1 + 5.0) - 0.5 - 0.7 - 0.4 - 0.75 - 0.8,
    "unattributed": 10.0 - 9.5,
}


def test_every_slice_comes_out_at_its_known_value_and_they_sum_to_the_whole():
    waterfall = step_waterfall(STEP)
    assert waterfall.whole_s == pytest.approx(11.5)
    assert waterfall.ideal_s == pytest.approx(0.5)
    for key, seconds in KNOWN.items():
        assert waterfall.seconds[key] == pytest.approx(seconds), key
    assert set(waterfall.seconds) == {key for key, _ in SLICES}
    assert waterfall.ideal_s + sum(waterfall.seconds.values()) == pytest.approx(waterfall.whole_s)
    assert waterfall.achieved_mfu == pytest.approx(0.5 / 11.5)
    assert waterfall.attributed_share == pytest.approx(11.0 / 11.5)
    assert waterfall.check() == []  # 4.3% untimed: within the 5% tolerance
    rows = waterfall.rows()
    assert [r["key"] for r in rows] == ["peak", *KNOWN, "achieved"]
    assert rows[-2]["level"] == pytest.approx(waterfall.achieved_mfu)  # the waterfall lands on the achieved MFU


def test_compute_below_peak_splits_by_phase_with_the_phases_own_mfu():
    """Generation ran at 5% of peak over its 3 s (0.15 s ideal), the update at 5% over 5 s (0.25 s): what is
    left of each after its waits and its own slices is its compute below peak; the rest of the slice is the
    other compute phases' (old log-probs, advantages: 0.6 s less their 0.1 s ideal and the metrics wait)."""
    waterfall = step_waterfall({**STEP, "perf/mfu/gen": 0.05, "perf/mfu/update": 0.05})
    by_phase = waterfall.compute_by_phase
    assert by_phase == pytest.approx({"generation": 3.0 - 0.75 - 0.15, "update": 5.0 - 1.0 - 0.8 - 0.25})
    assert waterfall.seconds["compute"] - sum(by_phase.values()) == pytest.approx(0.6 - 0.1 - 0.1)
    assert step_waterfall(STEP).compute_by_phase == {}  # without the phases' MFU: not split
    assert MfuWaterfall.from_json(waterfall.to_json()).compute_by_phase == by_phase


def test_the_weight_sync_wait_is_not_counted_again_as_exposed_communication():
    """Its collective wait (0.35 s) is inside update_weights, which the weight-sync slice holds whole: counted
    again as communication, the exposed-communication slice would read 1.05 s and compute 5.1 s."""
    waterfall = step_waterfall(STEP)
    assert waterfall.seconds["comm"] == pytest.approx(0.7)
    assert waterfall.seconds["weight_sync"] == pytest.approx(0.4)
    assert waterfall.seconds["compute"] == pytest.approx(KNOWN["compute"])
    without_sync_wait = step_waterfall({k: v for k, v in STEP.items() if "weight_sync" not in k})
    assert without_sync_wait.seconds == waterfall.seconds


def test_a_wait_split_that_counts_time_twice_is_caught():
    """Waits attributed beyond the compute phases' time (here: the host phases' time counted as collective
    waits as well) drive the compute slice below zero, which the check names."""
    double = CollectiveWaitSplit(transfer_s=0.7 + 8.0, peers_s=0.4, update_s=1.0)
    waterfall = step_waterfall(STEP, waits=double)
    assert waterfall.ideal_s + sum(waterfall.seconds.values()) == pytest.approx(waterfall.whole_s)
    problems = waterfall.check()
    assert any("compute below peak" in p and "counted in two slices" in p for p in problems), problems


def test_a_wait_inside_a_host_phase_counts_once_as_communication():
    """The doctor's barrier ends every phase: a rank that waits there for the slowest waits inside its data
    phase. That wait moves from the data slice to the imbalance slice; compute is untouched."""
    plain = step_waterfall(STEP)
    split = CollectiveWaitSplit(transfer_s=0.7, peers_s=0.4 + 0.25, update_s=1.0, host_s={"data": 0.25})
    waterfall = step_waterfall(STEP, waits=split)
    assert waterfall.seconds["data"] == pytest.approx(0.3 - 0.25)
    assert waterfall.seconds["imbalance"] == pytest.approx(0.4 + 0.25)
    assert waterfall.seconds["compute"] == pytest.approx(plain.seconds["compute"])
    assert waterfall.ideal_s + sum(waterfall.seconds.values()) == pytest.approx(waterfall.whole_s)


def test_the_step_timers_per_phase_waits_place_them():
    """A multi-rank step reports each phase's collective waits (``timing_s/comm_in/<phase>``): generation's
    stop votes (kind ``metrics``) then come off generation's time before its long tail is taken, a wait
    inside the data phase off the data slice, and the 0.1 s of the kinds' 1.1 s that no phase holds (the
    previous step's metric reduction, after its counters were read) is not the step's."""
    placed = {**STEP, "timing_s/comm_in/gen": 0.05, "timing_s/comm_in/update_actor": 0.9,
              "timing_s/comm_in/data": 0.05, "timing_s/comm_in/update_weights": 0.35,
              "timing_s/comm_in/gen/max": 9.0}
    waterfall = step_waterfall(placed)
    assert waterfall.seconds["long_tail"] == pytest.approx(0.25 * (3.0 - 0.05))
    assert waterfall.seconds["padding"] == pytest.approx(0.2 * (5.0 - 0.9))
    assert waterfall.seconds["data"] == pytest.approx(0.3 - 0.05)
    assert waterfall.seconds["comm"] == pytest.approx(0.7 / 1.1)
    assert waterfall.seconds["imbalance"] == pytest.approx(0.4 / 1.1)
    assert waterfall.seconds["compute"] == pytest.approx(8.6 - 0.5 - 0.95 - 0.7375 - 0.82)
    assert waterfall.ideal_s + sum(waterfall.seconds.values()) == pytest.approx(waterfall.whole_s)


def test_untimed_time_beyond_the_tolerance_fails_the_check():
    waterfall = step_waterfall({**STEP, "timing_s/step": 12.0})  # 2.5 s of 13.5 under no timer
    assert waterfall.seconds["unattributed"] == pytest.approx(2.5)
    (problem,) = waterfall.check()
    assert "not timed" in problem and "81.5%" in problem


def test_pipeline_bubbles_take_the_schedules_idle_share_of_the_update():
    assert pipeline_bubble_share({"pp": 2, "microbatches": 3}) == pytest.approx(1 / 4)
    assert pipeline_bubble_share({"pp": 4, "microbatches": 4, "pp_schedule": "interleaved_1f1b"}) == \
        pytest.approx(3 / 11)
    assert pipeline_bubble_share(None) == 0.0
    waterfall = step_waterfall(STEP, layout={"pp": 2, "microbatches": 3})
    assert waterfall.seconds["bubble"] == pytest.approx(0.25 * 4.0)
    assert waterfall.seconds["padding"] == pytest.approx(0.2 * (4.0 - 1.0))  # padding of the rest
    assert waterfall.seconds["compute"] == pytest.approx(KNOWN["compute"] - 1.0 + 0.2)
    assert waterfall.ideal_s + sum(waterfall.seconds.values()) == pytest.approx(waterfall.whole_s)


def test_the_profilers_own_probes_are_taken_out_of_the_step():
    waterfall = step_waterfall({**STEP, "timing_s/profiler_probes": 0.4})
    assert waterfall.whole_s == pytest.approx(11.1)
    assert waterfall.seconds["unattributed"] == pytest.approx(0.1)
    assert waterfall.ideal_s == pytest.approx(0.5)  # the FLOPs at peak do not change
    assert any("probes" in n for n in waterfall.notes)


def test_a_run_spreads_evaluation_and_saves_over_its_steps():
    plain = {k: v for k, v in STEP.items() if k not in ("timing_s/eval", "timing_s/save")}
    steps = [{"timing_s/eval": 2.0}, plain, {**plain, "timing_s/save": 1.0}]  # an evaluation before step 1
    waterfall = run_waterfall(steps)
    assert waterfall.steps == 2
    assert waterfall.seconds["eval"] == pytest.approx(1.0) and waterfall.seconds["checkpoint"] == pytest.approx(0.5)
    assert waterfall.whole_s == pytest.approx(11.5)
    assert MfuWaterfall.from_json(waterfall.to_json()).seconds == waterfall.seconds
    with pytest.raises(ValueError, match="no steps"):
        run_waterfall([{"timing_s/eval": 1.0}])


def test_every_timed_kind_of_comm_accounting_is_read():
    from scalerl.comm.counting.accounting import TIMED_KINDS
    from scalerl.perf.mfu_waterfall import COMM_KINDS

    assert sorted(COMM_KINDS) == sorted(TIMED_KINDS)


def test_metrics_without_the_step_time_are_refused_with_the_key_named():
    with pytest.raises(KeyError, match="timing_s/step"):
        step_waterfall({"perf/mfu": 0.1})


def test_a_real_run_is_covered_by_its_timers_and_counts_its_padding(tmp_path):
    from scalerl.core.config import load_config
    from scalerl.trainer.rl_trainer import RLTrainer
    from scalerl.trainer.run import start_run

    cfg = load_config(None, tiny_overrides(f"trainer.output_dir={tmp_path}", "trainer.total_steps=4"))
    trainer = RLTrainer(cfg, start_run(cfg, RLTrainer.kind))
    try:
        trainer.advance()  # warm-up
        steps = [trainer.advance() for _ in range(3)]
    finally:
        trainer.close()
    for metrics in steps:  # one epoch: the update's real tokens are the rank's tokens, padding on top
        assert metrics["perf/real_tokens/actor"] == metrics["perf/update_tokens"] * cfg.actor.ppo_epochs
        assert metrics["perf/token_slots/actor"] >= metrics["perf/real_tokens/actor"] > 0
    waterfall = run_waterfall(steps)
    assert waterfall.check() == [], waterfall.lines()
    assert 0 < waterfall.achieved_mfu < 1
    assert waterfall.seconds["compute"] > 0 and waterfall.seconds["reward"] > 0
    assert set(waterfall.compute_by_phase) == {"generation", "update"}
    assert waterfall.compute_by_phase["generation"] > 0 and waterfall.compute_by_phase["update"] > 0
    assert waterfall.ideal_s + sum(waterfall.seconds.values()) == pytest.approx(waterfall.whole_s)
