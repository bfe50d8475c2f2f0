"""trainer.fsdp_param_dtype=bfloat16 as large runs train: FSDP2 computes in bf16 over float32 master weights,
reduces gradients in float32 and hands the losses float32 logits; a few SFT steps at world 2 stay within
bf16 tolerance of the float32 run's losses. A layout FSDP2 does not shard refuses the option by name."""

from __future__ import annotations

import pytest
import torch

from scalerl.core.config import ConfigError, load_config
from scalerl.parallel.data_parallel import mixed_precision_policies
from scalerl.trainer.sft_trainer import SFTTrainer
from tests.spawned_group import run_in_group
from tests.tiny import tiny_overrides

STEPS = 4


def _sft_losses(rank: int, root: str) -> dict[str, object]:
    from torch.distributed.tensor import DTensor

    out: dict[str, object] = {}
    for dtype in ("float32", "bfloat16"):
        cfg = load_config(None, tiny_overrides(
            "parallel.dp_replicate=1", "parallel.dp_shard=2", f"trainer.fsdp_param_dtype={dtype}",
            f"sft.steps={STEPS}", f"trainer.output_dir={root}/{dtype}", "sft.lr=1e-3", "model.hidden_size=64",
            "model.intermediate_size=128"))
        trainer = SFTTrainer.from_config(cfg)
        model = trainer.policy.model
        seen: dict[str, torch.dtype] = {}
        q_proj = model.layers[0].self_attn.q_proj

        def record(key: str, dtype: torch.dtype) -> None:  # returns None: the hook changes nothing
            seen.setdefault(key, dtype)

        q_proj.register_forward_pre_hook(lambda m, args: record("compute", m.weight.dtype))
        model.register_forward_hook(lambda m, args, output: record("logits", output.dtype))
        losses = [trainer.train_step()["sft/loss"] for _ in range(STEPS)]
        master = {p.to_local().dtype if isinstance(p, DTensor) else p.dtype for p in model.parameters()}
        out[dtype] = {"losses": losses, "compute": str(seen["compute"]), "logits": str(seen["logits"]),
                      "master": sorted(str(d) for d in master)}
        trainer.close()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_in_group(_sft_losses, 2, str(tmp_path_factory.mktemp("mp")), timeout_s=600)


def test_bf16_compute_over_fp32_master_weights(runs):
    for r in runs:
        assert r["bfloat16"]["compute"] == "torch.bfloat16" and r["float32"]["compute"] == "torch.float32"
        assert r["bfloat16"]["master"] == ["torch.float32"]  # the optimizer steps float32 shards
        assert r["bfloat16"]["logits"] == "torch.float32"


def test_bf16_losses_follow_the_fp32_run(runs):
    fp32, bf16 = runs[0]["float32"]["losses"], runs[0]["bfloat16"]["losses"]
    assert fp32[-1] < fp32[0]  # the runs learn, so the comparison is over moving losses
    for a, b in zip(fp32, bf16):
        assert abs(a - b) <= 0.005 * abs(a), (fp32, bf16)
    assert fp32 != bf16  # bf16 compute did run: the losses are close, not identical


def test_gradient_reduction_stays_float32():
    layers, root = mixed_precision_policies(torch.bfloat16, None)
    assert layers["mp_policy"].param_dtype == torch.bfloat16 and layers["mp_policy"].reduce_dtype == torch.float32
    assert root["mp_policy"].output_dtype == torch.float32
    assert mixed_precision_policies(torch.bfloat16, torch.bfloat16)[0]["mp_policy"].reduce_dtype == torch.bfloat16
    assert mixed_precision_policies(None, None) == ({}, {})


def test_unsharded_layout_refuses_the_option(tmp_path):
    cfg = load_config(None, tiny_overrides("trainer.fsdp_param_dtype=bfloat16", f"trainer.output_dir={tmp_path}"))
    with pytest.raises(ConfigError, match="trainer.fsdp_param_dtype=bfloat16 needs a layout FSDP2 shards"):
        SFTTrainer.from_config(cfg)
