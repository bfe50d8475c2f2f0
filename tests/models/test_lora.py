"""LoRA adapters: frozen base, adapter-only optimizer state, PEFT's format both ways (logits equal on the
transformers model), the merged export, bitwise resume, adapter-only weight sync and its bytes, DDP and FSDP2
training (one spawned gloo group), and the bad inputs named by key."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from scalerl.core.config import ConfigError, load_config
from scalerl.models.hf_checkpoint import from_pretrained, save_pretrained
from scalerl.models.lora import (
    ADAPTER_CONFIG_FILE,
    LoRALinear,
    adapter_parameters,
    apply_lora,
    load_adapter,
    merge_lora,
    save_adapter,
)
from scalerl.models.tokenizer import CharTokenizer
from scalerl.trainer.optim import build_optimizer
from tests.spawned_group import run_in_group
from tests.tiny import tiny_model, tiny_overrides, tiny_run_model

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
ATTENTION_AND_MLP = 7  # projections per dense layer that all-linear adapts


def randomize_adapters(model, seed: int) -> None:
    """Non-zero B (the fresh init leaves the model equal to its base, which would test nothing)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in adapter_parameters(model):
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def ids(vocab: int = 64) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(3))


def test_bad_inputs_are_errors_naming_the_key():
    for overrides, key in ((["model.lora.rank=-1"], "model.lora.rank"), (["model.lora.rank=4", "model.lora.alpha=0"],
                                                                           "model.lora.alpha"),
                           (["model.lora.rank=4", "parallel.tp=2"], "parallel.tp"),
                           (["model.lora.rank=4", "parallel.pp=2"], "parallel.pp"),
                           (["model.lora.rank=4", "model.implementation=transformers", "model.path=x"],
                            "model.implementation=transformers")):
        with pytest.raises(ConfigError, match=key):
            load_config(None, overrides)
    with pytest.raises(ConfigError, match=r"model.lora.target_modules: 'qkv_proj' matches no module.*q_proj"):
        apply_lora(tiny_model(), 4, 8.0, 0.0, ["q_proj", "qkv_proj"])


def test_base_frozen_and_optimizer_state_scales_with_adapters():
    model = tiny_model()
    x = ids()
    before = model(x).detach()
    names = apply_lora(model, 4, 8.0, 0.0, ["all-linear"], seed=1)
    assert len(names) == ATTENTION_AND_MLP * model.config.num_hidden_layers
    assert torch.equal(model(x), before)  # B starts at zero: the model is its base
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    assert "layers.0.self_attn.q_proj.weight" in base  # the base's names are unchanged
    optimizer, _ = build_optimizer([(model.parameters(), 1e-2)], weight_decay=0.0)
    for _ in range(2):
        optimizer.zero_grad()
        model(x).float().logsumexp(-1).mean().backward()
        optimizer.step()
    assert len(optimizer.state) == len(trainable)
    state_elems = sum(s["exp_avg"].numel() for s in optimizer.state.values())
    assert state_elems == sum(p.numel() for _, p in adapter_parameters(model)) < 0.5 * sum(v.numel() for v in base.values())
    for n, p in model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, base[n]), n
    assert not torch.equal(model(x), before)  # the adapters trained
    # A frozen bf16 base with fp32 adapters: gradients reach only the adapters.
    half = tiny_model()
    apply_lora(half, 4, 8.0, 0.1, ["q_proj", "v_proj"], base_dtype=torch.bfloat16)
    q = half.layers[0].self_attn.q_proj
    assert isinstance(q, LoRALinear) and q.weight.dtype == torch.bfloat16 and q.lora_A.weight.dtype == torch.float32
    half(x).float().sum().backward()
    assert q.weight.grad is None and q.lora_B.weight.grad.abs().sum() > 0  # (A's is zero while B is)


