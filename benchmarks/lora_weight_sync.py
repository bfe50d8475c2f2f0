"""LoRA: bytes per weight sync of the adapters against a full bf16 push of the model, on a Qwen2.5-0.5B-shaped
decoder (the published sizes, hard-coded; nothing downloaded).

    OMP_NUM_THREADS=1 python benchmarks/lora_weight_sync.py [--rank 16] [--targets all-linear] [--syncs 3]
        [--model 0.5b] [--json FILE]

The model is built on the meta device (no base weights are held); `apply_lora` adapts it, and only the
adapters are materialised (PEFT's init, then random B as training would leave it). The adapters go through
the real `WeightSender` (rollout dtype bf16, 64 MiB buckets, mode delta) to a receiver in the same process
(`InProcessChannel`): the first sync is a full push of the adapters (plan included), later ones verified
deltas after the adapters moved, as a standalone worker receives them (`synced_tensors`). The full push is
the same sender's dense payload over every base parameter: the `WeightPlan` of the whole model's shapes in
bf16 (``full_bytes``, what a non-LoRA run's first push and every dense push carries).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scalerl.bench.cost_model.model_shapes import QWEN25_SHAPES
from scalerl.comm.weights.channel import InProcessChannel
from scalerl.comm.weights.plan import WeightPlan
from scalerl.comm.weights.receiver import TensorDictStore, WeightReceiver
from scalerl.comm.weights.sender import WeightSender
from scalerl.models.config import ModelConfig
from scalerl.models.decoder import CausalLM
from scalerl.models.lora import adapter_parameters, apply_lora, lora_modules
from scalerl.rollout.weight_sync import synced_tensors

MiB = 1 << 20


def shaped_model(name: str) -> CausalLM:
    hidden, intermediate, layers, heads, kv_heads, vocab, tied = QWEN25_SHAPES[name]
    cfg = ModelConfig(model_type="qwen2", vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      tie_word_embeddings=tied, torch_dtype="bfloat16")
    with torch.device("meta"):
        model = CausalLM(cfg)
    if tied:
        model.lm_head.weight = model.embed_tokens.weight
    return model


def materialise_adapters(model: CausalLM, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _, module in lora_modules(model):
        module.lora_A.to_empty(device="cpu")
        module.lora_B.to_empty(device="cpu")
        torch.nn.init.kaiming_uniform_(module.lora_A.weight, a=math.sqrt(5), generator=g)
        torch.nn.init.zeros_(module.lora_B.weight)


def move_adapters(model: CausalLM, seed: int, scale: float = 1e-3) -> None:
    """An optimizer step's worth of change on every adapter element."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in adapter_parameters(model):
            p.add_(torch.randn(p.shape, generator=g) * scale)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="0.5b", choices=[k.removeprefix("qwen2.5-") for k in QWEN25_SHAPES])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", default="all-linear", help="comma-separated module names or all-linear")
    parser.add_argument("--syncs", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    model = shaped_model(f"qwen2.5-{args.model}")
    base_shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters()]  # tied head counted once
    full_plan = WeightPlan.for_bucket_bytes(base_shapes, torch.bfloat16, 64 * MiB)
    adapted = apply_lora(model, args.rank, 2.0 * args.rank, 0.0, args.targets.split(","))
    materialise_adapters(model, seed=0)
    tensors = synced_tensors(model)
    store = TensorDictStore({n: torch.zeros(t.shape, dtype=torch.bfloat16) for n, t in tensors})
    sender = WeightSender(torch.bfloat16, 64 * MiB, InProcessChannel([WeightReceiver(store)]), mode="delta")
    rows = []
    for i in range(args.syncs):
        move_adapters(model, seed=i + 1)
        report = sender.sync(synced_tensors(model))
        rows.append({"sync": i + 1, "full_push": report.full_push, "bytes": report.bytes,
                     "seconds": round(report.seconds, 3)})
    for name, t in synced_tensors(model):  # the receiver holds exactly what was sent
        assert torch.equal(store.tensor(name), t.detach().to(torch.bfloat16)), name
    full_bytes = full_plan.full_bytes
    adapter_elems = sum(t.numel() for _, t in tensors)
    result = {
        "model": f"qwen2.5-{args.model}", "rank": args.rank, "targets": args.targets, "adapted_modules": len(adapted),
        "base_parameters": full_plan.total_elems, "adapter_parameters": adapter_elems,
        "full_bf16_push_bytes": full_bytes, "syncs": rows,
        "reduction_vs_full": [round(1 - r["bytes"] / full_bytes, 5) for r in rows],
    }
    print(f"{result['model']}: {full_plan.total_elems / 1e6:.1f}M base parameters, full bf16 push "
          f"{full_bytes / MiB:.1f} MiB; rank {args.rank} on {args.targets}: {len(adapted)} modules, "
          f"{adapter_elems / 1e6:.2f}M adapter parameters")
    for r, cut in zip(rows, result["reduction_vs_full"]):
        kind = "full push of the adapters" if r["full_push"] else "delta of the adapters"
        print(f"  sync {r['sync']} ({kind}): {r['bytes'] / MiB:.2f} MiB = {100 * cut:.2f}% fewer bytes than the "
              f"full push ({r['seconds']} s)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
