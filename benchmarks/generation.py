"""Built-in engine vs Hugging Face `generate` on the same weights, measured side by side in one run.

    python benchmarks/generation.py [--lengths fixed|rl|all] [--repeats 5] [--threads 1] [--json out.json]
                                    [--engines builtin,vllm,hf]  (vllm: the rows of benchmarks/generation_vllm.py)

Both sample (temperature 1, top-p 1) in fp32 with a KV cache from 16-token prompts, on one intra-op thread.
Runs are interleaved (HF, scalerl, HF, ...) after a warm-up and each side's median is reported, so machine
load hits both alike. Tokens/s are wall-clock; each ratio is also given in the process's CPU time, which
leaves out the time other tenants of a shared machine hold the cores and is the steadier of the two.

``--lengths fixed``: 64 new tokens and no stop token, so both emit exactly batch x 64 tokens. Besides the
ratio, the table puts scalerl's decode step CPU time (a 64-token run minus a 1-token run, over 63 steps)
next to the CPU time of the same step's matmuls (q/k/v/o, gate/up/down, lm_head) and attention (SDPA over the mean
cache length) run back to back in isolation on the same weights: a roofline on this CPU. The gap is the
loop's own overhead (norms, RoPE, sampling, cache writes, the dispatcher).

``--lengths rl``: RL-like response lengths. Each row's length is drawn log-normally (median a quarter of
the 128 new tokens, sigma 1, clipped to [2, 128]) and both engines are made to stop there by the same
logits processor: it bans the stop token at every other step and forces it at the row's drawn step
(HF: a ``LogitsProcessor`` with ``eos_token_id`` = the stop token; scalerl: the engine's
``logits_processor``). Both therefore produce exactly the same lengths (asserted), while the processor's
cost (a few batched tensor ops per step) is the same for both and the model does the same work as with
naturally sampled stops. HF keeps stepping finished rows until the longest is done; scalerl compacts them
away. Tokens/s counts real response tokens (stop token included, padding not). The table also shows
scalerl with compaction off (``compact_at=None``), measured in the same interleaved run.

``--sweep-compact-at`` adds the compaction-threshold trade-off on the RL lengths (scalerl only).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from scalerl.models.config import ModelConfig
from scalerl.models.decoder import build_model
from scalerl.models.hf_checkpoint import save_pretrained
from scalerl.rollout.builtin_engine import BuiltinEngine
from scalerl.rollout.engine import SamplingParams

SIZES = {
    "tiny (2L, h64, V256)": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    "small (4L, h256, V256)": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4),
}
BATCHES = (16, 64)
PROMPT_LEN, FIXED_NEW_TOKENS, RL_NEW_TOKENS = 16, 64, 128
STOP_ID, PAD_ID, VOCAB = 1, 0, 256


def interleaved_medians(fns: dict[str, Callable[[], object]], repeats: int) -> tuple[dict[str, float], dict[str, float]]:
    """Median wall-clock and CPU seconds of each function over ``repeats`` rounds, the functions alternating
    within a round. CPU time (this process's, one intra-op thread) leaves out the time other tenants of a
    shared machine hold the cores, so its ratios are the steadier ones."""
    for fn in fns.values():
        fn()  # warm-up
    wall: dict[str, list[float]] = {name: [] for name in fns}
    cpu: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start_wall, start_cpu = time.perf_counter(), time.process_time()
            fn()
            wall[name].append(time.perf_counter() - start_wall)
            cpu[name].append(time.process_time() - start_cpu)
    median = lambda times: {name: statistics.median(ts) for name, ts in times.items()}
    return median(wall), median(cpu)


# ------------------------------------------------------------------------------------- RL-like lengths
def rl_lengths(batch: int, max_new: int, seed: int = 0) -> torch.Tensor:
    """Response lengths drawn log-normally: median ``max_new / 4``, sigma 1, clipped to ``[2, max_new]``."""
    g = torch.Generator().manual_seed(seed)
    median = max_new / 4
    drawn = torch.exp(torch.randn(batch, generator=g) + torch.log(torch.tensor(median)))
    return drawn.round().clamp(2, max_new).long()


class ForcedStop:
    """Logits adjustment that makes row ``i`` emit ``STOP_ID`` exactly at step ``lengths[i] - 1``."""

    def __init__(self, lengths: torch.Tensor):
        self.last_step = lengths - 1
        self.stop_index = torch.tensor([STOP_ID])
        self.stop_only = torch.full((VOCAB,), float("-inf"))
        self.stop_only[STOP_ID] = 0.0

    def __call__(self, logits: torch.Tensor, rows: torch.Tensor, step: int) -> torch.Tensor:
        at_stop = (self.last_step[rows] == step).unsqueeze(1)
        banned = logits.index_fill(-1, self.stop_index, float("-inf"))
        return torch.where(at_stop, self.stop_only, banned)


class HFForcedStop:
    """The same adjustment as a transformers ``LogitsProcessor`` (HF keeps all rows, in order)."""

    def __init__(self, lengths: torch.Tensor):
        self.forced, self.rows = ForcedStop(lengths), torch.arange(lengths.numel())

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return self.forced(scores, self.rows, input_ids.shape[1] - PROMPT_LEN)


def hf_response_lengths(generated: torch.Tensor) -> torch.Tensor:
    """Tokens up to and including each row's first stop token (the rest is HF's padding)."""
    is_stop = generated == STOP_ID
    return torch.where(is_stop.any(-1), is_stop.int().argmax(-1) + 1, generated.shape[1])


def run_rl(name: str, ours, hf, batch: int, repeats: int) -> dict:
    from transformers import LogitsProcessorList

    prompts = torch.randint(3, VOCAB, (batch, PROMPT_LEN), generator=torch.Generator().manual_seed(0))
    lengths = rl_lengths(batch, RL_NEW_TOKENS)
    sampling = SamplingParams(max_new_tokens=RL_NEW_TOKENS, temperature=1.0, seed=0, stop_token_ids=[STOP_ID])
    compacting = BuiltinEngine(ours, PAD_ID, logits_processor=ForcedStop(lengths))
    stepping = BuiltinEngine(ours, PAD_ID, logits_processor=ForcedStop(lengths), compact_at=None)

    def scalerl_fn(engine):
        out = engine.generate(prompts.tolist(), sampling)
        assert torch.equal(out.response_lengths, lengths)

    def hf_fn():
        with torch.inference_mode():
            out = hf.generate(
                prompts, attention_mask=torch.ones_like(prompts), do_sample=True, temperature=1.0, top_p=1.0,
                top_k=0, max_new_tokens=RL_NEW_TOKENS, pad_token_id=PAD_ID, eos_token_id=STOP_ID,
                logits_processor=LogitsProcessorList([HFForcedStop(lengths)]),
            )
        assert torch.equal(hf_response_lengths(out[:, PROMPT_LEN:]), lengths)

    t, cpu = interleaved_medians(
        {"hf": hf_fn, "scalerl": lambda: scalerl_fn(compacting), "no_compaction": lambda: scalerl_fn(stepping)},
        repeats,
    )
    tokens = int(lengths.sum())
    row = {
        "model": name, "batch": batch, "lengths": "rl", "hf_tokens_per_s": tokens / t["hf"],
        "scalerl_tokens_per_s": tokens / t["scalerl"], "ratio": t["hf"] / t["scalerl"],
        "ratio_cpu_time": cpu["hf"] / cpu["scalerl"],
        "scalerl_no_compaction_tokens_per_s": tokens / t["no_compaction"],
        "mean_length": float(lengths.float().mean()), "longest": int(lengths.max()),
    }
    print(
        f"{name:24s} batch {batch:3d} rl (mean {row['mean_length']:5.1f}, longest {row['longest']:3d}): "
        f"HF {row['hf_tokens_per_s']:7.0f} tok/s | scalerl {row['scalerl_tokens_per_s']:7.0f} tok/s "
        f"(no compaction {row['scalerl_no_compaction_tokens_per_s']:7.0f}) | ratio {row['ratio']:.2f}x "
        f"(CPU time {row['ratio_cpu_time']:.2f}x)", flush=True,
    )
    return row


def sweep_compact_at(name: str, ours, batch: int, repeats: int, thresholds=(None, 0.125, 0.25, 0.5, 0.75)) -> None:
    """scalerl's RL-length throughput at several compaction thresholds, interleaved."""
    prompts = torch.randint(3, VOCAB, (batch, PROMPT_LEN), generator=torch.Generator().manual_seed(0)).tolist()
    lengths = rl_lengths(batch, RL_NEW_TOKENS)
    sampling = SamplingParams(max_new_tokens=RL_NEW_TOKENS, temperature=1.0, seed=0, stop_token_ids=[STOP_ID])
    engines = {str(at): BuiltinEngine(ours, PAD_ID, logits_processor=ForcedStop(lengths), compact_at=at) for at in thresholds}
    _, t = interleaved_medians({at: (lambda e=e: e.generate(prompts, sampling)) for at, e in engines.items()}, repeats)
    tokens = int(lengths.sum())
    cells = " | ".join(f"{at}: {tokens / s:6.0f}" for at, s in t.items())
    print(f"{name:24s} batch {batch:3d} compact_at -> tok/s (CPU time)  {cells}", flush=True)


