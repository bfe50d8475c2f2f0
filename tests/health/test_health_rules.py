"""The doctor's rules on recorded measurements, no process spawned: each injected fault lands on its leaf
and on no other, a healthy record raises nothing, and every threshold carries its reason."""

from __future__ import annotations

import math

import pytest

from scalerl.health import (
    FAULT,
    LEAVES,
    NOT_MEASURED,
    OK,
    RULES,
    TREE,
    WARNING,
    StepView,
    describe_rules,
    exit_code,
    health_metrics,
    roll_up,
    run_cluster_rules,
    run_step_rules,
)
from scalerl.health.step_rules import logprob_mismatch, reward_collapse
from tests.health.recorded_measurements import (
    healthy_cluster_measurements,
    healthy_facts,
    healthy_profile,
    rank_profile,
)


def alarms(findings) -> dict[str, str]:
    """Leaves with a warning or fault -> their status."""
    return {leaf: r.status for leaf, r in roll_up(findings).items() if r.status in (WARNING, FAULT)}


def profile_findings(metrics=None, records=None, context=None, history=None):
    base_metrics, base_records, base_context = healthy_profile()
    view = StepView(metrics or base_metrics, records or base_records, context or base_context)
    return run_step_rules(view, history)


def cluster_findings(facts=None, measured=None):
    return run_cluster_rules(facts or healthy_facts(nodes=2), measured or healthy_cluster_measurements())


def the_finding(findings, leaf):
    bad = [f for f in findings if f.leaf == leaf and f.status in (WARNING, FAULT)]
    assert bad, f"no alarm on {leaf}: {[f.summary for f in findings if f.leaf == leaf]}"
    return bad[0]


# ------------------------------------------------------------------------------------------ healthy
def test_healthy_records_raise_nothing():
    findings = cluster_findings() + profile_findings()
    assert alarms(findings) == {}
    assert exit_code(findings) == 0
    leaves = roll_up(findings)
    # Everything these modes measure is measured: not the reward history (needs 5 steps), nor a log-prob gap
    # (the built-in engine's log-probs are the trainer's own).
    assert {k for k, r in leaves.items() if r.status == NOT_MEASURED} == {
        "training/reward_collapse", "training/logprob_mismatch", "resources/host_device_transfer"}


# ------------------------------------------------------------------------------------------ communication
def test_a_different_torch_on_one_rank_is_a_version_mismatch_fault():
    facts = healthy_facts(nodes=2)
    facts[1]["versions"]["torch"] = "2.5.1+cu121"
    findings = cluster_findings(facts)
    assert alarms(findings) == {"communication/library_versions": FAULT}
    f = the_finding(findings, "communication/library_versions")
    assert f.ranks == (1,) and "torch differs" in f.summary and "2.13.0+cpu" in f.fix and "node0" in f.hosts
    assert exit_code(findings) == 1


def test_a_different_nccl_is_a_fault_and_a_different_python_a_warning():
    facts = healthy_facts(nodes=2)
    for f in facts:
        f["versions"].update(nccl="2.21.5", cuda="12.4")
    facts[3]["versions"]["nccl"] = "2.18.1"
    facts[2]["versions"]["python"] = "3.10.14"
    findings = cluster_findings(facts)
    versions = {f.summary.split()[0]: f.status for f in findings if f.leaf == "communication/library_versions"}
    assert versions == {"nccl": FAULT, "python": WARNING}
    assert alarms(findings) == {"communication/library_versions": FAULT}


def test_a_missing_socket_interface_is_named_with_its_node():
    facts = healthy_facts(nodes=2)
    facts[2]["socket"].update(value="eth9", missing=["eth9"], available=["eth0", "lo"], suggestion="eth0")
    findings = cluster_findings(facts)
    assert alarms(findings) == {"communication/topology": FAULT}
    f = the_finding(findings, "communication/topology")
    assert f.ranks == (2,) and f.hosts == ("node1",) and "eth9" in f.summary
    assert "GLOO_SOCKET_IFNAME=eth0" in f.fix


def test_a_rank_that_never_joined_is_named_with_its_host():
    measured = healthy_cluster_measurements()
    measured["rendezvous"].update(joined=[0, 1, 2], missing=[
        {"rank": 3, "node_rank": 1, "expected_host": "node1 (10.0.0.2), node 1"}])
    findings = cluster_findings(healthy_facts(nodes=2)[:3], measured)
    assert alarms(findings) == {"communication/topology": FAULT}
    f = the_finding(findings, "communication/topology")
    assert f.ranks == (3,) and "rank 3 from node1" in f.summary and "node0:29500" in f.fix


