"""vLLM's asynchronous engine (`VLLMAsyncEngine`, AsyncLLM) against the synchronous `VLLMEngine` (LLM) on a
stream of requests, same weights, side by side in one run.

    PYTHONPATH=$PWD .venv-vllm/bin/python benchmarks/vllm_async_stream.py [--requests 128] [--new-tokens 64]
        [--max-num-seqs 32] [--repeats 3] [--loads 3] [--hidden 128] [--layers 2]

Both sample (temperature 1, seeded per request, no stop token, so each emits requests x new-tokens tokens)
from 4-16-token prompts on a Qwen2-shaped model (head_dim 64) in fp32, with the same ``max_num_seqs``. Rows:
- ``sync``: `VLLMEngine.generate` on all requests at once (vLLM's LLM batches them continuously inside);
- ``async``: every request submitted to `VLLMAsyncEngine` at once, then `step()` until all are out;
- ``async + loads``: the same with ``--loads`` whole weight loads spread over the run (each pauses, loads,
  resumes the requests in flight, which are prefilled again with the new weights).
Runs are interleaved (sync, async, async + loads, sync, ...) after a warm-up; medians of wall-clock tokens/s
(the engine cores are child processes, so this process's CPU time would not count them). Print ``uptime``
beside the numbers: the machine is shared.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time

import torch

from scalerl.models.config import ModelConfig
from scalerl.models.decoder import build_model
from scalerl.models.hf_checkpoint import save_pretrained
from scalerl.rollout.engines.continuous import GenerationRequest
from scalerl.rollout.engines.engine import SamplingParams
from scalerl.rollout.engines.vllm import VLLMEngine
from scalerl.rollout.engines.vllm_async import VLLMAsyncEngine


def model_of(hidden: int, layers: int, seed: int) -> torch.nn.Module:
    cfg = ModelConfig(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=hidden // 64, num_key_value_heads=1, max_position_embeddings=512)
    return build_model(cfg, seed=seed).eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--loads", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (int(n),), generator=g).tolist()
               for n in torch.randint(4, 17, (args.requests,), generator=g)]
    sampling = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, seed=7)
    models = [model_of(args.hidden, args.layers, seed) for seed in (1, 2)]
    tensors = [[(n, p.detach()) for n, p in m.named_parameters()] for m in models]
    tokens = args.requests * args.new_tokens
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(models[0], tmp)
        sync = VLLMEngine(tmp, 0, kv_cache_gib=0.5, max_model_len=16 + args.new_tokens, max_num_seqs=args.max_num_seqs)
        stream = VLLMAsyncEngine(tmp, 0, max_num_seqs=args.max_num_seqs, max_prompt_len=16,
                                 max_new_tokens=args.new_tokens, kv_cache_gib=0.5)
        try:
            def run_sync() -> float:
                started = time.perf_counter()
                out = sync.generate(prompts, sampling)
                assert int(out.response_mask.sum()) == tokens
                return time.perf_counter() - started

            def run_async(loads: int) -> float:
                started = time.perf_counter()
                for i, p in enumerate(prompts):
                    stream.submit(GenerationRequest(i, p, dataclasses.replace(sampling, row_offset=i)))
                outs, next_load = [], 1
                while stream.has_unfinished():
                    outs += stream.step()
                    if next_load <= loads and len(outs) >= next_load * args.requests / (loads + 1):
                        stream.load_weights(tensors[next_load % 2])
                        next_load += 1
                assert sum(len(o.token_ids) for o in outs) == tokens
                return time.perf_counter() - started

            rows = {"sync": run_sync, "async": lambda: run_async(0), f"async + {args.loads} loads": lambda: run_async(args.loads)}
            for fn in rows.values():  # warm-up
                fn()
            seconds = {name: [] for name in rows}
            for _ in range(args.repeats):
                for name, fn in rows.items():
                    seconds[name].append(fn())
        finally:
            stream.close()
            sync.close()
    base = statistics.median(seconds["sync"])
    print(f"{args.requests} requests x {args.new_tokens} tokens, max_num_seqs {args.max_num_seqs}, "
          f"hidden {args.hidden} x {args.layers} layers, fp32, medians of {args.repeats}")
    print(f"{'engine':<20} {'tokens/s':>10} {'s':>8} {'vs sync':>8}")
    for name, s in seconds.items():
        m = statistics.median(s)
        print(f"{name:<20} {tokens / m:>10.0f} {m:>8.2f} {base / m:>7.2f}x")


if __name__ == "__main__":
    main()
