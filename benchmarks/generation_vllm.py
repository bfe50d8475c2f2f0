"""vLLM beside the built-in engine on the same weights: the rows of ``benchmarks/generation.py --engines``
that name ``vllm`` (run standalone too: ``python benchmarks/generation_vllm.py [options]``).

Sizes vLLM's CPU attention accepts (head_dim >= 32): a tiny and a small Qwen2-shaped model and one with the
published Qwen2.5-0.5B shapes (random weights). Both engines sample at temperature 1 from 16-token prompts:
``fixed`` emits exactly N new tokens per row (no stop token), ``rl`` the log-normal RL-like lengths of
generation.py (the built-in engine is forced to stop there by its logits processor; vLLM is given each
row's length as its ``max_tokens``), so both produce the same tokens' worth of work. Rounds alternate
between the engines after a warm-up and medians are reported, as wall-clock tokens/s (vLLM's engine runs in
a child process, so this process's CPU time says nothing about it). vLLM's start-up (model load) is
reported on its own, not in the tokens/s. ``ratio`` = vLLM tokens/s over the built-in engine's.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.generation import PAD_ID, PROMPT_LEN, STOP_ID, ForcedStop, interleaved_medians, rl_lengths  # noqa: E402
from scalerl.bench.cost_model.model_shapes import model_shape  # noqa: E402
from scalerl.models.config import ModelConfig  # noqa: E402
from scalerl.models.decoder import build_model  # noqa: E402
from scalerl.models.hf_checkpoint import save_pretrained  # noqa: E402
from scalerl.rollout.builtin_engine import BuiltinEngine  # noqa: E402
from scalerl.rollout.engine import SamplingParams  # noqa: E402

VLLM_SIZES = {
    "tiny": ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1),
    "small": ModelConfig(vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4),
    "0.5b": model_shape("qwen2.5-0.5b"),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _vllm_fn(engine, prompts: list[list[int]], max_tokens: list[int]):
    """One vLLM generation with a per-row length (``ignore_eos``: the length is the row's, as the built-in
    engine's forced stop makes it)."""
    params = [engine._vllm.SamplingParams(n=1, temperature=1.0, top_p=1.0, max_tokens=int(n), seed=i,
                                          ignore_eos=True, detokenize=False) for i, n in enumerate(max_tokens)]

    def run():
        outputs = engine.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outputs] == [int(n) for n in max_tokens]

    return run


def _builtin_fn(model, prompts: list[list[int]], lengths: torch.Tensor | None, new_tokens: int):
    if lengths is None:
        engine = BuiltinEngine(model, PAD_ID)
        sampling = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=0)
    else:
        engine = BuiltinEngine(model, PAD_ID, logits_processor=_ForcedStopAnyVocab(lengths, model.config.vocab_size))
        sampling = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=0, stop_token_ids=[STOP_ID])

    def run():
        out = engine.generate(prompts, sampling)
        expected = lengths if lengths is not None else torch.full((len(prompts),), new_tokens)
        assert torch.equal(out.response_lengths, expected)

    return run


class _ForcedStopAnyVocab(ForcedStop):
    """generation.py's forced stop for a model of any vocabulary size."""

    def __init__(self, lengths: torch.Tensor, vocab: int):
        super().__init__(lengths)
        self.stop_only = torch.full((vocab,), float("-inf"))
        self.stop_only[STOP_ID] = 0.0


def run_vllm_rows(sizes: list[str], dtypes: list[str], batches: list[int], lengths: str, fixed_tokens: int,
                  rl_tokens: int, repeats: int) -> list[dict]:
    from scalerl.rollout.vllm_engine import VLLMEngine

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            cfg = VLLM_SIZES[size]
            model = build_model(ModelConfig(**{**cfg.__dict__, "torch_dtype": "float32"}), seed=0).eval()
            path = f"{tmp}/{size}"
            save_pretrained(model, path)
            for dtype in dtypes:
                ours = copy.deepcopy(model).to(DTYPES[dtype])
                start = time.perf_counter()
                engine = VLLMEngine(path, PAD_ID, dtype=dtype, kv_cache_gib=1.0,
                                    max_model_len=PROMPT_LEN + max(fixed_tokens, rl_tokens) + 8)
                startup = time.perf_counter() - start
                try:
                    for batch in batches:
                        g = torch.Generator().manual_seed(0)
                        prompts = torch.randint(3, cfg.vocab_size, (batch, PROMPT_LEN), generator=g).tolist()
                        kinds = [k for k in ("fixed", "rl") if lengths in (k, "all")]
                        for kind in kinds:
                            drawn = rl_lengths(batch, rl_tokens) if kind == "rl" else None
                            new = rl_tokens if kind == "rl" else fixed_tokens
                            per_row = drawn.tolist() if drawn is not None else [fixed_tokens] * batch
                            wall, _ = interleaved_medians({"builtin": _builtin_fn(ours, prompts, drawn, new),
                                                           "vllm": _vllm_fn(engine, prompts, per_row)}, repeats)
                            tokens = sum(per_row)
                            row = {"model": size, "dtype": dtype, "batch": batch, "lengths": kind,
                                   "builtin_tokens_per_s": tokens / wall["builtin"],
                                   "vllm_tokens_per_s": tokens / wall["vllm"], "ratio": wall["builtin"] / wall["vllm"],
                                   "vllm_startup_s": startup}
                            rows.append(row)
                            print(f"{size:6s} {dtype} batch {batch:3d} {kind:5s}: built-in {row['builtin_tokens_per_s']:8.0f} "
                                  f"tok/s | vLLM {row['vllm_tokens_per_s']:8.0f} tok/s | vLLM/built-in {row['ratio']:.2f}x "
                                  f"(vLLM start-up {startup:.0f} s)", flush=True)
                finally:
                    engine.close()
            model = ours = None
    return rows


def add_vllm_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vllm-sizes", default="tiny,small,0.5b", help="of " + ",".join(VLLM_SIZES))
    parser.add_argument("--vllm-dtypes", default="fp32,bf16")
    parser.add_argument("--vllm-batches", default="16,64")
    parser.add_argument("--vllm-fixed-tokens", type=int, default=64)
    parser.add_argument("--vllm-rl-tokens", type=int, default=128)


def vllm_rows_from_args(args: argparse.Namespace) -> list[dict]:
    return run_vllm_rows(args.vllm_sizes.split(","), args.vllm_dtypes.split(","),
                         [int(b) for b in args.vllm_batches.split(",")], args.lengths, args.vllm_fixed_tokens,
                         args.vllm_rl_tokens, args.repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", choices=("fixed", "rl", "all"), default="all")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (both engines)")
    parser.add_argument("--json", help="write the rows here")
    add_vllm_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with open("/proc/loadavg") as f:
        print(f"load average before: {f.read().split()[:3]}")
    rows = vllm_rows_from_args(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