def test_one_slow_node_link_is_named_by_the_pairs():
    measured = healthy_cluster_measurements(nodes=3)
    fast, slow = 100e6, 20e6
    measured["bandwidth"]["pairs"] = [
        {"a": "n0", "b": "n1", "size": 2**24, "seconds": 0.1, "bytes_per_s": fast},
        {"a": "n0", "b": "n2", "size": 2**24, "seconds": 0.5, "bytes_per_s": slow},
        {"a": "n1", "b": "n2", "size": 2**24, "seconds": 0.5, "bytes_per_s": slow * 1.1}]
    findings = cluster_findings(measured=measured)
    assert alarms(findings) == {"communication/bandwidth": WARNING}
    f = the_finding(findings, "communication/bandwidth")
    assert f.hosts == ("n2",) and "the link of n2" in f.summary


def test_one_slow_pair_without_a_common_node_names_the_pair():
    pairs = [("a", "b", 100e6), ("c", "d", 100e6), ("a", "c", 100e6), ("b", "d", 100e6), ("a", "d", 100e6),
             ("b", "c", 10e6)]
    measured = healthy_cluster_measurements(nodes=4)
    measured["bandwidth"]["pairs"] = [{"a": a, "b": b, "size": 1, "seconds": 1, "bytes_per_s": bw} for a, b, bw in pairs]
    f = the_finding(cluster_findings(measured=measured), "communication/bandwidth")
    assert f.status == FAULT and "between b and c" in f.summary


def test_all_reduce_far_below_the_nominal_link_speed():
    measured = healthy_cluster_measurements()
    measured["bandwidth"]["sweeps"][2]["results"][-1]["busbw"] = 0.05 * 10e9 / 8
    f = the_finding(cluster_findings(measured=measured), "communication/bandwidth")
    assert f.status == FAULT and "5% of eth0" in f.summary


def test_veth_between_nodes_is_a_warning_not_on_one_node():
    facts = healthy_facts(nodes=2)
    for f in facts:
        f["socket"].update(kind="virtual", virtual_kind="veth", interface="veth0")
    assert alarms(cluster_findings(facts)) == {"communication/topology": WARNING}
    one_node = healthy_facts(nodes=1)
    for f in one_node:
        f["socket"].update(kind="virtual", virtual_kind="bridge")
    assert alarms(run_cluster_rules(one_node, {})) == {}


def test_ranks_not_numbered_node_by_node():
    facts = healthy_facts(nodes=2)
    for f in facts:  # interleaved: 0,2 on node0 and 1,3 on node1
        f["hostname"] = f"node{f['rank'] % 2}"
        f["node_id"] = f"boot-node{f['rank'] % 2}:net:[1]"
    f = the_finding(cluster_findings(facts), "communication/topology")
    assert f.status == WARNING and "node0: 0,2" in f.summary


# ------------------------------------------------------------------------------------------ compute load
def test_a_slow_rank_is_a_straggler_named_with_its_phase():
    records = [rank_profile(r) for r in range(4)]
    records[2] = rank_profile(2, busy=2.5)
    records[2]["phases"]["gen"]["busy_s"] = 2.0
    findings = profile_findings(records=records)
    assert alarms(findings) == {"compute/stragglers": FAULT}
    f = the_finding(findings, "compute/stragglers")
    assert f.ranks == (2,) and "rank 2" in f.summary and "gen" in f.summary and f.evidence["ratio"] == 2.5
    for r in (0, 1, 3):  # the others, done early, wait for rank 2 in its slow phase
        records[r]["phases"]["gen"]["wait_s"] = 1.4 + 0.1 * r
    f = the_finding(profile_findings(records=records), "compute/stragglers")
    assert "the other ranks wait 1.500 s per step for it in gen" in f.summary
    assert f.evidence["others_wait_s_in_phase"] == 1.5


def test_a_rank_slowest_in_only_one_step_is_noise():
    records = [rank_profile(r) for r in range(4)]
    for r in records:
        r["busy_by_step"] = [1.0, 1.0, 1.0]
    records[1].update(busy_s=1.5, busy_by_step=[2.5, 1.0, 1.0])  # one bad step, e.g. another job's burst
    records[0]["busy_by_step"] = [1.0, 1.1, 1.1]
    assert alarms(profile_findings(records=records)) == {}