def test_peft_round_trip_both_ways_and_merge(tmp_path):
    base_dir = tmp_path / "base"
    save_pretrained(tiny_model(seed=5), base_dir)
    ours = from_pretrained(base_dir)
    apply_lora(ours, 4, 8.0, 0.0, ["all-linear"])
    randomize_adapters(ours, 7)
    adapter = save_adapter(ours, tmp_path / "adapter", base_model=str(base_dir))
    written = json.loads((adapter / ADAPTER_CONFIG_FILE).read_text())
    assert (written["peft_type"], written["r"], written["lora_alpha"], written["bias"]) == ("LORA", 4, 8.0, "none")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    peft_model = peft.PeftModel.from_pretrained(hf, str(adapter))
    x = ids()
    with torch.no_grad():
        expected = ours(x)
        assert (peft_model(input_ids=x).logits - expected).abs().max() <= 1e-5
        merged_hf = peft_model.merge_and_unload()
        merged_ours = merge_lora(copy.deepcopy(ours))
        assert not any(isinstance(m, LoRALinear) for m in merged_ours.modules())
        assert (merged_ours(x) - merged_hf(input_ids=x).logits).abs().max() <= 1e-5

    # PEFT's own adapter (q and v only, random B) into scalerl's decoder.
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    theirs = peft.get_peft_model(hf, peft.LoraConfig(r=2, lora_alpha=6, target_modules=["q_proj", "v_proj"],
                                                     init_lora_weights=False, task_type="CAUSAL_LM"))
    theirs.save_pretrained(str(tmp_path / "peft_adapter"))
    loaded = from_pretrained(base_dir)
    names = load_adapter(loaded, tmp_path / "peft_adapter")
    assert sorted(n.rsplit(".", 1)[-1] for n in names) == ["q_proj"] * 2 + ["v_proj"] * 2
    with torch.no_grad():
        assert (loaded(x) - theirs(input_ids=x).logits).abs().max() <= 1e-5


def test_adapter_only_weight_sync_lands_and_counts_adapter_bytes():
    from scalerl.comm.weights.channel import InProcessChannel
    from scalerl.comm.weights.sender import WeightSender
    from scalerl.rollout.engines.builtin import BuiltinEngine
    from scalerl.rollout.engines.weight_loading import engine_weight_receiver
    from scalerl.rollout.weight_sync import synced_tensors

    trainer_model = tiny_model(hidden_size=64, intermediate_size=128)
    worker_model = copy.deepcopy(trainer_model)
    for m in (trainer_model, worker_model):  # a worker adapts the same modules (`RolloutWorker`)
        apply_lora(m, 2, 4.0, 0.0, ["all-linear"], seed=1)
    worker_model.to(torch.bfloat16).requires_grad_(False)
    receiver = engine_weight_receiver(BuiltinEngine(worker_model, pad_token_id=0))
    sender = WeightSender(torch.bfloat16, 1 << 16, InProcessChannel([receiver]), mode="delta")
    randomize_adapters(trainer_model, 2)
    first = sender.sync(synced_tensors(trainer_model))
    randomize_adapters(trainer_model, 3)
    second = sender.sync(synced_tensors(trainer_model))
    for name, p in adapter_parameters(worker_model):
        assert torch.equal(p, dict(adapter_parameters(trainer_model))[name].detach().to(torch.bfloat16)), name
    adapter_bytes = 2 * sum(p.numel() for _, p in adapter_parameters(trainer_model))
    full_bytes = 2 * sum(p.numel() for n, p in trainer_model.named_parameters() if ".lora_" not in n)
    assert first.full_push and first.full_bytes == adapter_bytes
    plan_bytes = len(sender.plan.to_json().encode())  # a full push ships the plan once
    assert adapter_bytes < first.bytes < adapter_bytes + plan_bytes + 1024 and second.bytes <= adapter_bytes + 1024
    assert first.bytes < 0.2 * full_bytes

    # An engine with weights of its own (vLLM) gets the merged weights of the adapted modules, nothing else.
    from scalerl.parallel.parallelize import ModuleParts
    from scalerl.rollout.weight_sync import LoadIntoEngine, SharedWeights

    class RecordingEngine:
        def __init__(self):
            self.loaded: dict = {}

        def load_weights(self, named):
            self.loaded = {n: t.clone() for n, t in named}
            return sum(t.numel() * t.element_size() for t in self.loaded.values())

    engine = RecordingEngine()
    LoadIntoEngine(engine, ModuleParts(trainer_model, trainer_model), SharedWeights()).sync()
    merged = merge_lora(copy.deepcopy(trainer_model)).state_dict()
    assert sorted(engine.loaded) == sorted(f"{n}.weight" for n, m in trainer_model.named_modules()
                                           if isinstance(m, LoRALinear))
    for name, t in engine.loaded.items():
        assert torch.equal(t, merged[name]), name


