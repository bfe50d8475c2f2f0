"""The host-RAM, checkpoint-cost and phase-switch-memory rules on recorded profiles, no process spawned: each
injected fault (a node with less memory, a slow save, a generation that needs more than the device
has) lands on its leaf, names where and what to change, and a healthy profile raises none of them."""

from __future__ import annotations

import math

from scalerl.health import (
    FAULT,
    NOT_MEASURED,
    OK,
    RULES,
    WARNING,
    StepView,
    roll_up,
    run_step_rules,
)
from scalerl.health.resource_rules import (
    TARGET_SAVE_SHARE,
    checkpoint_cost,
    host_ram,
    phase_switch_memory,
)
from tests.health.recorded_measurements import healthy_profile, rank_profile

LEAVES = ("resources/host_ram", "resources/checkpoint_cost", "resources/phase_switch_memory")


def view(records=None, context=None, metrics=None) -> StepView:
    base_metrics, base_records, base_context = healthy_profile()
    return StepView(metrics or base_metrics, records or base_records, context or base_context)


def alarms(findings) -> dict[str, str]:
    return {leaf: r.status for leaf, r in roll_up(findings).items() if r.status in (WARNING, FAULT)}


def test_a_healthy_profile_measures_each_leaf_and_raises_none():
    leaves = roll_up(run_step_rules(view()))
    assert {leaf: leaves[leaf].status for leaf in LEAVES} == dict.fromkeys(LEAVES, OK)


def test_every_threshold_says_why():
    for rule in ("host_ram", "checkpoint_cost", "phase_switch_memory"):
        assert all(len(t.reason) > 40 for t in RULES[rule].thresholds.values()), rule


# ------------------------------------------------------------------------------------------ host RAM
def test_a_memory_cap_names_the_node_the_phase_and_the_fix():
    """4 ranks on node0 at 2.0 / 2.5 / 2.2 GiB each (load / checkpoint / export): 10 GiB at checkpoint time;
    the node capped at 10.4 GiB is at 96%."""
    records = [dict(r, node_memory_gb=10.4) for r in healthy_profile()[1]]
    (f,) = host_ram(view(records))
    assert f.status == FAULT and f.leaf == "resources/host_ram"
    assert f.evidence["phase"] == "checkpoint" and f.evidence["peak_gb"] == 10.0 and f.hosts == ("node0",)
    assert f.ranks == (0, 1, 2, 3) and "at checkpoint time" in f.summary and "10.00 of 10.40 GiB" in f.summary
    assert "fewer ranks on the node (it runs 4" in f.fix and "parallel.dp_shard" in f.fix
    assert alarms(run_step_rules(view(records))) == {"resources/host_ram": FAULT}


def test_host_ram_sums_ranks_per_node_and_warns_before_the_fault():
    records = [dict(rank_profile(r), host=f"node{r // 2}") for r in range(4)]  # 2 nodes x 2 ranks
    records[2]["host_ram"] = dict(records[2]["host_ram"], load=6.5)
    for r in records:
        r["node_memory_gb"] = 10.0
    (f,) = host_ram(view(records))
    # node1 at load: 6.5 + 2.0 = 8.5 of 10 GiB; node0 at most 5.0
    assert f.status == WARNING and f.evidence["node"] == "node1" and f.evidence["phase"] == "load"
    assert f.ranks == (2, 3) and f.evidence["per_node"]["node0"]["checkpoint_gb"] == 5.0
    assert "sharded layout" in f.fix  # data parallel: the whole model is read on every rank


def test_an_export_peak_names_the_export_fixes():
    records = [dict(r, host_ram=dict(r["host_ram"], export=13.5)) for r in healthy_profile()[1]]
    (f,) = host_ram(view(records))
    assert f.evidence["phase"] == "export" and f.status == WARNING  # 4 x 13.5 = 54 of 64 GiB: 84%
    assert "trainer.export_max_shard_size" in f.fix and "scalerl export" in f.fix


def test_host_ram_is_not_measured_without_a_profile():
    (f,) = host_ram(StepView({"timing_s/step": 1.0}))
    assert f.status == NOT_MEASURED and "--performance-profiling" in f.summary


# ------------------------------------------------------------------------------------------ checkpoint cost
def test_a_slow_save_is_a_share_of_the_training_time_with_an_interval_that_fixes_it():
    _, _, context = healthy_profile()
    slow = dict(context, save_s=70.0)  # 50 steps x 1.3 s = 65 s between saves: 70 / 135 = 52%
    (f,) = checkpoint_cost(view(context=slow))
    assert f.status == FAULT and f.leaf == "resources/checkpoint_cost"
    assert f.evidence["share"] == round(70 / 135, 4) and "70.00 s, 52% of the training time" in f.summary
    suggested = int(f.fix.split("trainer.save_every=")[1].split()[0])
    assert 70.0 / (suggested * 1.3 + 70.0) <= TARGET_SAVE_SHARE < 70.0 / ((suggested - 1) * 1.3 + 70.0)
    assert "scalerl has no asynchronous save" in f.fix and "parallel.dp_shard" in f.fix
    assert alarms(run_step_rules(view(context=slow))) == {"resources/checkpoint_cost": FAULT}
    (f,) = checkpoint_cost(view(context=dict(context, save_s=10.0)))  # 10 / 75 = 13%
    assert f.status == WARNING


