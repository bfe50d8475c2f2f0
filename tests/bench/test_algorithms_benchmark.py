"""benchmarks/algorithms.py at toy size: two variants from one shared SFT start, and the table it prints."""

from __future__ import annotations

import json

import pytest

from tests.tiny import tiny_overrides


def test_variants_cover_every_registry_name_once(repo_script):
    from scalerl.algorithms import ADVANTAGE_ESTIMATORS, POLICY_LOSSES

    bench = repo_script("benchmarks/algorithms.py")
    variants = bench.all_variants()
    assert variants[0] == "grpo+vanilla" and len(set(variants)) == len(variants)
    assert {"rloo+vanilla", "remax+vanilla", "gae+vanilla", "gpg+vanilla", "grpo+gpg", "grpo+gspo"} <= set(variants)
    assert not [v for v in variants if v.endswith("_vectorized")]  # aliases of grpo and rloo
    assert len(variants) == 1 + (len(ADVANTAGE_ESTIMATORS) - 3) + (len(POLICY_LOSSES) - 1)
    assert bench.variant_overrides("rloo") == ["algorithm.adv_estimator=rloo", "actor.policy_loss=vanilla"]
    assert bench.variant_overrides("gspo") == ["algorithm.adv_estimator=grpo", "actor.policy_loss=gspo"]
    with pytest.raises(SystemExit, match="unknown variant"):
        bench.variant_overrides("not_an_estimator")
    with pytest.raises(SystemExit, match="ambiguous"):  # gpg is an estimator and a loss
        bench.variant_overrides("gpg")


def test_a_failed_variant_is_a_row_of_its_own_and_a_failed_baseline_stops(repo_script):
    bench = repo_script("benchmarks/algorithms.py")
    run = {"initial": 0.3, "final": 0.5, "step_s": 1.0, "steps": 2}
    results = {"grpo+vanilla": {0: run}, "rloo+vanilla": {0: {**run, "final": 0.6, "step_s": 1.5}},
               "remax+vanilla": {0: {"error": "exit 1, see remax.log"}}}
    rows = {r["variant"]: r for r in bench.table(results, [0])}
    assert rows["rloo+vanilla"]["delta_points"] == pytest.approx(10.0)
    assert rows["rloo+vanilla"]["step_ratio"] == pytest.approx(1.5)
    assert rows["remax+vanilla"] == {"variant": "remax+vanilla", "error": "seed 0: exit 1, see remax.log"}
    text = bench.format_table(list(rows.values()), [0], {0: 0.3})
    assert "| `remax+vanilla` | failed: seed 0: exit 1" in text and "| `rloo+vanilla` | 60.0% | 60.0 | +10.0 points" in text
    with pytest.raises(SystemExit, match="baseline grpo\\+vanilla failed"):
        bench.table({"grpo+vanilla": {0: {"error": "exit 1"}}}, [0])


def test_two_variants_one_seed_two_steps_give_a_table_with_numbers(tmp_path, capsys, repo_script):
    bench = repo_script("benchmarks/algorithms.py")
    out = tmp_path / "bench"
    # the demo's model, task sizes and SFT at toy size; the ppo micro-batch must divide the tiny mini-batch
    overrides = tiny_overrides("trainer.total_steps=2", "sft.steps=3", "data.num_val=8")
    code = bench.main(["--seeds", "0", "--steps", "2", "--variants", "rloo", "--out", str(out), "--yes",
                       "--json", str(tmp_path / "table.json"), "--set", *overrides])
    assert code == 0
    printed = capsys.readouterr().out
    assert "2 variants x 1 seeds x 2 RL steps" in printed
    rows = {line.split("|")[1].strip(): line for line in printed.splitlines() if line.startswith("| `")}
    assert set(rows) == {"`grpo+vanilla`", "`rloo+vanilla`"}
    assert "baseline" in rows["`grpo+vanilla`"] and " points" in rows["`rloo+vanilla`"]
    result = json.loads((tmp_path / "table.json").read_text())
    by_name = {r["variant"]: r for r in result["rows"]}
    for row in by_name.values():
        assert 0 <= row["accuracy"] <= 1 and row["step_s"] > 0
    assert by_name["grpo+vanilla"]["delta_points"] == 0
    assert by_name["rloo+vanilla"]["delta_points"] == pytest.approx(
        100 * (by_name["rloo+vanilla"]["accuracy"] - by_name["grpo+vanilla"]["accuracy"]))
    runs = result["runs"]
    assert runs["rloo+vanilla"]["0"]["steps"] == 2 and runs["grpo+vanilla"]["0"]["steps"] == 2
    # both variants started from the one SFT model of the seed: the same held-out accuracy before RL
    assert runs["rloo+vanilla"]["0"]["initial"] == runs["grpo+vanilla"]["0"]["initial"]
    assert len(list((out / "seed0").glob("sft/model/model.safetensors"))) == 1
    config = (out / "seed0" / "rloo+vanilla" / "config.yaml").read_text()
    assert "adv_estimator: rloo" in config and "init_from: " + str(out / "seed0" / "sft" / "model") in config
