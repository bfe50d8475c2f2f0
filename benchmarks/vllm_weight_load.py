"""Where a weight load into vLLM spends its time: `VLLMEngine.load_weights` on the Qwen2.5-0.5B shape.

    PYTHONPATH=$PWD .venv-vllm/bin/python benchmarks/vllm_weight_load.py [--layers 1] [--loads 4]
        [--checksum new|old] [--transport staged|bytes] [--in-process] [--profile 30]

A random-weight model with ``--layers`` of the 0.5B shape's 24 decoder layers (its 136M-parameter embedding,
tied to the head, whole) is written to a temporary directory and opened by `VLLMEngine` in bf16 (what the
GRPO comparison of `benchmarks/generation_vllm.py --grpo` runs); then the trainer's fp32 parameters are
loaded ``--loads`` times (each a whole load: per bucket, the trainer converts to bf16, checksums, packs to
bytes, `collective_rpc` carries them to the engine's process, which checksums again and runs vLLM's
layerwise reload). Printed: wall seconds per load (the first pays one-time costs).

``--transport bytes`` sends each bucket as bytes through ``collective_rpc`` (the way before buckets were
staged in /dev/shm; `VLLMEngine.load_stage_dir` = None). ``--checksum old`` swaps `bucket_checksum` for `bucket_checksum_reference` (the first implementation) in
`scalerl.rollout.engines.vllm_weight_loading` on both sides (both sides only with ``--in-process``; otherwise the
engine's process keeps the new one). ``--in-process`` sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the engine
core runs in this process and ``--profile N`` (cProfile of one more load, the top N entries by cumulative and
by own time) sees both sides; without it the profile shows the trainer's side and the wait for the engine's
reply (the transfer, the engine's checksum and vLLM's load together).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--loads", type=int, default=4)
    parser.add_argument("--checksum", choices=("new", "old"), default="new")
    parser.add_argument("--transport", choices=("staged", "bytes"), default="staged")
    parser.add_argument("--in-process", action="store_true")
    parser.add_argument("--profile", type=int, default=0, help="cProfile one more load, print the top N")
    args = parser.parse_args()
    if args.in_process:  # before vLLM is imported
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    from benchmarks.precision import write_model
    from scalerl.bench.cost_model.model_shapes import model_shape
    from scalerl.comm.weights import delta
    from scalerl.models.config import ModelConfig
    from scalerl.models.decoder import build_model
    from scalerl.rollout.engines import vllm_weight_loading
    from scalerl.rollout.engines.vllm import VLLMEngine

    if args.checksum == "old":
        vllm_weight_loading.bucket_checksum = delta.bucket_checksum_reference
    fields = dict(model_shape("qwen2.5-0.5b").__dict__, num_hidden_layers=args.layers, torch_dtype="float32")
    fields = {k: fields[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                     "num_attention_heads", "num_key_value_heads", "attention_bias",
                                     "tie_word_embeddings", "torch_dtype")}
    with tempfile.TemporaryDirectory() as tmp:
        write_model(fields, Path(tmp) / "model")
        trained = build_model(ModelConfig(model_type="qwen2", max_position_embeddings=4096, **fields), seed=1)
        named = [(n, p.detach()) for n, p in trained.named_parameters()]
        params = sum(p.numel() for _, p in named)
        engine = VLLMEngine(str(Path(tmp) / "model"), pad_token_id=0, dtype="bf16", kv_cache_gib=0.5)
        if args.transport == "bytes":
            engine.load_stage_dir = None
        try:
            times = []
            for _ in range(args.loads):
                start = time.perf_counter()
                engine.load_weights(named)
                times.append(time.perf_counter() - start)
            rest = sorted(times[1:]) or times
            print(f"0.5B shape, {args.layers} of 24 layers ({params / 1e6:.0f}M parameters), bf16, checksum "
                  f"{args.checksum}, {args.transport}, {'in-process' if args.in_process else 'engine core in a child process'}: "
                  f"load s {[round(t, 3) for t in times]} | median after the first {rest[len(rest) // 2]:.3f} s "
                  f"({rest[len(rest) // 2] / params * 1e9:.1f} ns per parameter) | load average "
                  f"{os.getloadavg()[0]:.1f}", flush=True)
            if args.profile:
                profile = cProfile.Profile()
                profile.enable()
                engine.load_weights(named)
                profile.disable()
                for order in ("cumulative", "tottime"):
                    out = io.StringIO()
                    pstats.Stats(profile, stream=out).sort_stats(order).print_stats(args.profile)
                    print(out.getvalue())
        finally:
            engine.close()


if __name__ == "__main__":
    main()