def test_save_every_zero_counts_the_one_save_against_the_whole_run():
    _, _, context = healthy_profile()
    once = dict(context, save_every=0, total_steps=100, save_s=30.0)  # 30 / (130 + 30) = 19%, but 30 s in all
    (f,) = checkpoint_cost(view(context=once))
    assert f.status == OK and "under the 60 s over a run that counts" in f.summary
    assert f.evidence["steps_between_saves"] == 100 and f.evidence["saves"] == 1
    (f,) = checkpoint_cost(view(context=dict(once, save_s=90.0)))  # 90 / 220 = 41%, 90 s
    assert f.status == WARNING and "the run's 100 steps (trainer.save_every=0: once)" in f.summary


def test_checkpoint_cost_is_not_measured_without_a_timed_save():
    _, _, context = healthy_profile()
    context.pop("save_s")
    (f,) = checkpoint_cost(view(context=context))
    assert f.status == NOT_MEASURED and "--performance-profiling" in f.summary


# ------------------------------------------------------------------------------------------ phase switch
def _switching(held: float, added: float, into: str = "gen") -> list[dict]:
    """rank 1 enters ``into`` holding ``held`` GiB and adds ``added`` there; capacity 16 GiB."""
    records = [rank_profile(r) for r in range(4)]
    records[1]["phases"][into].update(start_gb=held, peak_gb=held + added)
    return records


def test_training_state_held_into_generation_names_the_switch_and_the_layout_fix():
    (f,) = phase_switch_memory(view(_switching(held=12.0, added=1.0)))  # 13 / 16 = 81%
    assert f.status == WARNING and f.ranks == (1,) and f.evidence["switch"] == "update_actor -> gen"
    assert "12.00 GiB already held when gen started (after update_actor) + 1.00 GiB gen added" in f.summary
    assert f.fix.startswith("parallel.dp_shard=<ranks>") and "rollout.placement=standalone" in f.fix
    assert "rollout.max_num_seqs" in f.fix  # its own part second


def test_generation_own_memory_names_the_kv_budget_first():
    (f,) = phase_switch_memory(view(_switching(held=3.0, added=12.5)))  # 15.5 / 16 = 97%
    assert f.status == FAULT and f.fix.startswith("fewer rows decoding at once (rollout.max_num_seqs)")
    assert "rollout.vllm_kv_cache_gib" in f.fix


def test_a_switch_into_training_names_the_micro_batch():
    (f,) = phase_switch_memory(view(_switching(held=4.0, added=9.0, into="update_actor")))
    assert f.evidence["switch"] == "gen -> update_actor" and f.status == WARNING
    assert f.fix.startswith("a smaller actor.ppo_micro_batch_size")


def test_the_warning_comes_before_the_accelerator_memory_one():
    """75% at a switch warns where the any-phase peak rule (85%) is still quiet: headroom for longer responses."""
    findings = run_step_rules(view(_switching(held=8.0, added=4.5)))  # 12.5 / 16 = 78%
    assert alarms(findings) == {"resources/phase_switch_memory": WARNING}
    assert RULES["phase_switch_memory"].thresholds["fraction"].warning < RULES["memory_peak"].thresholds[
        "fraction"].warning


def test_no_switch_in_an_sft_step_is_not_measured():
    records = [rank_profile(r) for r in range(4)]
    for r in records:
        r["phases"] = {"data": r["phases"]["data"], "update": r["phases"]["update_actor"]}
    (f,) = phase_switch_memory(view(records))
    assert f.status == NOT_MEASURED and "no switch between training and generation" in f.summary
    assert math.isclose(RULES["phase_switch_memory"].thresholds["fraction"].fault, 0.95)


def test_what_the_process_held_before_the_model_is_not_blamed_on_training():
    """On a CPU the resident set held into generation starts with the interpreter and its libraries: of 12 GiB
    held, 11.5 were there before the model loaded: the fix says so first, then generation's own 3 GiB comes
    before training's 0.5."""
    records = _switching(held=12.0, added=3.0)
    records[1]["baseline_gb"] = 11.5
    (f,) = phase_switch_memory(view(records))
    assert f.evidence["baseline_gb"] == 11.5 and "11.50 of it the process before the model loaded" in f.summary
    assert f.fix.startswith("most of it (11.50 GiB) the process held before the model loaded")
    assert f.fix.index("fewer rows decoding at once") < f.fix.index("parallel.dp_shard")
    records = _switching(held=8.0, added=5.0)
    records[1]["baseline_gb"] = 6.0  # under half the 13 GiB peak: the run's parts alone, generation's 5 > 2 first
    (f,) = phase_switch_memory(view(records))
    assert f.fix.startswith("fewer rows decoding at once")
