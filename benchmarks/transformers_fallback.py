"""Step time of the transformers fallback against scalerl's own decoder, on the same random Qwen2 checkpoint.

    python benchmarks/transformers_fallback.py [--steps 6] [--rounds 2] [--hidden 128] [--layers 2]

Writes a random Qwen2 directory (the built-in tokenizer's vocabulary, --hidden / --layers, no downloads) and
trains the default GRPO run on it for --steps steps with ``model.implementation=scalerl`` and
``=transformers`` in turn, --rounds times (alternating, so a machine that gets busier mid-run slows both).
Printed per implementation: the median over all rounds of ``timing_s/step``, ``timing_s/gen`` and
``timing_s/update_actor`` (the first step of each run left out: it warms up), tokens per step, and the
fallback's step time as a ratio of scalerl's measured in the same run. Both generate through the built-in
engine and train the same tokens: the difference is the model's forward alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

IMPLEMENTATIONS = ("scalerl", "transformers")
TIMINGS = ("timing_s/step", "timing_s/gen", "timing_s/update_actor")


def _qwen2_directory(path: Path, hidden: int, layers: int) -> Path:
    from scalerl.models.config import ModelConfig
    from scalerl.models.decoder import build_model
    from scalerl.models.hf_checkpoint import save_pretrained
    from scalerl.models.tokenizer import CharTokenizer

    tokenizer = CharTokenizer()
    config = ModelConfig(vocab_size=128, hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    return save_pretrained(build_model(config), path, tokenizer=tokenizer)


def _run(model_dir: Path, implementation: str, steps: int, out: Path) -> list[dict]:
    from scalerl.core.config import load_config
    from scalerl.trainer.rl_trainer import train

    train(load_config(None, [f"model.path={model_dir}", f"model.implementation={implementation}",
                             f"trainer.total_steps={steps}", "trainer.eval_every=0", "data.num_val=0",
                             "trainer.save_every=0", "trainer.logger=[jsonl]", f"trainer.output_dir={out}",
                             "trainer.overwrite=true"]))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["step"] > 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = _qwen2_directory(Path(tmp) / "qwen2", args.hidden, args.layers)
        rows: dict[str, list[dict]] = {name: [] for name in IMPLEMENTATIONS}
        for round_ in range(args.rounds):
            for name in IMPLEMENTATIONS:
                rows[name] += _run(model_dir, name, args.steps, Path(tmp) / f"{name}-{round_}")
    medians = {name: {key: statistics.median(r[key] for r in rows[name]) for key in TIMINGS} for name in IMPLEMENTATIONS}
    for name in IMPLEMENTATIONS:
        tokens = statistics.median(r["perf/total_num_tokens"] for r in rows[name])
        print(f"{name:13s} " + "  ".join(f"{k.removeprefix('timing_s/')} {v:.3f} s" for k, v in medians[name].items())
              + f"  tokens/step {tokens:.0f}")
    ratio = medians["transformers"]["timing_s/step"] / medians["scalerl"]["timing_s/step"]
    print(f"transformers / scalerl step time: {ratio:.2f}x")


if __name__ == "__main__":
    main()
