"""Rollout routing replay (R3): the train/inference log-prob gap with and without replaying the engine's routes.

    python benchmarks/routing_replay.py [--seeds 3] [--rows 32] [--new-tokens 48]

A tiny random Qwen3-MoE (hidden 64, 4 layers all sparse, 8 experts, top-2, normalised) generates with the
built-in engine; the trainer's forward (`response_logprobs`, fp32) recomputes the log-probs of the sampled
tokens once routing by its own router and once replaying the routes the engine recorded
(``actor.router_replay``). The gap is mean |trainer - engine| log-prob over the sampled tokens; "routes
differing" is the share of (token, sparse layer) pairs whose expert set differs between the engine's
routing and the trainer's own. Two sources of drift, each measured in the same run:

- ``bf16 engine``: the engine decodes a bf16 copy of the weights (its own forward in bf16: the built-in
  engine's MoE path is the model's forward, so bf16 decode means bf16 parameters) while the trainer
  computes in fp32; the gap then also holds the bf16 error of attention and the experts, which replay
  does not remove.
- ``drifted router``: the engine's model is the trainer's with each router's weights perturbed by Gaussian
  noise (std 0.02 x the weights' std), in fp32, emulating router drift alone (e.g. one optimizer step or a
  different kernel): replay removes that part.

Random weights route near-uniformly, so ties within bf16 rounding are frequent: these are small-model numbers
that show the mechanism, not a prediction for a trained model.
"""

from __future__ import annotations

import argparse
import copy

import torch

from scalerl.models.config import ModelConfig
from scalerl.models.decoder import build_model
from scalerl.models.moe import moe_blocks
from scalerl.models.routing_replay import enable_router_replay, forward_routes
from scalerl.rollout.batch import RolloutBatch
from scalerl.rollout.engines.builtin import BuiltinEngine
from scalerl.rollout.engines.engine import SamplingParams
from scalerl.trainer.forward_passes import response_logprobs

CFG = dict(model_type="qwen3_moe", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
           num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
           moe_intermediate_size=32, norm_topk_prob=True, attention_bias=False, max_position_embeddings=256)


def engine_model(trained, kind: str, seed: int):
    model = copy.deepcopy(trained)
    if kind == "bf16 engine":
        return model.to(torch.bfloat16)
    gen = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        for block in moe_blocks(model):
            w = block.gate.weight
            w.add_(torch.randn(w.shape, generator=gen) * 0.02 * float(w.std()))
    return model


def measure(kind: str, seed: int, rows: int, new_tokens: int) -> dict[str, float]:
    trained = build_model(ModelConfig(**CFG), seed=seed)
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, CFG["vocab_size"], (int(n),), generator=gen).tolist()
               for n in torch.randint(4, 17, (rows,), generator=gen)]
    engine = BuiltinEngine(engine_model(trained, kind, seed), pad_token_id=0, record_routes=True)
    out = engine.generate(prompts, SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=seed))
    batch = RolloutBatch.from_generation(out, torch.arange(rows), torch.zeros(rows))
    mask = batch.response_mask.bool()
    plain = response_logprobs(trained, batch, 1.0, micro_batch_size=rows)
    enable_router_replay(trained)
    replayed = response_logprobs(trained, batch, 1.0, micro_batch_size=rows)
    engine_lp = batch.rollout_logprobs.float()
    own = forward_routes(trained, batch.input_ids, batch.attention_mask).sort(-1).values
    rec = batch.routed_experts.long().sort(-1).values
    recorded = rec[..., 0] >= 0
    differ = (own != rec).any(-1)[recorded].float().mean()
    return {"gap_off": float((plain - engine_lp).abs()[mask].mean()),
            "gap_on": float((replayed - engine_lp).abs()[mask].mean()),
            "max_off": float((plain - engine_lp).abs()[mask].max()),
            "max_on": float((replayed - engine_lp).abs()[mask].max()),
            "differ": float(differ), "tokens": int(mask.sum())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=48)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| drift | routes differing (engine vs trainer's own) | mean abs gap, no replay | mean abs gap, replay "
          "| max abs gap, no replay | max abs gap, replay | sampled tokens |")
    print("|---|---|---|---|---|---|---|")
    for kind in ("bf16 engine", "drifted router"):
        runs = [measure(kind, seed, args.rows, args.new_tokens) for seed in range(args.seeds)]
        mean = {k: sum(r[k] for r in runs) / len(runs) for k in runs[0]}
        print(f"| {kind} | {100 * mean['differ']:.2f}% | {mean['gap_off']:.2e} | {mean['gap_on']:.2e} | "
              f"{mean['max_off']:.2e} | {mean['max_on']:.2e} | {sum(r['tokens'] for r in runs)} |", flush=True)


if __name__ == "__main__":
    main()