def test_online_straggler_uses_busy_spread_and_names_the_rank():
    metrics = {"timing_s/step": 2.0, "timing_s/busy": 1.0, "timing_s/busy/max": 1.8, "timing_s/busy/min": 0.7,
               "timing_s/busy/slowest_rank": 3.0}
    findings = run_step_rules(StepView(metrics, None, {"world_size": 4, "dp_size": 4}))
    f = the_finding(findings, "compute/stragglers")
    assert f.status == WARNING and f.ranks == (3,)
    no_waits = run_step_rules(StepView({"timing_s/step": 2.0}, None, {"world_size": 4}))
    assert [f.status for f in no_waits if f.rule == "stragglers"] == [NOT_MEASURED]


def test_skewed_tokens_without_balancing_is_data_sharding_imbalance_cleared_by_balancing():
    metrics, _, context = healthy_profile()
    records = [rank_profile(r, tokens=t) for r, t in enumerate((4000, 900, 1000, 1100))]
    off = profile_findings({k: v for k, v in metrics.items() if not k.startswith("balance/")}, records,
                           dict(context, balance_batch=False))
    assert alarms(off) == {"compute/data_sharding": FAULT}
    f = the_finding(off, "compute/data_sharding")
    assert "trainer.balance_batch=true" in f.fix and "2.29x" in f.summary
    on = profile_findings(metrics, [rank_profile(r, tokens=1750 + r) for r in range(4)], context)
    assert alarms(on) == {}


def test_a_straggler_explained_by_its_tokens_points_at_the_imbalance():
    _, _, context = healthy_profile()
    records = [rank_profile(r, tokens=t) for r, t in enumerate((4000, 900, 1000, 1100))]
    records[0] = rank_profile(0, busy=2.2, tokens=4000)
    findings = profile_findings(None, records, dict(context, balance_batch=False))
    assert alarms(findings) == {"compute/data_sharding": FAULT}
    assert any("holds the most tokens" in f.summary for f in findings if f.leaf == "compute/stragglers")


def test_tensor_parallel_too_wide_for_the_hidden_size():
    _, _, context = healthy_profile()
    wide = dict(context, tp=8, hidden_size=1024, layer_params=12 * 1024**2, peak_flops=989e12, link_busbw=50e9)
    f = the_finding(profile_findings(context=wide), "compute/parallel_granularity")
    assert f.status == FAULT and "parallel.tp=4" in f.fix
    narrow = dict(context, tp=2, hidden_size=8192, layer_params=12 * 8192**2, peak_flops=989e12, link_busbw=400e9)
    assert alarms(profile_findings(context=narrow)) == {}


def test_pipeline_bubble():
    _, _, context = healthy_profile()
    f = the_finding(profile_findings(context=dict(context, pp=4, microbatches=2)), "compute/parallel_granularity")
    assert f.status == FAULT and "parallel.microbatches" in f.fix


def test_fp32_on_a_cpu_measured_faster_in_bf16_is_unused_headroom():
    _, _, context = healthy_profile()
    fp32 = dict(context, precision="fp32", dtype_bytes=4, bf16_hardware="avx512_bf16", bf16_over_fp32=3.9,
                bf16_probe_shape=[512, 896, 4864])
    f = the_finding(profile_findings(context=fp32), "compute/precision")
    assert f.status == WARNING and f.evidence["bf16_over_fp32"] == 3.9 and "3.90x faster in bf16" in f.summary
    assert "trainer.precision=bf16" in f.fix and "trainer.precision=auto" in f.fix
    # bf16 already, no bf16 hardware, or a probe that found bf16 no faster: nothing to say
    for quiet in (dict(fp32, precision="bf16"), dict(fp32, bf16_hardware=""), dict(fp32, bf16_over_fp32=1.1),
                  dict(fp32, bf16_pays=False)):  # ... or a model too small for bf16 to shorten its step
        assert "compute/precision" not in alarms(profile_findings(context=quiet))
    no_probe = {k: v for k, v in fp32.items() if k != "bf16_over_fp32"}
    assert roll_up(profile_findings(context=no_probe))["compute/precision"].status == NOT_MEASURED