def _train_in_group(rank: int, root: str, base_dir: str) -> dict:
    """SFT with LoRA under DDP, then FSDP2, then FSDP2 over a bf16 base, in the same two processes (adapters
    per layout); then RL with one trainer and one standalone rollout worker."""
    from scalerl.trainer.sft_trainer import SFTTrainer

    out = {}
    for layout, dims in (("ddp", ["parallel.dp_replicate=2", "parallel.dp_shard=1"]),
                         ("fsdp", ["parallel.dp_replicate=1", "parallel.dp_shard=2"]),
                         ("fsdp_bf16", ["parallel.dp_replicate=1", "parallel.dp_shard=2",
                                        "model.lora.base_dtype=bfloat16"])):
        cfg = load_config(None, tiny_overrides(f"trainer.output_dir={root}/{layout}", f"model.path={base_dir}",
                                               "model.lora.rank=4", "model.lora.alpha=8", "sft.steps=2",
                                               "sft.lr=1e-2", *dims))
        trainer = SFTTrainer.from_config(cfg)
        base = {n: p.detach().clone() for n, p in trainer.policy.model.named_parameters() if not p.requires_grad}
        trainer.fit()
        model = trainer.policy.model
        frozen_kept = all(torch.equal(_full(p), _full(base[n])) for n, p in model.named_parameters()
                          if not p.requires_grad)
        out[layout] = {"adapters": {n: _full(p).clone() for n, p in adapter_parameters(model)},
                       "frozen_kept": frozen_kept, "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
                       "optimizer_params": sum(len(g["params"])
                                                                           for g in trainer.optimizer.param_groups)}
    # RL with a standalone rollout worker (rank 1): the pushes carry the adapters, which land by name there.
    from scalerl.trainer.rl_trainer import train

    train(load_config(None, tiny_overrides(f"trainer.output_dir={root}/rl", f"model.path={base_dir}",
                                           "model.lora.rank=4", "rollout.placement=standalone", "actor.lr=1e-2",
                                           "data.reward=scalerl.verify:response_length_reward")))
    return out


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


@pytest.fixture
def base_dir(tmp_path):
    path = tmp_path / "base"
    save_pretrained(tiny_run_model(CharTokenizer()), path, tokenizer=CharTokenizer())
    return path


def test_ddp_and_fsdp2_train_the_adapters_alike(tmp_path, base_dir):
    ranks = run_in_group(_train_in_group, 2, str(tmp_path), str(base_dir), timeout_s=900)
    adapters = 2 * ATTENTION_AND_MLP * 2  # A and B of 7 projections in 2 layers
    for layout in ("ddp", "fsdp", "fsdp_bf16"):
        for r in ranks:
            assert r[layout]["frozen_kept"] and r[layout]["optimizer_params"] == adapters
        for name, t in ranks[0][layout]["adapters"].items():
            assert torch.equal(t, ranks[1][layout]["adapters"][name]), (layout, name)
    assert ranks[0]["fsdp_bf16"]["dtypes"] == ["torch.bfloat16", "torch.float32"]  # base bf16, adapters fp32
    assert all(t.dtype == torch.float32 for t in ranks[0]["fsdp_bf16"]["adapters"].values())
    ddp, fsdp = ranks[0]["ddp"]["adapters"], ranks[0]["fsdp"]["adapters"]
    assert any(t.abs().sum() > 0 for n, t in ddp.items() if "lora_B" in n)  # trained
    for name in ddp:
        torch.testing.assert_close(fsdp[name], ddp[name], atol=1e-5, rtol=1e-4)
    rows = [json.loads(x) for x in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "comm/weight_sync_bytes" in r]
    assert len(rows) == 2
    adapter_elems = sum(t.numel() for t in ddp.values())
    for row in rows:  # every push: the adapters only, a fraction of the whole model's bytes
        assert 0 < row["comm/weight_sync_bytes"] < 0.3 * row["weight_sync/full_model_bytes"], row
        assert row["comm/weight_sync_bytes"] < 4 * adapter_elems + 4096  # bounded by the adapters, plan included
    # The run's export under FSDP2 is PEFT's adapter directory.
    exported = tmp_path / "fsdp" / "sft" / "model"
    assert (exported / ADAPTER_CONFIG_FILE).is_file() and (exported / "adapter_model.safetensors").is_file()


