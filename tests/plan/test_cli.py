"""`scalerl plan`: a 7B projection to 8 GPUs gives every phase, the command's text and exit codes, and one
prediction against a measured tiny run on this CPU (loose tolerance: benchmarks/plan_validation.py measures)."""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from scalerl.core.config import load_config
from scalerl.plan.cli import (
    Cluster,
    add_plan_arguments,
    make_plan,
    render,
    run_plan_command,
)
from scalerl.plan.memory import PHASES
from scalerl.plan.timing import step_seconds
from tests.tiny import tiny_overrides

REPO = Path(__file__).resolve().parents[2]


def test_a_7b_projection_to_8_gpus_gives_every_phase():
    cfg = load_config(None, ["actor.use_kl_loss=true", "trainer.precision=bf16", "trainer.batch_size=64",
                             "actor.ppo_micro_batch_size=4"])
    plan = make_plan(cfg, Cluster(1, 8, "h100"), model_name="qwen2.5-7b", disk_bytes_per_s=2e9,
                     widths={"prompt_width": 512, "new_tokens": 1024})
    assert plan.setup.train_width == 1536
    assert set(PHASES) <= set(plan.seconds)
    assert set(PHASES) - {"weight_sync"} <= set(plan.memory)  # colocated: no weight sync buffers
    assert all(plan.seconds[p] >= 0 for p in PHASES) and step_seconds(plan.seconds) > 0
    assert plan.memory["update"]["parameters"] > 7e9 * 4 * 0.99  # 7.6B float32 weights, unsharded (DDP)
    assert plan.unfit is not None and plan.fix is not None  # 7B with AdamW in fp32 cannot fit 80 GB unsharded
    assert plan.advice and all(why for _, why in plan.advice)
    standalone = make_plan(load_config(None, ["rollout.placement=standalone", "rollout.workers=2",
                                              "rollout.dtype=bf16", "parallel.dp_replicate=1", "parallel.dp_shard=-1"]),
                           Cluster(1, 8, "h100"), model_name="qwen2.5-7b", disk_bytes_per_s=2e9, recommend=False)
    assert "weight_sync" in standalone.memory and standalone.worker_memory["kv_cache"] > 0
    assert standalone.seconds["weight_sync"] > 0
    text = io.StringIO()
    render(plan, text)
    assert "DOES NOT FIT" in text.getvalue() and "fix:" in text.getvalue()
    # the update both ways: checkpointing keeps each layer's input only and pays the forward again
    off, on = plan.checkpointing["off"], plan.checkpointing["on"]
    assert off["activations_gb"] == pytest.approx(plan.memory["update"]["activations"] / 2**30)
    assert on["activations_gb"] < off["activations_gb"] / 4 and on["peak_gb"] < off["peak_gb"]
    assert on["seconds"] > off["seconds"] == plan.seconds["update"]
    assert "with model.activation_checkpointing=true: activations" in text.getvalue()
    assert plan.to_dict()["update_activation_checkpointing"] == plan.checkpointing