# ------------------------------------------------------------------------------------------ resources
def test_memory_near_capacity_names_the_phase():
    records = [rank_profile(r) for r in range(4)]
    records[1]["phases"]["gen"]["peak_gb"] = 15.5
    f = the_finding(profile_findings(records=records), "resources/accelerator_memory")
    assert f.status == FAULT and f.ranks == (1,) and "in gen" in f.summary
    # gen follows the update (step to step): the same peak is the switch's, which names what each side holds
    assert alarms(profile_findings(records=records)) == {"resources/accelerator_memory": FAULT,
                                                         "resources/phase_switch_memory": FAULT}


def test_a_slow_data_loader_is_a_data_wait_finding():
    records = [rank_profile(r, data=0.9) for r in range(4)]
    findings = profile_findings(records=records)
    assert alarms(findings) == {"resources/storage_io": FAULT}
    assert the_finding(findings, "resources/storage_io").rule == "data_wait"


def test_slow_storage_for_the_checkpoint_interval_and_a_full_disk():
    _, _, context = healthy_profile()
    slow = dict(context, write_bytes_per_s=20 * 2**20, save_every=5)  # 2 GiB at 20 MiB/s: 102 s per 6.5 s
    f = the_finding(profile_findings(context=slow), "resources/storage_io")
    assert f.rule == "checkpoint_interval" and f.status == FAULT and "trainer.save_every" in f.fix
    full = dict(context, free_bytes=3 * 2**30)
    f = the_finding(profile_findings(context=full), "resources/storage_io")
    assert f.rule == "disk_space" and f.status == FAULT


def test_a_checkpoint_path_not_shared_across_nodes_is_a_fault():
    measured = healthy_cluster_measurements()
    measured["shared"]["paths"][1].update(shared_with=[], not_shared_with=["node1"])
    findings = cluster_findings(measured=measured)
    assert alarms(findings) == {"resources/storage_io": FAULT}
    assert the_finding(findings, "resources/storage_io").hosts == ("node1",)


def test_slow_pinned_copies_and_memory_held_by_another_process_on_gpus():
    facts = healthy_facts(nodes=2)
    for f in facts:
        f.update(device="cuda", gpus=[{"name": "NVIDIA H100 80GB HBM3", "memory_gb": 80.0, "free_gb": 79.0}] * 4,
                 copy={"h2d_bytes_per_s": 24e9, "d2h_bytes_per_s": 25e9, "size": 256 * 2**20})
    assert alarms(cluster_findings(facts)) == {}
    facts[3]["copy"]["h2d_bytes_per_s"] = 3e9
    facts[1]["gpus"] = [dict(facts[1]["gpus"][0], free_gb=30.0)] * 4
    assert alarms(cluster_findings(facts)) == {"resources/host_device_transfer": WARNING,
                                               "resources/accelerator_memory": FAULT}


def test_mixed_gpu_models_are_a_straggler_warning():
    facts = healthy_facts(nodes=2)
    for f in facts:
        f.update(device="cuda", gpus=[{"name": "A100" if f["hostname"] == "node1" else "H100", "memory_gb": 80.0,
                                       "free_gb": 79.0}] * 2)
    assert alarms(cluster_findings(facts)) == {"compute/stragglers": WARNING}


# ------------------------------------------------------------------------------------------ training signal
def test_non_finite_loss_is_a_fault_and_skipped_steps_a_warning():
    metrics, records, context = healthy_profile()
    findings = run_step_rules(StepView(dict(metrics, **{"actor/pg_loss": math.nan}), records, context))
    assert alarms(findings) == {"training/non_finite": FAULT}
    findings = run_step_rules(StepView(dict(metrics, **{"actor/skipped_steps": 2.0}), records, context))
    assert alarms(findings) == {"training/non_finite": WARNING}


def test_reward_collapse_and_flat_rewards():
    rising = [{"critic/score/mean": m, "critic/score/max": 1.0, "critic/score/min": 0.0}
              for m in (0.1, 0.3, 0.5, 0.6, 0.6, 0.7)]
    assert [f.status for f in reward_collapse(rising)] == [OK]
    collapsed = rising + [{"critic/score/mean": m, "critic/score/max": 1.0, "critic/score/min": 0.0}
                          for m in (0.2, 0.1, 0.05)]
    assert [f.status for f in reward_collapse(collapsed)] == [WARNING]
    flat = [{"critic/score/mean": 0.0, "critic/score/max": 0.0, "critic/score/min": 0.0}] * 5
    (f,) = reward_collapse(flat)
    assert f.status == WARNING and "advantages are all 0" in f.summary and "data.reward" in f.fix
    saturated = rising + [{"critic/score/mean": 1.0, "critic/score/max": 1.0, "critic/score/min": 1.0}] * 5
    assert "harder prompts" in reward_collapse(saturated)[0].fix
    assert [f.status for f in reward_collapse(flat[:3])] == [NOT_MEASURED]


