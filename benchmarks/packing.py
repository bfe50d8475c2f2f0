"""Sequence packing vs padding on RL-like length mixes: processed tokens, update time, log-prob pass time.

    python benchmarks/packing.py [--models builtin,0.5b] [--layers-0.5b 4] [--batch 32] [--repeats 3]

Response lengths come from the sequence-balance benchmark's "mix" (80% 20-100 tokens, 20% 500-2000) and
"lognormal" (median 150, sigma 1, clipped to 8-4096) samplers, times ``--length-scale`` (per model: a
0.5B-shaped forward over 2000-token rows is minutes on two CPU cores), after prompts of 16-64 tokens
(left-padded). Both paths run in the same process on the same batch:

* padded: micro-batches cut by `token_budget_micro_batches` to ``--budget`` padded tokens (columns that
  are padding in every row trimmed);
* packed (``actor.use_remove_padding``): the same budget counting real tokens, each micro-batch one row;
  the head, log-softmax and entropy run only on the real response tokens (`scalerl.models.packing`).

The log-prob pass runs fixed micro-batches of ``--logprob-micro`` rows in arrival order, padded or packed.
Update = one optimizer step over the whole batch (PPO loss, SGD). Timing, for a shared machine: the paths
are interleaved within each repeat (padded first on even repeats, packed first on odd ones, so neither
always runs on a warmer or a quieter machine), each timed by wall clock and by the process's CPU time
(``time.process_time``: every thread's, so it leaves out time the process spent waiting for a core), with
torch's intra-op threads fixed to ``--threads`` and inter-op threads to one; the table gives medians over
``--repeats`` (>= 3), after an untimed warm-up of every path on four rows. "loss rows" counts the rows
that reach the log-softmax over the vocabulary (padded: rows x response width of each micro-batch;
packed: the masked response tokens). With ``--compare-mask``, "packed (mask)" is the update with the
block-mask kernel instead of per-sequence SDPA (the CPU choice). The packed attention kernel this device
would choose (`choose_packed_kernel`: flash-attention's varlen kernel on a GPU with ``flash_attn``) is
printed first; the rows always time the CPU kernels.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python benchmarks/packing.py` from a checkout

from benchmarks.sequence_balance import DISTRIBUTIONS  # noqa: E402
from scalerl.models.config import ModelConfig
from scalerl.models.decoder import build_model
from scalerl.models.packing import choose_packed_kernel, flash_attn_available
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


def timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the whole process) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def interleaved(paths: dict, repeats: int) -> dict[str, tuple[float, float]]:
    """Median (wall, CPU) seconds of each path, the paths run in turn within every repeat (the order
    reversed on odd repeats)."""
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in paths}
    names = list(paths)
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            samples[name].append(timed(paths[name]))
            print(f"    repeat {r}: {name} {samples[name][-1][0]:.3f} s wall, {samples[name][-1][1]:.3f} s CPU",
                  file=sys.stderr, flush=True)  # progress, and the samples behind the medians
    return {name: (statistics.median(w for w, _ in got), statistics.median(c for _, c in got))
            for name, got in samples.items()}


def loss_rows(micros, packed: bool) -> int:
    """Rows the loss's log-softmax runs on: every [rows, response] slot padded, the masked tokens packed."""
    return sum(int((m.target[..., 1] > 0).sum()) if packed else m.target.shape[0] * m.target.shape[1]
               for m in micros)


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
        row[f"loss rows {name}"] = loss_rows(micros, plan.packed_kernel is not None)
        row[f"micro-batches {name}"] = len(micros)
    if row["tokens packed"] != row["real"]:
        raise AssertionError(f"packed rows processed {row['tokens packed']} tokens, not the {row['real']} real ones")
    updates = interleaved({name: (lambda plan=plan: run_update(parts, step, batch, objective, plan, None, ctx))
                           for name, plan in plans.items()}, args.repeats)
    micro = args.logprob_micro
    logprobs = interleaved({name: (lambda kernel=kernel: response_logprobs(model, batch, 1.0, micro,
                                                                           packed_kernel=kernel))
                            for name, kernel in (("padded", None), ("packed", "sdpa_per_sequence"))}, args.repeats)
    for name, (wall, cpu) in updates.items():
        row[f"update {name}"], row[f"update cpu {name}"] = wall, cpu
    for name, (wall, cpu) in logprobs.items():
        row[f"logprob {name}"], row[f"logprob cpu {name}"] = wall, cpu
    print(f"  {model_name} ({row['layers']}) {dist_name}: done, load average {os.getloadavg()[0]:.1f}",
          file=sys.stderr, flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="builtin,0.5b")
    parser.add_argument("--dists", default="mix,lognormal")
    parser.add_argument("--layers-0.5b", dest="layers_05b", type=int, default=4,
                        help="decoder layers of the 0.5B-shaped model (24 in the real one)")
    parser.add_argument("--length-scale", type=float, default=0.0, help="response lengths times this (0 = per model)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--budget", type=int, default=0, help="micro-batch token budget (0 = 2 x longest row)")
    parser.add_argument("--logprob-micro", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per path (medians; at least 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compare-mask", action="store_true", help="also time the block-mask kernel's update")
    parser.add_argument("--threads", type=int, default=2,
                        help="torch intra-op threads (inter-op: 1); 1 on an oversubscribed machine, where a thread "
                        "that waits for a descheduled peer spins and the spin counts as CPU time")
    args = parser.parse_args()
    if args.repeats < 3:
        parser.error("--repeats must be at least 3 (the table gives medians)")
    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    torch.manual_seed(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"packed attention kernel on {device}: {choose_packed_kernel(device)} (flash_attn installed: "
          f"{flash_attn_available()}); the rows below time sdpa_per_sequence on the CPU; "
          f"threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}", flush=True)
    print("| model (layers) | lengths (scale) | real tokens | processed padded / packed | loss rows padded / packed "
          "| update padded s (CPU s) | update packed s (CPU s) | update speed-up wall (CPU) "
          "| log-prob padded s (CPU s) | log-prob packed s (CPU s) | log-prob speed-up wall (CPU) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    rows = []
    for model_name in args.models.split(","):
        for dist in args.dists.split(","):  # each row printed when measured: a timeout keeps the finished ones
            r = measure(model_name, dist, args)
            rows.append(r)
            print(f"| {r['model']} ({r['layers']}) | {r['dist']} (x{r['scale']:g}) | {r['real']} "
                  f"| {r['tokens padded']} / {r['tokens packed']} | {r['loss rows padded']} / {r['loss rows packed']} "
                  f"| {r['update padded']:.3f} ({r['update cpu padded']:.3f}) "
                  f"| {r['update packed']:.3f} ({r['update cpu packed']:.3f}) "
                  f"| {r['update padded'] / r['update packed']:.2f}x "
                  f"({r['update cpu padded'] / r['update cpu packed']:.2f}x) "
                  f"| {r['logprob padded']:.3f} ({r['logprob cpu padded']:.3f}) "
                  f"| {r['logprob packed']:.3f} ({r['logprob cpu packed']:.3f}) "
                  f"| {r['logprob padded'] / r['logprob packed']:.2f}x "
                  f"({r['logprob cpu padded'] / r['logprob cpu packed']:.2f}x) |", flush=True)
    if args.compare_mask:
        for r in rows:
            print(f"  {r['model']} {r['dist']}: update packed with the block mask {r['update packed (mask)']:.3f} s "
                  f"(CPU {r['update cpu packed (mask)']:.3f} s)")
    print(f"(batch {args.batch}, budget {rows[0]['budget']} tokens for the first row: padded tokens for padded, "
          f"real tokens for packed; log-prob micro-batches of {args.logprob_micro} rows; medians of "
          f"{args.repeats} interleaved repeats; micro-batches padded / packed: "
          + ", ".join(f"{r['micro-batches padded']} / {r['micro-batches packed']}" for r in rows)
          + f"; load average at the end {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
