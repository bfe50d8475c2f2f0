"""`--performance-profiling`'s MFU waterfall (`profile_waterfall`): the collective waits as the profile measured
them per phase (the weight sync's and the untimed remainder's left out, DDP's gradient wait added from comm
accounting), the evaluation and save measured once and spread over the run at the config's intervals; then a
real profile of the tiny model on one rank, whose report and rendered output carry the waterfall."""

from __future__ import annotations

import io

import pytest

from scalerl.core.config import load_config
from scalerl.doctor.profiling import measured_waits, profile_waterfall
from tests.tiny import tiny_overrides


def _phase(peer_s: float = 0.0, comm_s: float = 0.0) -> dict[str, float]:
    return {"time_s": 0.0, "busy_s": 0.0, "wait_s": peer_s + comm_s, "peer_s": peer_s, "comm_s": comm_s,
            "peak_gb": 0.0, "start_gb": 0.0}


# Two ranks: rank 0 waits for rank 1 at the end of its data phase, in the update's optimizer step and at the
# end of generation; both spend time in the weight sync's collectives (its own slice) and in "other" (the
# metrics' reduction, outside the step), which must not count.
RECORDS = [
    {"rank": 0, "save_s": 0.2, "eval_s": 0.3,
     "phases": {"data": _phase(0.06), "gen": _phase(0.10, 0.02), "update_actor": _phase(0.0, 0.04),
                "optimizer": _phase(0.20, 0.01), "update_weights": _phase(0.5, 0.5), "other": _phase(0.7, 0.7)}},
    {"rank": 1, "save_s": 0.4, "eval_s": 0.1,
     "phases": {"gen": _phase(0.0, 0.02), "update_actor": _phase(0.0, 0.04), "optimizer": _phase(0.0, 0.01),
                "update_weights": _phase(0.5, 0.5), "other": _phase(0.7, 0.7)}},
]
METRICS = {"timing_s/step": 2.0, "perf/mfu": 0.1, "timing_s/data": 0.05, "timing_s/gen": 0.6,
           "timing_s/update_actor": 1.0,
           "timing_s/update_weights": 0.2, "timing_s/comm/grad": 0.08, "timing_s/comm/grad/min": 0.06}


def test_the_waits_are_the_profiles_own_with_ddps_gradient_wait_added():
    waits = measured_waits(RECORDS, METRICS)
    assert waits.transfer_s == pytest.approx((0.02 + 0.04 + 0.01) + 0.06)  # per rank: gen, update, optimizer
    assert waits.peers_s == pytest.approx((0.06 + 0.10 + 0.20) / 2 + 0.02)
    assert waits.update_s == pytest.approx(0.04 + 0.01 + 0.20 / 2 + 0.08)
    assert waits.gen_s == pytest.approx(0.02 + 0.10 / 2)
    assert waits.host_s == pytest.approx({"data": 0.06 / 2, "reward": 0.0})


def test_evaluation_and_saves_are_spread_over_the_run_at_their_intervals():
    cfg = load_config(None, tiny_overrides("trainer.total_steps=20", "trainer.save_every=10", "trainer.eval_every=5"))
    data = profile_waterfall(cfg, "rl", RECORDS, METRICS, {"pp": 1})
    # the slowest rank's save, twice in 20 steps; its evaluation at the start and every 5 steps: 5 times
    assert data["seconds"]["checkpoint"] == pytest.approx(0.4 * 2 / 20)
    assert data["seconds"]["eval"] == pytest.approx(0.3 * 5 / 20)
    assert data["whole_s"] == pytest.approx(2.0 + 0.04 + 0.075)
    assert data["seconds"]["weight_sync"] == pytest.approx(0.2)
    # the data phase's barrier wait counts once, as waiting for the slowest, not as data loading
    assert data["seconds"]["data"] == pytest.approx(0.05 - 0.03)
    assert data["seconds"]["imbalance"] == pytest.approx(0.03 + 0.05 + 0.10 + 0.02)
    assert data["ideal_s"] + sum(data["seconds"].values()) == pytest.approx(data["whole_s"])
    assert any("trainer.save_every=10" in n for n in data["notes"])
    cfg = load_config(None, tiny_overrides("trainer.total_steps=20", "trainer.save_every=0"))
    assert profile_waterfall(cfg, "rl", RECORDS, METRICS, {})["seconds"]["checkpoint"] == pytest.approx(0.4 / 20)


def test_a_real_profile_reports_and_renders_its_waterfall(tmp_path):
    from scalerl.doctor.diagnose import DoctorOptions, diagnose
    from scalerl.doctor.render import render

    options = DoctorOptions(distributed_check=False, profile=True, steps=2, warmup=1, join_timeout_s=30,
                            timeout_s=300, scratch_dir=str(tmp_path), max_size=2**20,
                            overrides=tiny_overrides("trainer.total_steps=10", "trainer.save_every=5",
                                                     "trainer.eval_every=5"))
    _, report = diagnose(options)
    data = report.measurements["profile"]["mfu_waterfall"]
    assert data["problems"] == [], data
    assert data["seconds"]["checkpoint"] > 0 and data["seconds"]["eval"] > 0 and data["seconds"]["compute"] > 0
    assert 0 < data["achieved_mfu"] < 1
    assert data["ideal_s"] + sum(data["seconds"].values()) == pytest.approx(data["whole_s"])
    out = io.StringIO()
    render(report, out)
    text = out.getvalue()
    assert "MFU waterfall: peak 100% -> achieved" in text
    for label in ("exposed communication", "generation long tail", "padding", "checkpointing", "achieved MFU"):
        assert label in text, label