def test_a_reward_collapse_is_blamed_on_what_the_training_trajectory_shows():
    """Fault injection as histories: the same reward drop with a gradient spike, a learning rate that rose into
    it, an entropy collapse, and large updates; each names its own cause and fix, and none names nothing."""
    def run(**trajectory):
        rows = []
        for i, m in enumerate((0.1, 0.3, 0.5, 0.6, 0.6, 0.6, 0.2, 0.1, 0.05)):
            late = i >= 6
            row = {"critic/score/mean": m, "critic/score/max": 1.0, "critic/score/min": 0.0, "actor/entropy": 2.0,
                   "actor/grad_norm": 0.5, "actor/ppo_kl": 0.001, "actor/pg_clipfrac": 0.01, "actor/lr": 1e-6}
            row.update({k: v for k, v in trajectory.items() if late})
            rows.append(row)
        (f,) = reward_collapse(rows)
        assert f.status == WARNING
        return f

    spike = run(**{"actor/grad_norm": 40.0})
    assert "the gradient norm spiked to 40" in spike.summary and "actor.grad_clip" in spike.fix
    lr = run(**{"actor/lr": 1e-4})
    assert "the learning rate rose from 1e-06 to 0.0001" in lr.summary and "actor.warmup_steps" in lr.fix
    entropy = run(**{"actor/entropy": 0.2})
    assert "the entropy collapsed" in entropy.summary and "actor.entropy_coeff" in entropy.fix
    far = run(**{"actor/ppo_kl": 0.2})
    assert "each update moves the policy far" in far.summary and "actor.ppo_epochs" in far.fix
    plain = run()
    assert "cause" not in plain.evidence and plain.fix.startswith("lower actor.lr; add a KL penalty")


def test_a_train_inference_log_prob_gap_warns_by_level_and_by_growth():
    """Fault injection as metrics: an engine whose numerics drift from the trainer's (the gap grows step by
    step), one that is off from the start, and a healthy bf16-like gap that stays put."""
    steady = [{"rollout/logprob_diff/mean": 0.008 + 0.0005 * (i % 2)} for i in range(12)]
    assert [f.status for f in logprob_mismatch(steady)] == [OK]
    drifting = [{"rollout/logprob_diff/mean": 0.004 * 1.25 ** i} for i in range(12)]  # 0.004 -> 0.047
    (f,) = logprob_mismatch(drifting, {"rollout_is_cap": 2.0})
    assert f.status == FAULT and f.evidence["growth"] > 4  # grew past 4x while its level is only a warning
    assert "rollout.is_cap=2" in f.fix and "rollout.dtype" in f.fix
    off = [{"rollout/logprob_diff/mean": 0.15}] * 4
    (f,) = logprob_mismatch(off, {"rollout_is_cap": 0.0})
    assert f.status == FAULT and "rollout.is_cap=2 with rollout.is_level=token" in f.fix
    assert "0.15 nats per token" in f.summary
    (f,) = logprob_mismatch([{"critic/score/mean": 1.0}] * 6)
    assert f.status == NOT_MEASURED and "reuses the engine's log-probs" in f.summary


# ------------------------------------------------------------------------------------------ the tree as data
def test_every_rule_lands_on_a_leaf_with_reasons_and_every_leaf_has_a_rule():
    assert {rule.leaf for rule in RULES.values()} == set(LEAVES)
    for rule in RULES.values():
        assert rule.thresholds or rule.severities, rule.id
        for t in rule.thresholds.values():
            assert len(t.reason) > 40, rule.id
        for s in rule.severities.values():
            assert s.status in (WARNING, FAULT) and len(s.reason) > 30, rule.id
    text = describe_rules()
    assert all(rule_id in text for rule_id in RULES)
    assert [b.id for b in TREE] == ["communication", "compute", "resources", "training", "rollout"]


def test_health_metrics_levels():
    findings = cluster_findings()
    facts = healthy_facts(nodes=2)
    facts[1]["versions"]["torch"] = "2.5.1"
    levels = health_metrics(run_cluster_rules(facts, healthy_cluster_measurements()))
    assert levels["health/communication/library_versions"] == 2.0
    assert levels["health/communication/bandwidth"] == 0.0
    assert "health/training/reward_collapse" not in levels  # not measured: not sent
    assert exit_code(findings) == 0