def test_resume_is_bitwise_and_export_merge_matches_peft(tmp_path, base_dir):
    from scalerl.checkpoint.export import export_checkpoint
    from scalerl.trainer.sft_trainer import SFTTrainer

    def run(out, *extra):
        cfg = load_config(None, tiny_overrides(f"trainer.output_dir={tmp_path / out}", f"model.path={base_dir}",
                                               "model.lora.rank=4", "model.lora.alpha=8", "sft.lr=1e-2", *extra))
        trainer = SFTTrainer.from_config(cfg)
        trainer.fit()
        return trainer

    straight = run("a", "sft.steps=4")
    assert any(p.abs().sum() > 0 for n, p in adapter_parameters(straight.policy.model) if "lora_B" in n)  # trained
    run("b", "sft.steps=2", "trainer.save_every=2")
    cfg = load_config(None, tiny_overrides(f"trainer.output_dir={tmp_path / 'b'}", f"model.path={base_dir}",
                                           "model.lora.rank=4", "model.lora.alpha=8", "sft.lr=1e-2", "sft.steps=4",
                                           "trainer.resume=auto"))
    resumed = SFTTrainer.from_config(cfg)
    assert resumed.step == 2
    resumed.fit()
    for (name, a), (_, b) in zip(straight.policy.model.state_dict().items(), resumed.policy.model.state_dict().items()):
        assert torch.equal(a, b), name
    for a, b in zip(straight.optimizer.state.values(), resumed.optimizer.state.values()):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])

    merged_dir = export_checkpoint(tmp_path / "a" / "sft", tmp_path / "merged", merge=True)
    adapter_dir = tmp_path / "a" / "sft" / "model"  # the run's own export: the adapters
    x = ids(vocab=100)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    expected = peft.PeftModel.from_pretrained(hf, str(adapter_dir)).merge_and_unload()
    ours_merged = transformers.AutoModelForCausalLM.from_pretrained(str(merged_dir), dtype=torch.float32)
    with torch.no_grad():
        assert (ours_merged(input_ids=x).logits - expected(input_ids=x).logits).abs().max() <= 1e-5
        assert (straight.policy.model(x) - expected(input_ids=x).logits).abs().max() <= 1e-5


ARCHITECTURE_FIELDS = {
    "qwen3": {"attention_bias": False},
    "gemma2": {"attention_bias": False, "hidden_act": "gelu_pytorch_tanh", "sliding_window": 8,
               "layer_types": ["sliding_attention", "full_attention"], "query_pre_attn_scalar": 16,
               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    "llama": {"attention_bias": False},
    "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                  "shared_expert_intermediate_size": 16},
}


@pytest.mark.parametrize("model_type", list(ARCHITECTURE_FIELDS))
def test_every_architecture_takes_adapters_and_merges_to_the_same_logits(model_type):
    from scalerl.models.config import ModelConfig
    from scalerl.models.decoder import build_model

    cfg = ModelConfig(model_type=model_type, vocab_size=64, hidden_size=32, intermediate_size=64,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, **ARCHITECTURE_FIELDS[model_type])
    model = build_model(cfg, seed=0)
    x = ids()
    with torch.no_grad():
        base = model(x)
    names = apply_lora(model, 2, 4.0, 0.0, ["all-linear"])
    experts = 4 * 3 + 3 if model_type == "qwen2_moe" else 3  # each expert's and the shared expert's MLP
    assert len(names) == cfg.num_hidden_layers * (4 + experts)
    assert not any(n.endswith(("mlp.gate", "shared_expert_gate")) for n in names)  # routers stay out
    randomize_adapters(model, 1)
    with torch.no_grad():
        adapted = model(x)
        merged = merge_lora(copy.deepcopy(model))(x)
    assert (adapted - base).abs().max() > 1e-3  # the adapters take part in the forward
    assert (merged - adapted).abs().max() <= 1e-5


def test_the_transformers_fallback_is_refused_by_name(tmp_path):
    from scalerl.models.transformers_model import load_transformers_model

    base_dir = tmp_path / "base"
    save_pretrained(tiny_model(), base_dir)
    fallback = load_transformers_model(str(base_dir), dtype=torch.float32, device=torch.device("cpu"))
    with pytest.raises(ConfigError, match="model.implementation=transformers"):
        apply_lora(fallback, 4, 8.0, 0.0, ["all-linear"])
