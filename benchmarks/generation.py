"""Built-in engine vs Hugging Face `generate` on the same weights, measured side by side in one run.

    python benchmarks/generation.py [--lengths fixed|rl|stream|all] [--repeats 5] [--threads 1] [--json out.json]
                                    [--engines builtin,vllm,hf]  (vllm: the rows of benchmarks/generation_vllm.py)

Both sample (temperature 1, top-p 1) in fp32 with a KV cache from 16-token prompts, on one intra-op thread.
Runs are interleaved (HF, scalerl, HF, ...) after a warm-up and each side's median is reported, so machine
load hits both alike. Tokens/s are wall-clock; each ratio is also given in the process's CPU time, which
leaves out the time other tenants of a shared machine hold the cores and is the steadier of the two.

``--lengths fixed``: 64 new tokens and no stop token, so both emit exactly batch x 64 tokens. Besides the
ratio, the table puts scalerl's decode step CPU time (a 64-token run minus a 1-token run, over 63 steps)
next to the CPU time of the same step's matmuls (packed q/k/v, o, packed gate/up, down, lm_head, in the layout
the engine decodes from) and attention (SDPA over the mean cache length) run back to back in isolation on the
same tensors: a roofline on this CPU. The gap is the loop's own overhead (norms, RoPE, sampling, cache
writes, the dispatcher). Each layer's attention reads its own keys and values there, views of one buffer
laid out as the engine's cache; the row also gives the earlier measure, in which every layer read one
contiguous key/value tensor that stayed in the core's caches.

``--lengths rl``: RL-like response lengths. Each row's length is drawn log-normally (median a quarter of
the 128 new tokens, sigma 1, clipped to [2, 128]) and both engines are made to stop there by the same
logits processor: it bans the stop token at every other step and forces it at the row's drawn step
(HF: a ``LogitsProcessor`` with ``eos_token_id`` = the stop token; scalerl: the engine's
``logits_processor``). Both therefore produce exactly the same lengths (asserted), while the processor's
cost (a few batched tensor ops per step) is the same for both and the model does the same work as with
naturally sampled stops. HF keeps stepping finished rows until the longest is done; scalerl compacts them
away. Tokens/s counts real response tokens (stop token included, padding not). The table also shows
scalerl with compaction off (``compact_at=None``), measured in the same interleaved run.

``--lengths stream`` (also part of ``rl`` and ``all``): 512 requests arrive as a stream (all queued at the
start), RL-like lengths as above, forced by request. Continuous batching (``max_num_seqs`` = 64 rows, a
finished row's slot refilled at once) against today's fixed-batch ``generate`` on consecutive batches of 64
(each batch compacts its finished rows, but the next batch starts only once its longest row is done). Both
draw each request's samples from its global row, so they emit the same tokens (asserted); the row gives
tokens/s, the time to drain the 512 requests and the ratio, same interleaving and medians, and, counted in
an untimed run of each, the decode forwards, the rows they carry and the key columns their attention reads.

``--sweep-compact-at`` adds the compaction-threshold trade-off on the RL lengths (scalerl only).

``--dtype bf16`` runs both sides in bf16 (scalerl: bf16 copies laid out once per sync, `DecodeModel`; HF: the
model loaded in bf16); the default fp32 compares fp32 with fp32.

``--compile-cost``: torch.compile's warm-up against the decode-step time it saves, for the model's forward
and for the fused decode path (`DecodeModel(compile=True)`), in ``--dtype`` (why the engine does not
compile by default).

``--profile-step``: the top-level ops one decode step of the engine runs (small model, batch 16, fp32 and
bf16), counted by the profiler, by name.

``--linear-layouts``: oneDNN's blocked weight layout against plain ``F.linear`` for each matrix shape of these
models at 1, 16 and 64 rows (why `DecodeModel` keeps small fp32 matrices plain).

``--roofline``: scalerl alone, fp32 against bf16, on the small and a Qwen2.5-0.5B-shaped model (published
config, random weights; ``--layers-05b`` of its 24 layers, 4-token prompts so prefill stays cheap) at batch
1, 8, 16, 64. Per row: the decode step (an N-token run minus a 1-token run, CPU time), tokens/s of decode,
the GB/s of weights the step reads (every packed matrix and the LM head, once per step), against the machine's
memory bandwidth measured in the same run (a STREAM-like 512 MiB copy, bytes read + written, and a read-only
sum; CPU time like the steps): the decode roofline is batch x copy bandwidth / weight bytes tokens/s. Also
the cost of laying the weights out again after a sync (CPU time). "kernels" is the same step's packed matmuls
and attention run back to back alone on the same tensors, so step / kernels is the loop's own overhead.
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
from scalerl.models.decode_model import DecodeModel
from scalerl.models.decoder import build_model
from scalerl.models.hf_checkpoint import save_pretrained
from scalerl.rollout.engines.builtin import BuiltinEngine
from scalerl.rollout.engines.continuous import GenerationRequest
from scalerl.rollout.engines.engine import SamplingParams

SIZES = {
    "tiny (2L, h64, V256)": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    "small (4L, h256, V256)": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4),
}
BATCHES = (16, 64)
PROMPT_LEN, FIXED_NEW_TOKENS, RL_NEW_TOKENS = 16, 64, 128
STREAM_REQUESTS, STREAM_MAX_NUM_SEQS = 512, 64
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


def run_rl(name: str, ours, hf, batch: int, repeats: int, dtype: torch.dtype = torch.float32) -> dict:
    from transformers import LogitsProcessorList

    prompts = torch.randint(3, VOCAB, (batch, PROMPT_LEN), generator=torch.Generator().manual_seed(0))
    lengths = rl_lengths(batch, RL_NEW_TOKENS)
    sampling = SamplingParams(max_new_tokens=RL_NEW_TOKENS, temperature=1.0, seed=0, stop_token_ids=[STOP_ID])
    compacting = BuiltinEngine(ours, PAD_ID, logits_processor=ForcedStop(lengths), dtype=dtype)
    stepping = BuiltinEngine(ours, PAD_ID, logits_processor=ForcedStop(lengths), compact_at=None, dtype=dtype)

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


# ------------------------------------------------------------------------------- a stream of requests
def run_stream(name: str, ours, repeats: int, requests: int = STREAM_REQUESTS, rows: int = STREAM_MAX_NUM_SEQS) -> dict:
    """Drain ``requests`` queued requests: continuous batching with ``rows`` slots vs fixed batches of ``rows``."""
    prompts = torch.randint(3, VOCAB, (requests, PROMPT_LEN), generator=torch.Generator().manual_seed(0)).tolist()
    lengths = rl_lengths(requests, RL_NEW_TOKENS)
    sampling = SamplingParams(max_new_tokens=RL_NEW_TOKENS, temperature=1.0, seed=0, stop_token_ids=[STOP_ID],
                              total_rows=requests)
    # Request i samples with the draws of global row i, as row i of a fixed batch at row_offset does.
    draws = torch.rand(RL_NEW_TOKENS, requests, generator=torch.Generator().manual_seed(0))
    continuous = BuiltinEngine(ours, PAD_ID, max_num_seqs=rows, logits_processor=ForcedStop(lengths))
    fixed = [BuiltinEngine(ours, PAD_ID, logits_processor=ForcedStop(lengths[i : i + rows])) for i in range(0, requests, rows)]
    results: dict[str, list] = {}

    def continuous_fn():
        engine = continuous.continuous_engine(PROMPT_LEN, RL_NEW_TOKENS)
        stream = (GenerationRequest(i, p, sampling, draws[:, i]) for i, p in enumerate(prompts))
        outputs = sorted(engine.generate_stream(stream), key=lambda o: o.request_id)
        results["continuous"] = [o.token_ids for o in outputs]

    def fixed_fn():
        tokens = []
        for k, engine in enumerate(fixed):
            chunk = SamplingParams(**{**vars(sampling), "row_offset": k * rows})
            out = engine.generate(prompts[k * rows : (k + 1) * rows], chunk)
            tokens += [ids[: int(n)] for ids, n in zip(out.response_ids, out.response_lengths)]
        results["fixed"] = tokens

    work = {name: decode_work(ours, fn) for name, fn in (("fixed", fixed_fn), ("continuous", continuous_fn))}
    t, cpu = interleaved_medians({"fixed": fixed_fn, "continuous": continuous_fn}, repeats)
    assert [len(x) for x in results["continuous"]] == lengths.tolist()
    same = sum(torch.equal(a, b) for a, b in zip(results["continuous"], results["fixed"]))
    tokens = int(lengths.sum())
    row = {
        "model": name, "batch": rows, "lengths": "stream", "requests": requests,
        "fixed_tokens_per_s": tokens / t["fixed"], "continuous_tokens_per_s": tokens / t["continuous"],
        "fixed_drain_s": t["fixed"], "continuous_drain_s": t["continuous"], "ratio": t["fixed"] / t["continuous"],
        "ratio_cpu_time": cpu["fixed"] / cpu["continuous"], "mean_length": float(lengths.float().mean()),
        "longest": int(lengths.max()), "same_tokens": same,
        **{f"{name}_{key}": value for name, counts in work.items() for key, value in counts.items()},
    }
    print(
        f"{name:24s} stream of {requests} requests, {rows} rows (mean {row['mean_length']:5.1f}, longest "
        f"{row['longest']:3d}): fixed batches {row['fixed_tokens_per_s']:7.0f} tok/s, drained in "
        f"{row['fixed_drain_s']:6.2f} s | continuous {row['continuous_tokens_per_s']:7.0f} tok/s, "
        f"{row['continuous_drain_s']:6.2f} s | ratio {row['ratio']:.2f}x (CPU time {row['ratio_cpu_time']:.2f}x) | "
        f"same tokens in {same}/{requests} requests",
        flush=True,
    )
    print(
        f"{'':24s} decode forwards: fixed {row['fixed_forwards']}, continuous {row['continuous_forwards']} | rows "
        f"decoded {row['fixed_rows']} vs {row['continuous_rows']} ({tokens} tokens) | attention keys read (rows x "
        f"key columns) {row['fixed_key_reads']} vs {row['continuous_key_reads']}",
        flush=True,
    )
    return row


def decode_work(model, fn) -> dict[str, int]:
    """Decode forwards run by ``fn``, the rows they carry and the key columns their attention reads
    (rows x key-mask width, summed): the work a step's fixed cost, its matmuls and its attention scale with.
    Counted on the model's own forward and on the fused path's (`DecodeModel`), whichever runs."""
    counts = {"forwards": 0, "rows": 0, "key_reads": 0}

    def count(input_ids, attention_mask):
        if input_ids.shape[1] == 1:
            counts["forwards"] += 1
            counts["rows"] += input_ids.shape[0]
            counts["key_reads"] += input_ids.shape[0] * attention_mask.shape[1]

    handle = model.register_forward_pre_hook(lambda _, args, kwargs: count(args[0], kwargs["attention_mask"]),
                                             with_kwargs=True)
    fused_forward = DecodeModel.__call__

    def counted(self, input_ids, attention_mask, *args, **kwargs):
        count(input_ids, attention_mask)
        return fused_forward(self, input_ids, attention_mask, *args, **kwargs)

    DecodeModel.__call__ = counted
    try:
        fn()
    finally:
        handle.remove()
        DecodeModel.__call__ = fused_forward
    return counts


# ----------------------------------------------------------------------------- fixed lengths, roofline
def decode_kernel_time(decode: DecodeModel, batch: int, cache_len: int, repeats: int,
                       per_layer_cache: bool = True) -> float:
    """CPU seconds for one decode step's matmuls (packed q/k/v, o, packed gate/up, down, LM head, in the
    decode dtype) and attention (SDPA over ``cache_len`` fp32 keys, as the step runs it), back to back in
    isolation on the same tensors (median).

    ``per_layer_cache``: each layer's attention reads its own keys and values, views of one buffer laid out
    as the engine's cache (`KVCache`), as a real step does; otherwise every layer reads the same contiguous
    keys and values, which then stay in the core's caches (the earlier, hot-cache measure: at batch 16 on
    the small model each layer's keys and values are 0.8 MB, and the four layers' 3 MB do not fit in L2)."""
    from scalerl.models.kv_cache import KVCache

    cfg, dtype = decode.config, decode.dtype
    x = torch.randn(batch, 1, cfg.hidden_size, dtype=dtype)
    q = torch.randn(batch, cfg.num_attention_heads, 1, cfg.head_dim)
    if per_layer_cache:
        cache = KVCache(len(decode.layers), batch, cache_len + FIXED_NEW_TOKENS // 2)
        cache.allocate(cfg.num_key_value_heads, cfg.head_dim, torch.float32, x.device)
        cache.kv.normal_()
        kvs = [(cache.keys[i, :, :, :cache_len], cache.values[i, :, :, :cache_len]) for i in range(len(decode.layers))]
    else:
        kv = torch.randn(batch, cfg.num_key_value_heads, cache_len, cfg.head_dim)
        kvs = [(kv, kv)] * len(decode.layers)
    bias = torch.zeros(batch, 1, 1, cache_len)
    mlp_in = torch.randn(batch, 1, cfg.intermediate_size, dtype=dtype)
    attn_out = torch.randn(batch, 1, cfg.num_attention_heads * cfg.head_dim, dtype=dtype)

    def step():
        for lw, (k, v) in zip(decode.layers, kvs):
            lw.qkv(x)
            F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)
            lw.o(attn_out)
            lw.gate_up(x)
            lw.down(mlp_in)
        decode.lm_head(x)

    def many_steps():
        for _ in range(20):
            step()

    with torch.inference_mode():
        return interleaved_medians({"step": many_steps}, repeats)[1]["step"] / 20


def memory_bandwidth(mib: int = 512, repeats: int = 5) -> tuple[float, float]:
    """GB/s of a STREAM-like copy (bytes read plus bytes written) and of a read-only pass (a sum) over
    ``mib`` MiB, in this process's CPU time (as the steps are timed, so other tenants' time on the cores is
    left out), best of ``repeats``: what a decode step's weight reads are bounded by."""
    src = torch.ones(mib * 2**20 // 4)
    dst = torch.zeros_like(src)  # touched once here, so the timed copies take no page faults

    def best(fn) -> float:
        times = []
        for _ in range(repeats):
            start = time.process_time()
            fn()
            times.append(time.process_time() - start)
        return min(times)

    nbytes = src.numel() * 4
    return 2 * nbytes / best(lambda: dst.copy_(src)) / 1e9, nbytes / best(src.sum) / 1e9


def run_fixed(name: str, ours, hf, batch: int, repeats: int, dtype: torch.dtype = torch.float32) -> dict:
    prompts = torch.randint(3, VOCAB, (batch, PROMPT_LEN), generator=torch.Generator().manual_seed(0))
    engine = BuiltinEngine(ours, PAD_ID, dtype=dtype)

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
    decode = DecodeModel(ours, dtype)
    kernels_s = decode_kernel_time(decode, batch, PROMPT_LEN + FIXED_NEW_TOKENS // 2, repeats)
    hot_s = decode_kernel_time(decode, batch, PROMPT_LEN + FIXED_NEW_TOKENS // 2, repeats, per_layer_cache=False)
    tokens = batch * FIXED_NEW_TOKENS
    row = {
        "model": name, "batch": batch, "lengths": "fixed", "hf_tokens_per_s": tokens / t["hf"],
        "scalerl_tokens_per_s": tokens / t["scalerl"], "ratio": t["hf"] / t["scalerl"],
        "ratio_cpu_time": cpu["hf"] / cpu["scalerl"], "scalerl_step_ms": step_s * 1e3, "kernels_step_ms": kernels_s * 1e3,
        "kernels_hot_kv_step_ms": hot_s * 1e3,
    }
    print(
        f"{name:24s} batch {batch:3d} fixed: HF {row['hf_tokens_per_s']:7.0f} tok/s | scalerl "
        f"{row['scalerl_tokens_per_s']:7.0f} tok/s | ratio {row['ratio']:.2f}x (CPU time {row['ratio_cpu_time']:.2f}x) | "
        f"step {row['scalerl_step_ms']:.3f} ms "
        f"vs matmul+attention {row['kernels_step_ms']:.3f} ms ({row['scalerl_step_ms'] / row['kernels_step_ms']:.2f}x; "
        f"one hot key/value tensor {row['kernels_hot_kv_step_ms']:.3f} ms, "
        f"{row['scalerl_step_ms'] / row['kernels_hot_kv_step_ms']:.2f}x)",
        flush=True,
    )
    return row


def run(lengths: str, repeats: int, tmp_dir: str, sweep: bool, dtype: torch.dtype = torch.float32) -> list[dict]:
    import transformers

    rows = []
    for name, dims in SIZES.items():
        cfg = ModelConfig(vocab_size=VOCAB, **dims)
        ours = build_model(cfg, seed=0).eval()
        path = f"{tmp_dir}/{name.split()[0]}"
        save_pretrained(ours, path)
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype).eval()
        for batch in BATCHES if lengths != "stream" else ():
            if lengths in ("fixed", "all"):
                rows.append(run_fixed(name, ours, hf, batch, repeats, dtype))
            if lengths in ("rl", "all"):
                rows.append(run_rl(name, ours, hf, batch, repeats, dtype))
            if sweep:
                sweep_compact_at(name, ours, batch, repeats)
        if lengths in ("rl", "stream", "all"):
            rows.append(run_stream(name, ours, repeats))
    return rows


# ------------------------------------------------------------------------------ torch.compile's cost
def compile_cost(batch: int = 16, dtype: torch.dtype = torch.float32) -> None:
    """torch.compile's warm-up against the decode-step time it saves, on the small model at ``batch`` rows:
    the model's own forward (eager vs compiled) and the fused decode path (`DecodeModel`: eager over
    oneDNN-blocked weights vs ``compile=True``, compiled over plain weights), ``dynamic=True`` (the cache
    grows every step). Steps are CPU time, best of 3 runs of 63 steps; the warm-up is compile + 2 steps."""
    from scalerl.models.kv_cache import KVCache

    model = build_model(ModelConfig(vocab_size=VOCAB, **SIZES["small (4L, h256, V256)"]), seed=0).eval()
    ids = torch.randint(3, VOCAB, (batch, PROMPT_LEN), generator=torch.Generator().manual_seed(0))

    def decode_step_s(forward, steps: int) -> tuple[float, torch.Tensor]:
        cache = KVCache.for_model(model, batch, PROMPT_LEN + FIXED_NEW_TOKENS)
        mask = torch.ones(batch, PROMPT_LEN + FIXED_NEW_TOKENS, dtype=torch.bool)
        forward(ids, attention_mask=mask[:, :PROMPT_LEN], kv_cache=cache, cache_start=0, logits_to_keep=1)
        token = torch.randint(3, VOCAB, (batch, 1), generator=torch.Generator().manual_seed(1))
        start = time.process_time()
        for t in range(steps):
            cur = PROMPT_LEN + t
            logits = forward(token, attention_mask=mask[:, : cur + 1], position_ids=torch.full((batch, 1), cur),
                             kv_cache=cache, cache_start=cur)
        return (time.process_time() - start) / steps, logits

    cases = {"model forward": (model, lambda: torch.compile(model, dynamic=True))}
    if dtype == torch.float32:
        cases = {**cases, "fused path": (DecodeModel(model, dtype), lambda: DecodeModel(model, dtype, compile=True))}
    else:
        cases = {"fused path": (DecodeModel(model, dtype), lambda: DecodeModel(model, dtype, compile=True))}
    for name, (eager, make_compiled) in cases.items():
        with torch.inference_mode():
            eager_s, eager_logits = min(decode_step_s(eager, FIXED_NEW_TOKENS - 1) for _ in range(3))
            compiled = make_compiled()
            start_wall, start_cpu = time.perf_counter(), time.process_time()
            decode_step_s(compiled, 2)
            warm_wall, warm_cpu = time.perf_counter() - start_wall, time.process_time() - start_cpu
            fast, logits = min(decode_step_s(compiled, FIXED_NEW_TOKENS - 1) for _ in range(3))
        saved = eager_s - fast
        print(f"{name:14s} {str(dtype):15s} batch {batch}: eager step {eager_s * 1e3:.3f} ms | compiled step "
              f"{fast * 1e3:.3f} ms | warm-up (compile + 2 steps) {warm_wall:.1f} s wall, {warm_cpu:.1f} s CPU | "
              f"repaid after {'never' if saved <= 0 else f'{warm_cpu / saved:.0f} steps'} | max |logits "
              f"difference| {(logits.float() - eager_logits.float()).abs().max().item():.1e}", flush=True)


# ------------------------------------------------------------------------------ ops per decode step
def profile_step(batch: int = 16) -> None:
    """Top-level ops (what the dispatcher runs for Python calls) per decode step of the engine on the small
    model, fp32 and bf16: a 9-token run's minus a 1-token run's, over 8 steps, by op name."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    model = build_model(ModelConfig(vocab_size=VOCAB, **SIZES["small (4L, h256, V256)"]), seed=0).eval()
    prompts = torch.randint(3, VOCAB, (batch, PROMPT_LEN), generator=torch.Generator().manual_seed(0)).tolist()
    for dtype in (torch.float32, torch.bfloat16):
        engine = BuiltinEngine(model, PAD_ID, dtype=dtype)
        counts = []
        for n in (9, 1):
            sampling = SamplingParams(max_new_tokens=n, temperature=1.0, seed=0)
            engine.generate(prompts, sampling)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                engine.generate(prompts, sampling)
            counts.append(Counter(e.name for e in prof.events() if e.cpu_parent is None))
        per_step = {name: (counts[0][name] - counts[1][name]) / 8 for name in counts[0]}
        top = sorted(((n, name) for name, n in per_step.items() if n), reverse=True)[:12]
        print(f"{str(dtype):15s} batch {batch}: {sum(per_step.values()):.0f} top-level ops per decode step; most "
              f"frequent: " + ", ".join(f"{name.split('::')[-1]} {n:g}" for n, name in top), flush=True)


# ---------------------------------------------------------------------- blocked vs plain weight layout
LAYOUT_SHAPES = [(128, 64), (352, 64), (64, 176), (256, 256), (512, 256), (1376, 256), (256, 688), (1152, 896),
                 (9728, 896), (896, 4864)]  # [out, in]: the tiny, small and 0.5B-shaped models' matrices


def linear_layouts() -> None:
    """One decode-shaped product per weight matrix of the benchmark's models, oneDNN's blocked layout
    (`torch.ops.mkldnn._linear_pointwise`) against F.linear on the plain tensor, at 1, 16 and 64 rows, fp32
    and bf16; CPU time, best of 5: where `DecodeModel` keeps fp32 matrices plain (FP32_PLAIN_MAX)."""
    mkldnn = torch.ops.mkldnn

    def best_us(fn, calls: int) -> float:
        fn()
        times = []
        for _ in range(5):
            start = time.process_time()
            for _ in range(calls):
                fn()
            times.append((time.process_time() - start) / calls * 1e6)
        return min(times)

    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            for out_features, in_features in LAYOUT_SHAPES:
                plain = (torch.randn(out_features, in_features) / in_features ** 0.5).to(dtype)
                blocked = mkldnn._reorder_linear_weight(plain, 16)
                cells = []
                for rows in (1, 16, 64):
                    x = torch.randn(rows, 1, in_features).to(dtype)
                    calls = max(5, int(2e5 / (out_features * in_features / 1000 + 20)))
                    b = best_us(lambda: mkldnn._linear_pointwise(x, blocked, None, "none", [None], ""), calls)
                    p = best_us(lambda: F.linear(x, plain), calls)
                    cells.append(f"{rows:2d} rows: blocked {b:8.1f} us, plain {p:8.1f} us ({'blocked' if b < p else 'plain'})")
                print(f"{str(dtype):15s} {out_features:5d} x {in_features:4d}: " + " | ".join(cells), flush=True)


# ---------------------------------------------------------------------------- roofline, fp32 vs bf16
ROOFLINE_MODELS = {
    "small (4L, h256, V256)": dict(vocab_size=VOCAB, **SIZES["small (4L, h256, V256)"]),
    # Qwen/Qwen2.5-0.5B's published config.json (as benchmarks/real_size_loading.py and packing.py use).
    "0.5B-shaped": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                        tie_word_embeddings=True),
}
ROOFLINE_BATCHES = (1, 8, 16, 64)


def run_roofline(repeats: int, layers_05b: int, new_tokens: int) -> list[dict]:
    bandwidth, read_bandwidth = memory_bandwidth()
    print(f"STREAM-like copy: {bandwidth:.1f} GB/s (read + write), read-only sum: {read_bandwidth:.1f} GB/s "
          f"({torch.get_num_threads()} thread(s), CPU time)", flush=True)
    rows = []
    for name, fields in ROOFLINE_MODELS.items():
        if name == "0.5B-shaped" and not layers_05b:
            continue
        if name == "0.5B-shaped":
            fields = {**fields, "num_hidden_layers": layers_05b}
            name = f"0.5B-shaped ({layers_05b} of 24 layers)"
        ours = build_model(ModelConfig(**fields), seed=0).eval()
        prompt_len = 4 if fields["vocab_size"] > VOCAB else PROMPT_LEN
        for d in ("float32", "bfloat16"):  # what a weight sync adds: laying the new weights out again
            engine = BuiltinEngine(ours, PAD_ID, dtype=getattr(torch, d))
            engine.refresh_weights()
            start = time.process_time()
            engine.refresh_weights()
            print(f"{name:30s} {d:8s} relayout after a sync: {time.process_time() - start:.3f} s CPU "
                  f"({engine.decode_model.weight_bytes / 1e9:.2f} GB laid out)", flush=True)
        for batch in ROOFLINE_BATCHES:
            prompts = torch.randint(3, fields["vocab_size"], (batch, prompt_len),
                                    generator=torch.Generator().manual_seed(0)).tolist()
            engines = {d: BuiltinEngine(ours, PAD_ID, dtype=getattr(torch, d)) for d in ("float32", "bfloat16")}
            fns = {}
            for d, engine in engines.items():
                for n in (new_tokens, 1):
                    fns[f"{d}/{n}"] = (lambda e=engine, n=n: e.generate(prompts, SamplingParams(
                        max_new_tokens=n, temperature=1.0, seed=0)))
            _, cpu = interleaved_medians(fns, repeats)
            for d, engine in engines.items():
                step_s = (cpu[f"{d}/{new_tokens}"] - cpu[f"{d}/1"]) / (new_tokens - 1)
                weight_bytes = engine.decode_model.weight_bytes
                kernels_s = decode_kernel_time(engine.decode_model, batch, prompt_len + new_tokens // 2, repeats)
                hot_s = decode_kernel_time(engine.decode_model, batch, prompt_len + new_tokens // 2, repeats,
                                           per_layer_cache=False)
                row = {"model": name, "dtype": d, "batch": batch, "step_ms": step_s * 1e3,
                       "kernels_ms": kernels_s * 1e3, "kernels_hot_kv_ms": hot_s * 1e3, "decode_tokens_per_s": batch / step_s,
                       "weight_gb": weight_bytes / 1e9, "weights_gb_per_s": weight_bytes / step_s / 1e9,
                       "copy_gb_per_s": bandwidth, "read_gb_per_s": read_bandwidth, "roofline_tokens_per_s": batch * bandwidth * 1e9 / weight_bytes}
                rows.append(row)
                print(f"{name:30s} {d:8s} batch {batch:3d}: step {row['step_ms']:8.3f} ms (kernels "
                      f"{row['kernels_ms']:8.3f} ms, {step_s / kernels_s:.2f}x; one hot key/value tensor "
                      f"{hot_s * 1e3:8.3f} ms, {step_s / hot_s:.2f}x) | {row['decode_tokens_per_s']:8.0f} tok/s "
                      f"| weights {row['weights_gb_per_s']:5.1f} GB/s of {bandwidth:.1f} | roofline "
                      f"{row['roofline_tokens_per_s']:8.0f} tok/s", flush=True)
            fp32, bf16 = rows[-2]["step_ms"], rows[-1]["step_ms"]
            print(f"{name:30s} batch {batch:3d}: bf16 / fp32 decode tokens/s {fp32 / bf16:.2f}x", flush=True)
    return rows


def main() -> None:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", choices=("fixed", "rl", "stream", "all"), default="all")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved timed rounds; medians are reported")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads for both engines")
    parser.add_argument("--sweep-compact-at", action="store_true", help="also time compaction thresholds")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="both sides' weights and compute")
    parser.add_argument("--roofline", action="store_true", help="scalerl fp32 vs bf16 against the memory roofline")
    parser.add_argument("--layers-05b", dest="layers_05b", type=int, default=24,
                        help="--roofline: decoder layers of the 0.5B-shaped model (24 in the real one; 0: skip it)")
    parser.add_argument("--new-tokens", type=int, default=16, help="--roofline: tokens per timed run")
    parser.add_argument("--compile-cost", action="store_true", help="torch.compile's warm-up vs its step time")
    parser.add_argument("--profile-step", action="store_true", help="ops per decode step (small model, batch 16)")
    parser.add_argument("--linear-layouts", action="store_true",
                        help="oneDNN's blocked weight layout vs plain F.linear per matrix shape (decode rows)")
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
    if args.linear_layouts:
        linear_layouts()
        return
    if args.profile_step:
        profile_step()
        return
    if args.compile_cost:
        compile_cost(dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype])
        return
    if args.roofline:
        rows = run_roofline(args.repeats, args.layers_05b, args.new_tokens)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=2)
        return
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    engines = set(args.engines.split(","))
    rows = []
    if "hf" in engines:
        with tempfile.TemporaryDirectory() as tmp:
            rows = run(args.lengths, args.repeats, tmp, args.sweep_compact_at, dtype)
    if "vllm" in engines:
        rows += vllm_rows_from_args(args)
    for kind in ("fixed", "rl"):
        ratios = [r["ratio"] for r in rows if r["lengths"] == kind]
        if ratios:
            print(f"minimum ratio, {kind} lengths: {min(ratios):.2f}x (target >= 2x)")
    ratios = [r["ratio"] for r in rows if r["lengths"] == "stream"]
    if ratios:
        print(f"minimum ratio, stream: continuous batching vs fixed batches {min(ratios):.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
