"""Built-in engine vs Hugging Face `generate` on the same weights, measured side by side in one run.

    python benchmarks/generation.py [--repeats 3] [--threads 1] [--json out.json]

Both sample (temperature 1, top-p 1) 64 new tokens in fp32 with a KV cache and no stop token, so both emit
exactly batch x 64 tokens. Prints tokens/s for each and the ratio (target: >= 2x).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from scalerl.models.config import ModelConfig
from scalerl.models.decoder import build_model
from scalerl.models.hf_checkpoint import save_pretrained
from scalerl.rollout.builtin_engine import BuiltinEngine
from scalerl.rollout.engine import SamplingParams

SIZES = {
    "tiny (2L, h64, V256)": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    "small (4L, h256, V256)": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4),
}
PROMPT_LEN, NEW_TOKENS = 16, 64


def _best_time(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def run(repeats: int, tmp_dir: str) -> list[dict]:
    import transformers

    rows = []
    for name, dims in SIZES.items():
        cfg = ModelConfig(vocab_size=256, **dims)
        ours = build_model(cfg, seed=0).eval()
        path = f"{tmp_dir}/{name.split()[0]}"
        save_pretrained(ours, path)
        hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
        engine = BuiltinEngine(ours, pad_token_id=0)
        for batch in (16, 64):
            prompts = torch.randint(3, 256, (batch, PROMPT_LEN), generator=torch.Generator().manual_seed(0))
            sampling = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, seed=0)

            def ours_fn():
                out = engine.generate(prompts.tolist(), sampling)
                assert out.response_ids.shape == (batch, NEW_TOKENS)

            def hf_fn():
                with torch.inference_mode():
                    out = hf.generate(
                        prompts, attention_mask=torch.ones_like(prompts), do_sample=True, temperature=1.0,
                        top_p=1.0, top_k=0, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                        pad_token_id=0, eos_token_id=None,
                    )
                assert out.shape == (batch, PROMPT_LEN + NEW_TOKENS)

            tokens = batch * NEW_TOKENS
            t_hf = _best_time(hf_fn, repeats)
            t_ours = _best_time(ours_fn, repeats)
            rows.append({
                "model": name, "batch": batch, "hf_tokens_per_s": tokens / t_hf,
                "scalerl_tokens_per_s": tokens / t_ours, "ratio": t_hf / t_ours,
            })
            r = rows[-1]
            print(
                f"{name:24s} batch {batch:3d}: HF {r['hf_tokens_per_s']:9.0f} tok/s | scalerl "
                f"{r['scalerl_tokens_per_s']:9.0f} tok/s | ratio {r['ratio']:.2f}x", flush=True
            )
    return rows


def main() -> None:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads for both engines")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        rows = run(args.repeats, tmp)
    print(f"minimum ratio: {min(r['ratio'] for r in rows):.2f}x (target >= 2x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