# ----------------------------------------------------------------------------- fixed lengths, roofline
def step_kernel_time(model, batch: int, cache_len: int, repeats: int) -> float:
    """CPU seconds for one decode step's matmuls and attention, run back to back in isolation (median)."""
    cfg, layers = model.config, model.layers
    x = torch.randn(batch, 1, cfg.hidden_size)
    q = torch.randn(batch, cfg.num_attention_heads, 1, cfg.head_dim)
    kv = torch.randn(batch, cfg.num_key_value_heads, cache_len, cfg.head_dim)
    mask = torch.ones(batch, 1, 1, cache_len, dtype=torch.bool)
    mlp_in = torch.randn(batch, 1, cfg.intermediate_size)
    attn_out = torch.randn(batch, 1, cfg.num_attention_heads * cfg.head_dim)

    def step():
        for layer in layers:
            a, m = layer.self_attn, layer.mlp
            for proj in (a.q_proj, a.k_proj, a.v_proj):
                F.linear(x, proj.weight, proj.bias)
            F.scaled_dot_product_attention(q, kv, kv, attn_mask=mask, enable_gqa=True)
            F.linear(attn_out, a.o_proj.weight)
            F.linear(x, m.gate_proj.weight)
            F.linear(x, m.up_proj.weight)
            F.linear(mlp_in, m.down_proj.weight)
        F.linear(x, model.lm_head.weight)

    def many_steps():
        for _ in range(20):
            step()

    with torch.inference_mode():
        return interleaved_medians({"step": many_steps}, repeats)[1]["step"] / 20


