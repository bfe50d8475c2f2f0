"""Loading a HF directory into a laid-out model, each rank reading its own slices: at world 2 under FSDP2
and under TP, the gathered parameters equal a whole-model load's, for tied and untied embeddings, the
value model and the frozen reference; logits agree; a missing tensor is an error naming it; the laid-out
model exports (one tensor at a time) the same files as the whole one. One spawned gloo group runs every
check."""

from __future__ import annotations

import json

import pytest
import torch

from scalerl.models.hf_checkpoint import CheckpointFormatError, save_pretrained
from scalerl.models.sharded_loading import is_on_meta, load_local_shards, meta_model
from tests.spawned_group import run_in_group
from tests.tiny import tiny_model


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _compare(laid_out, whole, prefix: str = "", absent: frozenset = frozenset()) -> float:
    """The largest difference between ``laid_out``'s gathered parameters and ``whole``'s (by name), every
    one of ``whole``'s but ``absent`` compared."""
    expected = {n: p.detach() for n, p in whole.named_parameters() if n not in absent}
    worst = 0.0
    names = []
    for name, p in laid_out.named_parameters():
        own = name.removeprefix(prefix)
        if own not in expected:
            continue
        names.append(own)
        worst = max(worst, float((_full(p.detach()) - expected[own]).abs().max()))
    assert set(names) == set(expected), f"parameters not compared: {set(expected) - set(names)}"
    return worst


def _checks(rank: int, dirs: dict[str, str]) -> dict[str, float]:
    import copy

    from scalerl.checkpoint.export import export_hf_model
    from scalerl.core.config import ParallelSection
    from scalerl.models.hf_checkpoint import from_pretrained
    from scalerl.models.value_model import ValueModel
    from scalerl.parallel.distributed import init_distributed
    from scalerl.parallel.parallelize import parallelize

    out: dict[str, float] = {}
    ids = torch.tensor([[1, 5, 9, 3, 7, 2], [4, 4, 8, 1, 0, 6]])
    for layout, section in (("fsdp", ParallelSection(dp_replicate=1, dp_shard=2)),
                            ("tp", ParallelSection(dp_replicate=1, tp=2))):
        ctx = init_distributed(section, torch.device("cpu"))
        for kind, path in dirs.items():
            if kind in ("broken", "run", "exports"):
                continue
            whole = from_pretrained(path)
            model = meta_model(path)
            out[f"{layout}/{kind}/meta_before"] = float(is_on_meta(model))
            critic = ValueModel(model)
            reference = copy.deepcopy(model).requires_grad_(False)
            parts = parallelize(model, ctx)
            parallelize(critic, ctx)
            parallelize(reference, ctx, trainable=False)
            read = sum(load_local_shards(m, path) for m in (model, critic, reference))
            out[f"{layout}/{kind}/bytes_read"] = float(read)
            out[f"{layout}/{kind}/meta_after"] = float(is_on_meta(model) or is_on_meta(critic))
            out[f"{layout}/{kind}/policy"] = _compare(model, whole)
            out[f"{layout}/{kind}/reference"] = _compare(reference, whole)
            out[f"{layout}/{kind}/critic"] = _compare(critic, whole, prefix="backbone.",
                                                      absent=frozenset({"lm_head.weight"}))
            out[f"{layout}/{kind}/value_head"] = float(sum(_full(p.detach()).abs().sum()
                                                            for p in critic.value_head.parameters()))
            tied = whole.config.tie_word_embeddings
            if tied:  # one parameter after loading, as in the whole model
                out[f"{layout}/{kind}/tied"] = float(model.lm_head.weight is model.embed_tokens.weight)
            with torch.no_grad():
                logits = _full(parts.trained(ids))
                out[f"{layout}/{kind}/logits"] = float((logits - whole(ids)).abs().max())
            export_hf_model(model, None, f"{dirs['exports']}/{layout}-{kind}", ctx, dtype=torch.bfloat16,
                            max_shard_bytes=6000)
        try:
            broken = meta_model(dirs["broken"])
            parallelize(broken, ctx)
            load_local_shards(broken, dirs["broken"])
            out[f"{layout}/broken"] = 0.0
        except CheckpointFormatError as err:
            out[f"{layout}/broken"] = float("layers.1.mlp.up_proj.weight" in str(err))
    out.update(_trainer_checks(dirs["run"]))
    return out