def test_threshold_direction():
    t = RULES["memory_peak"].thresholds["fraction"]
    assert (t.status(0.5), t.status(0.9), t.status(0.99)) == (OK, WARNING, FAULT)
    b = RULES["allreduce_bandwidth"].thresholds["busbw_vs_nominal"]
    assert (b.status(0.9), b.status(0.3), b.status(0.05)) == (OK, WARNING, FAULT)
    with pytest.raises(ValueError, match="unknown leaf"):
        type(RULES["non_finite"])("x", "nowhere", "", "")


def test_online_straggler_must_be_slowest_step_after_step():
    metrics = {"timing_s/step": 2.0, "timing_s/busy": 1.0, "timing_s/busy/max": 1.8, "timing_s/busy/min": 0.7,
               "timing_s/busy/slowest_rank": 3.0}
    steady = [{"timing_s/busy/slowest_rank": 3.0}] * 8 + [{"timing_s/busy/slowest_rank": 1.0}] * 2
    varying = [{"timing_s/busy/slowest_rank": float(r % 4)} for r in range(10)]
    context = {"world_size": 4, "dp_size": 4}
    assert alarms(run_step_rules(StepView(metrics, None, context, steady))) == {"compute/stragglers": WARNING}
    assert alarms(run_step_rules(StepView(metrics, None, context, varying))) == {}


def test_achieved_bandwidth_is_judged_only_when_collectives_take_real_time():
    _, records, context = healthy_profile()
    slow = dict(healthy_profile()[0], **{"comm/bytes/total": 50e6})
    findings = run_step_rules(StepView(slow, records, dict(context, comm_wait_s=1.0)))  # 50 MB/s of 5 GB/s
    assert alarms(findings) == {"communication/bandwidth": WARNING}
    assert the_finding(findings, "communication/bandwidth").rule == "achieved_bandwidth"
    latency_bound = run_step_rules(StepView(slow, records, dict(context, comm_wait_s=0.05)))
    assert alarms(latency_bound) == {}


# ------------------------------------------------------------------------------------------ MoE routing
def _moe_view(imbalance, history=(), dropped=None, context=None):
    metrics = {"moe/aux_loss": 1.02, "moe/expert_load_imbalance": imbalance}
    if dropped is not None:
        metrics.update({"moe/dropped_tokens": dropped * 4000, "moe/dropped_token_fraction": dropped})
    past = [{"moe/expert_load_imbalance": v} for v in history]
    return StepView(metrics, None, dict({"world_size": 2, "dp_size": 2}, **(context or {})), past)


def test_expert_load_imbalance_that_holds_is_a_finding_with_its_fixes():
    findings = run_step_rules(_moe_view(2.1, history=[1.9, 2.4, 2.1], context={"ep": 2}))
    assert alarms(findings) == {"compute/expert_load": WARNING}
    f = the_finding(findings, "compute/expert_load")
    assert f.rule == "expert_load_imbalance" and "2.10x the mean" in f.summary and "last 3 steps" in f.summary
    assert f.evidence["recent"] == [1.9, 2.4, 2.1] and f.evidence["lowest_recent"] == 1.9
    assert "router_aux_loss_coef" in f.fix and "output_router_logits=true" in f.fix
    assert "model.moe_capacity_factor" in f.fix and "parallel.ep=2" in f.fix
    collapsed = run_step_rules(_moe_view(3.6, history=[3.5, 3.9, 3.6]))  # most tokens on few experts
    assert alarms(collapsed) == {"compute/expert_load": FAULT}


def test_expert_load_imbalance_of_one_step_or_a_balanced_router_is_silent():
    assert alarms(run_step_rules(_moe_view(2.0, history=[1.2, 1.3, 2.0]))) == {}  # one step's batch, not the router
    assert alarms(run_step_rules(_moe_view(1.2, history=[1.25, 1.1, 1.2]))) == {}
    first = run_step_rules(_moe_view(1.7))  # no history yet: this step's value
    assert alarms(first) == {"compute/expert_load": WARNING}
    dense = [f for f in run_step_rules(StepView({}, None, {})) if f.leaf == "compute/expert_load"]
    assert [f.status for f in dense] == [OK] and "dense model" in dense[0].summary