def test_the_command_writes_json_and_exits_1_when_a_phase_does_not_fit(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    out = tmp_path / "plan.json"
    code = run_plan_command(parser.parse_args(["--model", "qwen2.5-7b", "--device", "a100", "--devices-per-node", "8",
                                               "--disk-gb-per-s", "1", "--no-recommend", "--json", str(out)]))
    assert code == 1
    data = json.loads(out.read_text())
    assert data["first_unfit"]["fix"] and "datasheet" in data["calibration"]["source"]
    assert run_plan_command(parser.parse_args(["--device", "cpu", "--nodes", "2"])) == 2
    assert "--nodes 1" in capsys.readouterr().err


def _doctor_report(tmp_path: Path, gpu: str | None = "NVIDIA H100 80GB HBM3", mfu: float | None = 0.41,
                   nodes: int = 2) -> Path:
    """A doctor report of 2 nodes x 2 ranks (tests/health's recorded healthy world: 5 GB/s busbw inside a node,
    ~1.06 GB/s between them), each rank with ``gpu`` (79.1 GiB) or none, the checkpoint directory written at
    1.5 GB/s, and with ``mfu`` a profile whose update reached it."""
    from scalerl.doctor.report import DoctorReport
    from tests.health.recorded_measurements import (
        healthy_cluster_measurements,
        healthy_facts,
        sweep,
    )

    facts, measured = healthy_facts(nodes=nodes), healthy_cluster_measurements(nodes)
    for f in facts:
        f["gpus"] = [{"index": 0, "name": gpu, "memory_gb": 79.1}] if gpu else []
        for path in f["paths"]:
            path["write_bytes_per_s"] = 1.5e9 if path["role"] == "checkpoint" else 9e9
    if mfu is not None:
        measured["profile"] = {"metrics": {"perf/mfu/update": mfu}, "context": {}}
    if nodes == 1:  # one sweep over the node's four ranks
        measured["bandwidth"]["sweeps"] = [sweep("intra-node", [0, 1, 2, 3], 5e9)]
    world = {"world_size": 4, "joined": [0, 1, 2, 3], "missing": [], "launcher": "torchrun",
             "nodes": {"node0": [0, 1], "node1": [2, 3]} if nodes == 2 else {"node0": [0, 1, 2, 3]}}
    path = tmp_path / f"doctor-{(gpu or 'cpu').split()[-1]}-{nodes}node.json"
    path.write_text(json.dumps(DoctorReport(["distributed-check"], [], facts, measured, world).to_json()))
    return path


def test_a_doctor_report_of_the_cluster_replaces_the_datasheets_guesses(tmp_path, capsys):
    """`--doctor REPORT.json`: the cluster's shape, GPU and memory from the report, its links fitted to the
    report's all-reduce sweeps, its checkpoint write speed and profiled update MFU; flags given still win."""
    from scalerl.bench.calibration import doctor_link
    from scalerl.plan.timing import DoctorMeasured

    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    report = _doctor_report(tmp_path)
    cfg = ["parallel.dp_replicate=1", "parallel.dp_shard=-1", "trainer.precision=bf16", "--model", "qwen2.5-7b", "--no-recommend"]

    def plan(*flags: str) -> dict:
        out = tmp_path / "plan.json"
        assert run_plan_command(parser.parse_args([*cfg, *flags, "--json", str(out)])) in (0, 1)
        return json.loads(out.read_text())

    measured = plan("--doctor", str(report))
    assert measured["cluster"] == {"nodes": 2, "devices_per_node": 2, "device": "h100", "memory_gb": 79.1, "link": None}
    document = json.loads(report.read_text())
    cal = measured["calibration"]
    assert cal["intra"]["bytes_per_s"] == pytest.approx(doctor_link(document, "intra-node", "nccl").bytes_per_s)
    assert cal["inter"]["bytes_per_s"] == pytest.approx(doctor_link(document, "inter-node", "nccl").bytes_per_s)
    assert cal["inter"]["bytes_per_s"] < 2e9 and "inter-node sweep, 2 nodes" in cal["inter"]["source"]
    assert cal["disk_bytes_per_s"] == 1.5e9  # the checkpoint directory's, not the output's
    assert "MFU 0.41 (train, measured by the doctor's profile)" in cal["source"] and str(report) in cal["source"]
    assert "; calibrated from scalerl doctor report" in cal["source"]
    assert any(n.startswith("checkpoint writes at 1.50 GB/s per node (the doctor's raw fsynced write") for n in cal["notes"])
    # the same cluster from the datasheets (InfiniBand NDR between the nodes, 0.35 MFU): the doctor's slow
    # Ethernet makes the sharded update slower, its higher MFU the compute faster
    nominal = plan("--nodes", "2", "--devices-per-node", "2", "--device", "h100", "--disk-gb-per-s", "1.5")
    assert measured["seconds"]["update"] != pytest.approx(nominal["seconds"]["update"], rel=0.01)
    assert "datasheet" in nominal["calibration"]["source"] and "doctor" not in nominal["calibration"]["source"]
    # flags given on the command line win over the report
    given = plan("--doctor", str(report), "--devices-per-node", "8", "--link", "ib-ndr", "--mfu-train", "0.3")
    assert given["cluster"]["devices_per_node"] == 8 and given["cluster"]["nodes"] == 2
    assert given["calibration"]["inter"]["bytes_per_s"] == pytest.approx(50e9)
    assert "MFU 0.3 (train, given)" in given["calibration"]["source"]
    # a CPU cluster's report: its ranks per node and memory over them; its links stay this machine's own fits
    cpu_report = _doctor_report(tmp_path, gpu=None, mfu=None)
    cpu = DoctorMeasured.read(str(cpu_report))
    assert (cpu.device, cpu.nodes, cpu.devices_per_node, cpu.memory_gb, cpu.mfu_train) == ("cpu", 2, 2, 32.0, None)
    one_node = DoctorMeasured.read(str(_doctor_report(tmp_path, gpu=None, mfu=None, nodes=1)))
    assert one_node.nodes == 1 and one_node.inter is None and one_node.intra is not None and not one_node.notes
    assert run_plan_command(parser.parse_args(["--doctor", str(cpu_report)])) == 2
    assert "the 2 nodes of" in capsys.readouterr().err
    # a GPU without a datasheet here: --device names the closest, the rest of the report still counts
    odd = _doctor_report(tmp_path, gpu="Vendor X1000")
    assert run_plan_command(parser.parse_args([*cfg, "--doctor", str(odd)])) == 2
    assert "no datasheet here for its GPU" in capsys.readouterr().err
    assert plan("--doctor", str(odd), "--device", "a100")["cluster"]["memory_gb"] is None  # the report's is an X1000's
    # not a doctor report: the file and the command that writes one
    (tmp_path / "plan.json").write_text(json.dumps({"schema": "scalerl.plan/1"}))
    assert run_plan_command(parser.parse_args(["--doctor", str(tmp_path / "plan.json")])) == 2
    err = capsys.readouterr().err
    assert "not a scalerl doctor report (schema 'scalerl.plan/1'" in err and "scalerl doctor --distributed-check" in err


def test_prediction_against_a_measured_tiny_run(tmp_path):
    overrides = tiny_overrides("trainer.total_steps=3", "trainer.cpu_threads=1", f"trainer.output_dir={tmp_path}")
    cfg = load_config(None, overrides)
    plan = make_plan(cfg, Cluster(1, 1, "cpu"), overrides=overrides, recommend=False)
    subprocess.run([sys.executable, "-m", "scalerl", "train", *overrides], cwd=REPO, check=True,
                   capture_output=True, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "timing_s/step" in r]
    measured_gb = max(r["perf/max_memory_gb"] for r in steps)
    predicted_gb = max(sum(p.values()) for p in plan.memory.values()) / 2**30
    assert 0.7 < predicted_gb / measured_gb < 1.3
    measured_s = min(r["timing_s/step"] for r in steps[1:])
    assert 0.2 < step_seconds(plan.seconds) / measured_s < 5  # tiny steps on a shared machine: loose


def test_a_two_rank_plan_measures_its_layout_each_collective_and_the_machines_load(tmp_path):
    """Two ranks on this CPU: the loopback fit per collective (all-reduce, all-gather, reduce-scatter), the run
    itself on its 32-wide model under DDP for the layout's own cost per phase (DDP's hooks and bucketed
    all-reduce in the update), and the other work on the machine, each in the calibration and its notes."""
    from scalerl.plan.timing import LOOPBACK_OPS, STEP_PHASES, Calibration

    overrides = tiny_overrides("trainer.cpu_threads=1", f"trainer.output_dir={tmp_path / 'run'}")
    plan = make_plan(load_config(None, overrides), Cluster(1, 2, "cpu"), overrides=overrides, recommend=False)
    cal = plan.calibration
    assert set(cal.intra_ops) == set(LOOPBACK_OPS) and cal.intra == cal.intra_ops["all_reduce"]
    assert all(0 < link.bytes_per_s < float("inf") for link in cal.intra_ops.values())
    assert set(cal.layout_s) == set(STEP_PHASES) and min(cal.layout_s.values()) >= 0
    assert cal.layout_s["update"] > 0  # DDP's hooks and its all-reduce's wait: not in the plain probe's update
    assert any(note.startswith("layout cost per step") for note in cal.notes), cal.notes
    assert any(note.startswith("machine busy") for note in cal.notes) and cal.other_runnable >= 0
    assert cal.copy_bytes_per_s > 1e8
    # the layout's cost is in the plan's phases, and a stored calibration gives the same plan without probing
    assert plan.seconds["update"] >= cal.layout_s["update"]
    again = make_plan(load_config(None, overrides), Cluster(1, 2, "cpu"), overrides=overrides, recommend=False,
                      calibration=Calibration.from_dict(json.loads(json.dumps(cal.to_dict()))))
    assert again.seconds == plan.seconds
    assert not (tmp_path / "run").exists()  # the probes wrote nowhere near the run's output


def test_a_rank_under_the_layout_holds_the_runtime_its_layout_run_measured(monkeypatch):
    """The layout probe's run peaks above one plain process's runtime (the distributed stack): the plan's
    runtime is the larger, said in the note; a smaller peak changes nothing."""
    from scalerl.plan import timing
    from scalerl.plan.cli import calibrate_layout, setup_from_config

    overrides = tiny_overrides("trainer.cpu_threads=1")
    cfg = load_config(None, overrides)
    cluster = Cluster(1, 2, "cpu")
    setup = setup_from_config(cfg, cluster)[0]
    rates = timing.ComputeRates(1e9, 1e9, 1e9, 0.0)
    link = timing.LinkCost(1e-4, 1e9, "test")
    for peak, expected in ((600 * 2**20, 600 * 2**20), (100 * 2**20, 400 * 2**20)):
        measured = dict.fromkeys(timing.STEP_PHASES, 0.01) | {"step": 0.06, "peak_bytes": peak}
        monkeypatch.setattr(timing, "measure_layout_run", lambda *a, m=measured, **k: m)
        cal = timing.Calibration(rates, 1e-9, 1e9, link, link, runtime_bytes=400 * 2**20)
        note = calibrate_layout(cfg, cluster, setup, cal, None, overrides, 1, 1.0)
        assert cal.runtime_bytes == expected
        assert ("runtime RSS 600 MiB under the layout" in note) == (peak > 400 * 2**20), note


def test_a_multi_turn_agent_is_planned_at_its_episodes_token_budget():
    """An agent run's trajectory is its turns and the environment's answers after the prompt: the plan widens
    the response to the loop's budget (or rollout.agent.max_total_tokens) and says so, tools' time aside."""
    from scalerl.plan import timing
    from scalerl.plan.cli import setup_from_config
    from scalerl.plan.memory import phase_parts

    agent = ["data.task=tool_arithmetic", "rollout.agent.env=tools",
             "rollout.agent.tools=scalerl.data.tool_arithmetic:op", "data.chat_template=true"]
    plain, _ = setup_from_config(load_config(None, tiny_overrides()), Cluster(1, 1, "cpu"))
    cfg = load_config(None, tiny_overrides(*agent, "rollout.agent.max_turns=3"))
    setup, notes = setup_from_config(cfg, Cluster(1, 1, "cpu"))
    assert setup.new_tokens == 3 * (cfg.rollout.max_new_tokens + 64) > plain.new_tokens
    # generation decodes the three turns and prefills each of the two answers in a call, not the whole budget
    decode = 3 * cfg.rollout.max_new_tokens + 2
    assert setup.decode_steps == decode and f"in at most {decode} forward calls" in " ".join(notes)
    # a decode step's fixed cost only: generation's time is the forward calls it makes
    rates = timing.ComputeRates(float("inf"), float("inf"), float("inf"), 0.0, gen_step_s=0.05)
    cal = timing.Calibration(rates, 0.0, 0.0, timing.LinkCost(0.0, float("inf"), "none"),
                             timing.LinkCost(0.0, float("inf"), "none"))
    gen = timing.phase_seconds(setup, cal)["generation"]
    whole_budget = timing.phase_seconds(setup.replace(decode_calls=0), cal)["generation"]
    assert gen == pytest.approx(whole_budget * decode / setup.new_tokens)
    assert phase_parts(setup)["generation"]["kv_cache"] > phase_parts(plain)["generation"]["kv_cache"]
    for budget in (200, cfg.data.max_prompt_length + 20):  # above the turns' decode calls, then below
        capped, _ = setup_from_config(load_config(None, tiny_overrides(*agent, "rollout.agent.max_turns=3",
                                                                       f"rollout.agent.max_total_tokens={budget}")),
                                      Cluster(1, 1, "cpu"))
        assert capped.new_tokens == budget - cfg.data.max_prompt_length
        assert capped.decode_steps == min(capped.new_tokens, decode)