def _trainer_checks(path: str) -> dict[str, float]:
    """A PPO run (critic, KL reference) under FSDP from a model directory: the trainer builds on meta and
    reads shards, its three models equal the directory's, and a step trains."""
    from scalerl.core.config import load_config
    from scalerl.models.hf_checkpoint import from_pretrained
    from scalerl.trainer.rl_trainer import RLTrainer
    from tests.tiny import tiny_overrides

    import tempfile

    out_dir = tempfile.mkdtemp(prefix="sharded-run-")
    cfg = load_config(None, tiny_overrides(
        f"model.path={path}", "model.tokenizer=builtin", "parallel.dp_replicate=1", "parallel.dp_shard=2",
        "algorithm.adv_estimator=gae", "actor.use_kl_loss=true", "trainer.total_steps=1",
        f"trainer.output_dir={out_dir}", "trainer.batch_size=2", "actor.ppo_mini_batch_size=8",
        "actor.ppo_micro_batch_size=4", "data.num_val=2"))
    trainer = RLTrainer.from_config(cfg)
    whole = from_pretrained(path)
    out = {"run/source": float(trainer.weights_source == path),
           "run/policy": _compare(trainer.policy.model, whole),
           "run/reference": _compare(trainer.reference.model, whole),
           "run/critic": _compare(trainer.critic.model, whole, prefix="backbone.",
                                  absent=frozenset({"lm_head.weight"}))}
    metrics = trainer.train_step()
    actor = [v for k, v in metrics.items() if k.startswith(("actor/", "critic/"))]
    out["run/loss_finite"] = float(len(actor) > 2 and all(v == v for v in actor))
    trainer.close()
    return out


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("sharded")
    dirs = {}
    # vocabulary 67: FSDP's dim-0 shards of the embedding are uneven (34 + 33 rows)
    for kind, changes in (("tied", {}), ("untied", {"tie_word_embeddings": False, "model_type": "llama",
                                                     "attention_bias": False, "vocab_size": 68})):
        model = tiny_model(seed=3, vocab_size=changes.pop("vocab_size", 67), **changes).to(torch.bfloat16)
        dirs[kind] = str(save_pretrained(model, root / kind, max_shard_bytes=6000))
    broken = root / "broken"
    save_pretrained(tiny_model(seed=3, vocab_size=67).to(torch.bfloat16), broken, max_shard_bytes=6000)
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    index["weight_map"].pop("model.layers.1.mlp.up_proj.weight")  # the index no longer names it ...
    assert len(set(index["weight_map"].values())) > 1
    from safetensors.torch import load_file, save_file

    for file in sorted(broken.glob("model-*.safetensors")):  # ... and no shard holds it
        tensors = load_file(file)
        tensors.pop("model.layers.1.mlp.up_proj.weight", None)
        save_file(tensors, file, metadata={"format": "pt"})
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    dirs["broken"] = str(broken)
    from scalerl.models.tokenizer import CharTokenizer
    from tests.tiny import tiny_run_model

    dirs["run"] = str(save_pretrained(tiny_run_model(CharTokenizer(), seed=2), root / "run"))
    dirs["exports"] = str(root / "exports")
    return dirs


@pytest.fixture(scope="module")
def results(model_dirs):
    return run_in_group(_checks, 2, model_dirs, timeout_s=600)


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
@pytest.mark.parametrize("kind", ["tied", "untied"])
def test_sharded_load_equals_whole_load(results, layout, kind):
    for rank_results in results:
        r = {k.removeprefix(f"{layout}/{kind}/"): v for k, v in rank_results.items() if k.startswith(f"{layout}/{kind}/")}
        assert r["meta_before"] == 1.0 and r["meta_after"] == 0.0
        assert r["policy"] == 0.0 and r["reference"] == 0.0 and r["critic"] == 0.0
        assert r["value_head"] == 0.0
        assert r["logits"] < 1e-5
        if kind == "tied":
            assert r["tied"] == 1.0


def test_each_rank_reads_a_share(results):
    """FSDP splits every tensor over the two ranks: each reads about half the bytes (TP keeps norms,
    biases of row-wise layers and tied embeddings whole, so it reads more than half)."""
    for layout in ("fsdp", "tp"):
        per_rank = [r[f"{layout}/tied/bytes_read"] for r in results]
        whole = sum(per_rank) if layout == "fsdp" else None
        if whole is not None:
            assert max(per_rank) <= 0.55 * whole, per_rank


def test_missing_tensor_is_named(results):
    for r in results:
        assert r["fsdp/broken"] == 1.0 and r["tp/broken"] == 1.0


def test_trainer_loads_shards_for_policy_critic_and_reference(results):
    for r in results:
        assert r["run/source"] == 1.0
        assert r["run/policy"] == 0.0 and r["run/reference"] == 0.0 and r["run/critic"] == 0.0
        assert r["run/loss_finite"] == 1.0


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
@pytest.mark.parametrize("kind", ["tied", "untied"])
def test_laid_out_export_writes_the_source_files(results, model_dirs, layout, kind):
    """The source was bf16 in 6000-byte shards: the export from the laid-out model is that, file for file."""
    from pathlib import Path

    from safetensors.torch import load_file

    source, exported = Path(model_dirs[kind]), Path(model_dirs["exports"]) / f"{layout}-{kind}"
    source_index = json.loads((source / "model.safetensors.index.json").read_text())
    index = json.loads((exported / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == source_index["weight_map"]
    assert json.loads((exported / "config.json").read_text())["torch_dtype"] == "bfloat16"
    for file in sorted(set(index["weight_map"].values())):
        ours, theirs = load_file(exported / file), load_file(source / file)
        assert sorted(ours) == sorted(theirs)
        for name in theirs:
            assert ours[name].dtype == torch.bfloat16 and torch.equal(ours[name], theirs[name]), name
