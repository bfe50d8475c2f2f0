"""Sequence packing vs padding on RL-like length mixes: processed tokens, update time, log-prob pass time.

    python benchmarks/packing.py [--models builtin,0.5b] [--layers-0.5b 2] [--batch 32] [--repeats 2]

Response lengths come from the sequence-balance benchmark's "mix" (80% 20-100 tokens, 20% 500-2000) and
"lognormal" (median 150, sigma 1, clipped to 8-4096) samplers, times ``--length-scale`` (per model: a
0.5B-shaped forward over 2000-token rows is minutes on two CPU cores), after prompts of 16-64 tokens
(left-padded). Both paths run in the same process on the same batch:

* padded: today's path, micro-batches cut by `token_budget_micro_batches` to ``--budget`` padded tokens
  (columns that are padding in every row trimmed);
* packed (``actor.use_remove_padding``): the same budget counting real tokens, each micro-batch one row.

The log-prob pass runs fixed micro-batches of ``--logprob-micro`` rows in arrival order, padded or packed.
Update = one optimizer step over the whole batch (PPO loss, SGD); times are the best of ``--repeats``,
after an untimed warm-up of every path on four rows.
With ``--compare-mask``, "packed (mask)" is the update with the block-mask kernel instead of per-sequence
SDPA (the CPU choice).
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from benchmarks.sequence_balance import DISTRIBUTIONS
from scalerl.models.config import ModelConfig
from scalerl.models.decoder import build_model
from scalerl.parallel.distributed import single_process_context
from scalerl.parallel.parallelize import parallelize
from scalerl.rollout.batch import RolloutBatch
from scalerl.trainer.forward_passes import response_logprobs
from scalerl.trainer.objectives import PolicyObjective
from scalerl.trainer.update import (
    OptimizerStep,
    UpdatePlan,
    _forward_inputs,
    run_update,
)

ACTOR = dict(clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0, loss_agg_mode="token-mean",
             entropy_coeff=0.0, use_kl_loss=False)
MODELS = {  # name -> (config fields, default length scale)
    "builtin": (dict(vocab_size=96, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192), 1.0),
    "0.5b": (dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=8192), 0.25),
}


def rl_batch(lengths: list[int], vocab: int, rng: random.Random) -> RolloutBatch:
    """Left-padded prompts of 16-64 tokens, right-padded responses of ``lengths``, advantages of +-1."""
    prompts = [rng.randint(16, 64) for _ in lengths]
    P, R, B = max(prompts), max(lengths), len(lengths)
    gen = torch.Generator().manual_seed(rng.randint(0, 2**31))
    input_ids = torch.randint(3, vocab, (B, P + R), generator=gen)
    attention_mask = torch.zeros(B, P + R, dtype=torch.long)
    response_mask = torch.zeros(B, R)
    for b, (p, r) in enumerate(zip(prompts, lengths)):
        attention_mask[b, P - p : P + r] = 1
        response_mask[b, :r] = 1
    input_ids = input_ids * attention_mask
    logprobs = -torch.rand(B, R, generator=gen) * response_mask
    advantages = (torch.randint(0, 2, (B, 1), generator=gen).float() * 2 - 1) * response_mask
    return RolloutBatch(input_ids, attention_mask, input_ids[:, P:], response_mask, logprobs,
                        torch.arange(B), torch.zeros(B), old_logprobs=logprobs, advantages=advantages)


def best_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def measure(model_name: str, dist_name: str, args) -> dict:
    fields, default_scale = MODELS[model_name]
    fields = dict(fields)
    if model_name == "0.5b":
        fields["num_hidden_layers"] = args.layers_05b
    scale = args.length_scale if args.length_scale else default_scale
    sampler, max_len = DISTRIBUTIONS[dist_name]
    rng = random.Random(args.seed)
    lengths = [max(1, round(n * scale)) for n in sampler(rng, args.batch)]
    batch = rl_batch(lengths, fields["vocab_size"], rng)
    budget = args.budget or int(2 * (max_len * scale + 64))
    model = build_model(ModelConfig(model_type="qwen2", **fields), seed=0)
    ctx = single_process_context()
    parts = parallelize(model, ctx)
    step = OptimizerStep(torch.optim.SGD(model.parameters(), lr=0.0), None, 0.0)
    objective = PolicyObjective(argparse.Namespace(**ACTOR), 1.0)
    common = dict(epochs=1, mini_batch_size=len(batch), micro_batch_size=len(batch), micro_batch_max_tokens=budget,
                  horizon=batch.response_ids.shape[1], shuffle=False)
    plans = {"padded": UpdatePlan(**common), "packed": UpdatePlan(**common, packed_kernel="sdpa_per_sequence")}
    if args.compare_mask:
        plans["packed (mask)"] = UpdatePlan(**common, packed_kernel="sdpa_block_mask")
    row = {"model": model_name, "dist": dist_name, "real": int(batch.attention_mask.sum()), "budget": budget,
           "scale": scale, "layers": fields["num_hidden_layers"]}
    # Untimed warm-up on a slice (first-call allocations and kernel set-up would land on the first path timed).
    head = batch.select(torch.arange(min(4, len(batch))))
    for plan in plans.values():
        run_update(parts, step, head, objective, plan, None, ctx)
        response_logprobs(model, head, 1.0, len(head), packed_kernel=plan.packed_kernel)
    for name, plan in plans.items():
        micros = _forward_inputs(parts, batch, plan, objective, ctx)
        row[f"tokens {name}"] = sum(m.input_ids.numel() for m in micros)
        row[f"update {name}"] = best_time(lambda plan=plan: run_update(parts, step, batch, objective, plan, None, ctx),
                                          args.repeats)
    micro = args.logprob_micro
    for name, kernel in (("padded", None), ("packed", "sdpa_per_sequence")):
        row[f"logprob {name}"] = best_time(
            lambda kernel=kernel: response_logprobs(model, batch, 1.0, micro, packed_kernel=kernel), args.repeats)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="builtin,0.5b")
    parser.add_argument("--dists", default="mix,lognormal")
    parser.add_argument("--layers-0.5b", dest="layers_05b", type=int, default=2,
                        help="decoder layers of the 0.5B-shaped model (24 in the real one)")
    parser.add_argument("--length-scale", type=float, default=0.0, help="response lengths times this (0 = per model)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--budget", type=int, default=0, help="micro-batch token budget (0 = 2 x longest row)")
    parser.add_argument("--logprob-micro", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compare-mask", action="store_true", help="also time the block-mask kernel's update")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rows = [measure(m, d, args) for m in args.models.split(",") for d in args.dists.split(",")]
    print("| model (layers) | lengths (scale) | real tokens | processed padded | processed packed | update padded s "
          "| update packed s | speed-up | update packed (mask) s | log-prob padded s | log-prob packed s | speed-up |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} ({r['layers']}) | {r['dist']} (x{r['scale']:g}) | {r['real']} | {r['tokens padded']} "
              f"| {r['tokens packed']} | {r['update padded']:.3f} | {r['update packed']:.3f} "
              f"| {r['update padded'] / r['update packed']:.2f}x | {r.get('update packed (mask)', float('nan')):.3f} "
              f"| {r['logprob padded']:.3f} | {r['logprob packed']:.3f} "
              f"| {r['logprob padded'] / r['logprob packed']:.2f}x |")
    print(f"(batch {args.batch}, budget {rows[0]['budget']} tokens for the first row: padded tokens for padded, "
          f"real tokens for packed; log-prob micro-batches of {args.logprob_micro} rows)")


if __name__ == "__main__":
    main()