def test_dropped_tokens_above_a_fraction_is_a_finding():
    context = {"moe_capacity_factor": 1.0}
    findings = run_step_rules(_moe_view(1.2, history=[1.2] * 3, dropped=0.04, context=context))
    assert alarms(findings) == {"compute/expert_load": WARNING}
    f = the_finding(findings, "compute/expert_load")
    assert f.rule == "dropped_tokens" and "160 token-to-expert assignments" in f.summary and "4.0%" in f.summary
    assert f.evidence == {"dropped_assignments": 160.0, "fraction": 0.04, "moe_capacity_factor": 1.0}
    assert "raise model.moe_capacity_factor (now 1)" in f.fix
    assert alarms(run_step_rules(_moe_view(1.2, history=[1.2] * 3, dropped=0.2, context=context))) == \
        {"compute/expert_load": FAULT}
    assert alarms(run_step_rules(_moe_view(1.2, history=[1.2] * 3, dropped=0.002, context=context))) == {}


# ------------------------------------------------------------------------------------------ rollout pipeline
def _pipeline_view(trainer_idle, rollout_idle, step=2.0, staleness=1, workers=1, **extra):
    metrics = {"timing_s/step": step, "timing_s/trainer_idle": trainer_idle, "timing_s/rollout_idle": rollout_idle,
               "response_length/mean": 60.0, "response_length/max": 80.0, "timing_s/gen": 0.5, **extra}
    context = {"world_size": 1, "dp_size": 1, "rollout_placement": "standalone", "rollout_staleness": staleness,
               "rollout_workers": workers}
    return StepView(metrics, None, context)


def test_a_trainer_waiting_on_busy_workers_needs_more_generation():
    findings = run_step_rules(_pipeline_view(trainer_idle=1.0, rollout_idle=0.05, workers=1, staleness=2))
    assert alarms(findings) == {"rollout/trainer_idle": WARNING}
    f = the_finding(findings, "rollout/trainer_idle")
    assert f.evidence["share"] == 0.5 and "50%" in f.summary
    assert "rollout.workers, now 1" in f.fix and "rollout.max_num_seqs" in f.fix
    shallow = run_step_rules(_pipeline_view(trainer_idle=1.4, rollout_idle=0.8, staleness=1))  # both sides wait
    assert alarms(shallow) == {"rollout/trainer_idle": FAULT, "rollout/rollout_idle": WARNING}
    assert "raise rollout.staleness (now 1)" in the_finding(shallow, "rollout/trainer_idle").fix
    synchronous = run_step_rules(_pipeline_view(trainer_idle=1.0, rollout_idle=0.1, staleness=0))
    assert "rollout.staleness=1" in the_finding(synchronous, "rollout/trainer_idle").fix


def test_a_waiting_trainer_with_several_workers_hears_of_streaming_and_its_micro_batches():
    plain = run_step_rules(_pipeline_view(trainer_idle=1.0, rollout_idle=0.05, workers=2, staleness=0))
    assert "rollout.stream_groups=true" in the_finding(plain, "rollout/trainer_idle").fix
    one_worker = run_step_rules(_pipeline_view(trainer_idle=1.0, rollout_idle=0.05, workers=1, staleness=0))
    assert "stream_groups" not in the_finding(one_worker, "rollout/trainer_idle").fix

    def streamed(micro, waits_for=None):
        view = _pipeline_view(trainer_idle=1.0, rollout_idle=0.05, workers=2, staleness=0,
                              **{"timing_s/stream_overlap": 0.002, "perf/stream_early_mini_batches": 2.0})
        view.context.update(rollout_stream_groups=True, stream_rows_per_worker=16, micro_batch=micro,
                            stream_update_waits_for=waits_for)
        return the_finding(run_step_rules(view), "rollout/trainer_idle")

    spanning = streamed(32)  # one micro-batch over both parts: nothing but the scoring runs early
    assert "actor.ppo_micro_batch_size=32 spans more than a worker's 16 rows" in spanning.fix
    assert spanning.evidence["stream_overlap_s"] == 0.002 and spanning.evidence["rows_per_worker"] == 16
    fitting = streamed(8)
    assert "overlapped 0.002 s" in fitting.fix and "spans" not in fitting.fix
    assert "mini-batches wait" not in fitting.fix and fitting.evidence["early_mini_batches"] == 2.0
    waiting = streamed(8, "actor.shuffle=true draws every mini-batch from the whole batch (set it false for row order)")
    assert "the update's mini-batches wait for the whole batch: actor.shuffle=true" in waiting.fix
    assert "mini-batches wait for the whole batch: actor.shuffle" in streamed(32, "actor.shuffle=true ...").fix