def run_fixed(name: str, ours, hf, batch: int, repeats: int) -> dict:
    prompts = torch.randint(3, VOCAB, (batch, PROMPT_LEN), generator=torch.Generator().manual_seed(0))
    engine = BuiltinEngine(ours, PAD_ID)

    def scalerl_fn(new_tokens):
        out = engine.generate(prompts.tolist(), SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=0))
        assert out.response_ids.shape == (batch, new_tokens)

    def hf_fn():
        with torch.inference_mode():
            out = hf.generate(
                prompts, attention_mask=torch.ones_like(prompts), do_sample=True, temperature=1.0,
                top_p=1.0, top_k=0, max_new_tokens=FIXED_NEW_TOKENS, min_new_tokens=FIXED_NEW_TOKENS,
                pad_token_id=PAD_ID, eos_token_id=None,
            )
        assert out.shape == (batch, PROMPT_LEN + FIXED_NEW_TOKENS)

    t, cpu = interleaved_medians(
        {"hf": hf_fn, "scalerl": lambda: scalerl_fn(FIXED_NEW_TOKENS), "scalerl_1": lambda: scalerl_fn(1)}, repeats
    )
    step_s = (cpu["scalerl"] - cpu["scalerl_1"]) / (FIXED_NEW_TOKENS - 1)
    kernels_s = step_kernel_time(ours, batch, PROMPT_LEN + FIXED_NEW_TOKENS // 2, repeats)
    tokens = batch * FIXED_NEW_TOKENS
    row = {
        "model": name, "batch": batch, "lengths": "fixed", "hf_tokens_per_s": tokens / t["hf"],
        "scalerl_tokens_per_s": tokens / t["scalerl"], "ratio": t["hf"] / t["scalerl"],
        "ratio_cpu_time": cpu["hf"] / cpu["scalerl"], "scalerl_step_ms": step_s * 1e3, "kernels_step_ms": kernels_s * 1e3,
    }
    print(
        f"{name:24s} batch {batch:3d} fixed: HF {row['hf_tokens_per_s']:7.0f} tok/s | scalerl "
        f"{row['scalerl_tokens_per_s']:7.0f} tok/s | ratio {row['ratio']:.2f}x (CPU time {row['ratio_cpu_time']:.2f}x) | "
        f"step {row['scalerl_step_ms']:.3f} ms "
        f"vs matmul+attention {row['kernels_step_ms']:.3f} ms ({row['scalerl_step_ms'] / row['kernels_step_ms']:.2f}x)",
        flush=True,
    )
    return row


def run(lengths: str, repeats: int, tmp_dir: str, sweep: bool) -> list[dict]:
    import transformers

    rows = []
    for name, dims in SIZES.items():
        cfg = ModelConfig(vocab_size=VOCAB, **dims)
        ours = build_model(cfg, seed=0).eval()
        path = f"{tmp_dir}/{name.split()[0]}"
        save_pretrained(ours, path)
        hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
        for batch in BATCHES:
            if lengths in ("fixed", "all"):
                rows.append(run_fixed(name, ours, hf, batch, repeats))
            if lengths in ("rl", "all"):
                rows.append(run_rl(name, ours, hf, batch, repeats))
            if sweep:
                sweep_compact_at(name, ours, batch, repeats)
    return rows


def main() -> None:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", choices=("fixed", "rl", "all"), default="all")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved timed rounds; medians are reported")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads for both engines")
    parser.add_argument("--sweep-compact-at", action="store_true", help="also time compaction thresholds")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--engines", default="builtin,hf",
                        help="builtin,hf: the built-in engine beside HF generate (the rows above); with vllm also "
                             "vLLM beside the built-in engine (benchmarks/generation_vllm.py, its --vllm-* options)")
    from generation_vllm import add_vllm_arguments, vllm_rows_from_args  # beside this file

    add_vllm_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with open("/proc/loadavg") as f:
        print(f"load average before: {f.read().split()[:3]}")
    engines = set(args.engines.split(","))
    rows = []
    if "hf" in engines:
        with tempfile.TemporaryDirectory() as tmp:
            rows = run(args.lengths, args.repeats, tmp, args.sweep_compact_at)
    if "vllm" in engines:
        rows += vllm_rows_from_args(args)
    for kind in ("fixed", "rl"):
        ratios = [r["ratio"] for r in rows if r["lengths"] == kind]
        if ratios:
            print(f"minimum ratio, {kind} lengths: {min(ratios):.2f}x (target >= 2x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