def test_the_monitor_context_carries_what_the_streaming_advice_reads():
    from types import SimpleNamespace

    from scalerl.health.monitor import _rollout_context, _stream_context

    rollout = SimpleNamespace(placement="standalone", staleness=0, workers=2, stream_groups=True, n=8)
    cfg = SimpleNamespace(rollout=rollout, actor=SimpleNamespace(ppo_micro_batch_size=32),
                          trainer=SimpleNamespace(batch_size=4))
    assert _rollout_context(rollout)["rollout_stream_groups"] is True
    assert _stream_context(cfg) == {"stream_rows_per_worker": 16, "micro_batch": 32}
    rollout.stream_groups = False
    assert _stream_context(cfg) == {}


def test_idle_workers_are_more_capacity_than_the_update_uses():
    findings = run_step_rules(_pipeline_view(trainer_idle=0.0, rollout_idle=1.3, workers=2, staleness=2))
    assert alarms(findings) == {"rollout/rollout_idle": FAULT}
    assert "fewer rollout workers (rollout.workers, now 2" in the_finding(findings, "rollout/rollout_idle").fix
    assert alarms(run_step_rules(_pipeline_view(trainer_idle=0.1, rollout_idle=0.2))) == {}


def test_a_long_generation_tail_is_judged_where_generation_costs():
    tail = {"response_length/mean": 20.0, "response_length/max": 128.0, "response_length/clip_ratio": 0.05}
    findings = run_step_rules(_pipeline_view(0.0, 0.0, **tail, **{"timing_s/gen": 1.0}))
    assert alarms(findings) == {"rollout/generation_tail": WARNING}
    f = the_finding(findings, "rollout/generation_tail")
    assert f.evidence["mean_over_max"] == round(20 / 128, 3) and "rollout.max_num_seqs" in f.fix and "5%" in f.fix
    cheap = run_step_rules(_pipeline_view(0.0, 0.0, **tail, **{"timing_s/gen": 0.1}))  # 5% of the step
    assert alarms(cheap) == {}


def test_agent_rollouts_bound_by_tool_latency_and_prefix_breaks_are_named():
    base = {"timing_s/step": 1.0, "agent/turns/mean": 3.0, "agent/prefix_breaks": 0.0}
    quick = dict(base, **{"agent/env_time_share": 0.2, "agent/tool_s/calc": 0.01})
    assert alarms(run_step_rules(StepView(quick, None, {"world_size": 1}))) == {}
    slow = dict(base, **{"agent/env_time_share": 0.6, "agent/tool_s/calc": 0.01, "agent/tool_s/search": 0.9})
    findings = run_step_rules(StepView(slow, None, {"world_size": 1}))
    assert alarms(findings) == {"rollout/tool_latency": WARNING}
    f = the_finding(findings, "rollout/tool_latency")
    assert "the slowest tool is search (0.9 s per call)" in f.summary and "rollout.max_num_seqs" in f.fix
    broken = dict(quick, **{"agent/prefix_breaks": 4.0})
    findings = run_step_rules(StepView(broken, None, {"world_size": 1}))
    assert alarms(findings) == {"rollout/prefix_breaks": WARNING}
    assert "<think>" in the_finding(findings, "rollout/prefix_breaks").fix


def test_colocated_runs_have_nothing_to_wait_for():
    findings = run_step_rules(StepView({"timing_s/step": 1.0}, None, {"world_size": 1, "dp_size": 1}))
    assert {f.status for f in findings if f.leaf.startswith("rollout/")} == {OK}


def test_one_rank_says_each_thing_once_and_points_at_the_phase_table():
    findings = run_step_rules(StepView({"timing_s/step": 1.0}, None, {"world_size": 1}))
    summaries = [f.summary for f in findings if f.rule in ("comm_share", "achieved_bandwidth")]
    assert summaries == ["one rank: no communication", "one rank: no link to measure"]  # not the same line twice
    (device,) = [f for f in cluster_findings(healthy_facts(nodes=1)) if f.rule == "device_models"]
    assert device.summary.endswith("(per-rank speed: the per-rank phase table of --performance-profiling)")
