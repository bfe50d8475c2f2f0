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

``--grpo``: one GRPO run per engine on the 0.5B-shaped model (random weights, ``--grpo-layers`` of its 24
layers), each cell ``ENGINE:PRECISION`` of ``--grpo-cells`` a fresh process running the demo's arithmetic
task through scalerl's RL trainer with ``rollout.engine=ENGINE`` (``auto``: what `scalerl.rollout.engines.choice` picks, and
what it said) and ``trainer.precision=PRECISION`` (the update's; vLLM's weights in the same dtype,
``rollout.dtype``; the built-in engine decodes in the trainer's precision, on its fused bf16 path in bf16).
Random weights almost never sample the stop token (1 in 151936), so every response runs to
``--grpo-new-tokens``: RL-like lengths in that they are long next to the prompts (the demo's, about 10
tokens), the worst case of a long-tailed length distribution. One untimed step, then ``--grpo-steps`` timed
ones; per cell the medians of the step (wall) and of the trainer's phases: gen, old_log_prob, update_actor,
update_weights (the sync: the built-in engine re-lays its decode weights, vLLM loads them through its
layerwise reload, checksummed). Cells run in the order given, repeats reverse it (``--grpo-repeats``).
vLLM's start-up is reported apart (not in a step). Ratios are built-in's step over each cell's.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.generation import PAD_ID, PROMPT_LEN, STOP_ID, ForcedStop, interleaved_medians, rl_lengths  # noqa: E402
from scalerl.bench.cost_model.model_shapes import model_shape  # noqa: E402
from scalerl.models.config import ModelConfig  # noqa: E402
from scalerl.models.decoder import build_model  # noqa: E402
from scalerl.models.hf_checkpoint import save_pretrained  # noqa: E402
from scalerl.rollout.engines.builtin import BuiltinEngine  # noqa: E402
from scalerl.rollout.engines.engine import SamplingParams  # noqa: E402

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
    from scalerl.rollout.engines.vllm import VLLMEngine

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


# --grpo: one GRPO run per engine on the 0.5B-shaped model -------------------------------------------------
GRPO_PHASES = ("gen", "old_log_prob", "update_actor", "update_weights")


def grpo_cell_overrides(model_dir: str, engine: str, precision: str, prompts: int, n: int, new_tokens: int,
                        micro: int) -> list[str]:
    """The demo config's overrides for one cell: the 0.5B-shaped model from ``model_dir``, the batch and lengths,
    the engine and precision (vLLM's weights in the trainer's precision)."""
    rows = prompts * n
    return [f"model.path={model_dir}", "model.tokenizer=builtin", "trainer.logger=[]", "data.num_val=0",
            "trainer.eval_every=0", "trainer.monitor_every=0", f"trainer.batch_size={prompts}", f"rollout.n={n}",
            f"rollout.max_new_tokens={new_tokens}", f"actor.ppo_mini_batch_size={rows}",
            f"actor.ppo_micro_batch_size={micro}", f"rollout.engine={engine}", f"trainer.precision={precision}",
            f"rollout.dtype={precision if engine != 'builtin' else 'fp32'}", "rollout.vllm_kv_cache_gib=0.5"]


def grpo_cell(overrides: list[str], steps: int) -> dict:
    """Runs in the cell's own process: one untimed step, then ``steps`` timed ones; medians per phase."""
    from scalerl.core.config import load_config
    from scalerl.trainer.rl_trainer import RLTrainer

    cfg = load_config(str(Path(__file__).resolve().parents[1] / "scalerl/configs/demo.yaml"),
                      [f"trainer.output_dir={tempfile.mkdtemp(prefix='grpo_cell_')}", *overrides])
    start = time.perf_counter()
    trainer = RLTrainer.from_config(cfg)
    startup = time.perf_counter() - start
    rows = []
    for i in range(steps + 1):
        start = time.perf_counter()
        m = trainer.advance()
        if i:  # the first step pays one-time costs (allocations, kernel choice, vLLM's first load)
            rows.append({"step": time.perf_counter() - start,
                         **{p: m.get(f"timing_s/{p}", 0.0) for p in GRPO_PHASES},
                         "response_length": m["response_length/mean"],
                         "logprob_diff_max": m.get("rollout/logprob_diff/max", 0.0)})
    result = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    result["steps"] = [round(r["step"], 2) for r in rows]
    result.update(engine=trainer.cfg.rollout.engine, startup_s=startup, loads=getattr(trainer.engine, "loads", 0))
    trainer.close()
    return result


def run_grpo_rows(cells: list[str], layers: int, prompts: int, n: int, new_tokens: int, micro: int, steps: int,
                  repeats: int, timeout_s: float) -> list[dict]:
    """Each ``ENGINE:PRECISION`` cell in a fresh process, ``repeats`` times (alternate repeats in reverse)."""
    from benchmarks.precision import write_model

    fields = dict(model_shape("qwen2.5-0.5b").__dict__, num_hidden_layers=layers, torch_dtype="float32")
    fields = {k: fields[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                     "num_attention_heads", "num_key_value_heads", "attention_bias",
                                     "tie_word_embeddings", "torch_dtype")}
    results: dict[str, list[dict]] = {c: [] for c in cells}
    with tempfile.TemporaryDirectory() as tmp:
        write_model(fields, Path(tmp) / "model")
        for repeat in range(repeats):
            for cell in (cells if repeat % 2 == 0 else cells[::-1]):
                engine, precision = cell.split(":")
                overrides = grpo_cell_overrides(str(Path(tmp) / "model"), engine, precision, prompts, n, new_tokens,
                                                micro)
                load = os.getloadavg()[0]
                done = subprocess.run([sys.executable, os.path.abspath(__file__), "--grpo-cell", json.dumps(overrides),
                                       "--grpo-steps", str(steps)], capture_output=True, text=True, timeout=timeout_s,
                                      check=False)
                said = next((ln for ln in done.stdout.splitlines() if ln.startswith("rollout.engine=auto")), "")
                result = next((json.loads(ln[7:]) for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
                if result is None:
                    raise RuntimeError(f"cell {cell} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
                result.update(cell=cell, said=said, load_before=load, load_after=os.getloadavg()[0])
                results[cell].append(result)
                print(f"{cell:12s} repeat {repeat}: step {result['step']:7.2f} s | " + " | ".join(
                    f"{p} {result[p]:6.2f}" for p in GRPO_PHASES) + f" | engine {result['engine']} | start-up "
                      f"{result['startup_s']:.0f} s | load {load:.1f}-{result['load_after']:.1f} {said}", flush=True)
    base = next((c for c in cells if c.startswith("builtin:")), cells[0])
    rows = []
    for cell, runs in results.items():
        row = {k: statistics.median(r[k] for r in runs) for k in ("step", *GRPO_PHASES, "startup_s", "response_length",
                                                                   "logprob_diff_max")}
        row.update(cell=cell, engine=runs[0]["engine"], said=runs[0]["said"], runs=runs,
                   speedup_vs_builtin=statistics.median(r["step"] for r in results[base]) / row["step"])
        rows.append(row)
    print(f"\n0.5B-shaped, {layers} of 24 layers, {prompts} prompts x {n} samples, {new_tokens} new tokens; "
          f"median of {repeats} x {steps} steps; speed-up = {base}'s step / the cell's")
    print("cell          engine   step s   " + "  ".join(f"{p:>14s}" for p in GRPO_PHASES) + "  speed-up")
    for row in rows:
        print(f"{row['cell']:12s}  {row['engine']:7s} {row['step']:7.2f}   " + "  ".join(
            f"{row[p]:14.2f}" for p in GRPO_PHASES) + f"  {row['speedup_vs_builtin']:7.2f}x")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", choices=("fixed", "rl", "all"), default="all")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (both engines)")
    parser.add_argument("--json", help="write the rows here")
    add_vllm_arguments(parser)
    parser.add_argument("--grpo", action="store_true", help="one GRPO run per engine instead of the tokens/s rows")
    parser.add_argument("--grpo-cells", default="builtin:bf16,vllm:bf16,auto:bf16",
                        help="ENGINE:PRECISION cells (engine builtin|vllm|auto, precision fp32|bf16)")
    parser.add_argument("--grpo-layers", type=int, default=24, help="decoder layers of the 0.5B shape (24 real)")
    parser.add_argument("--grpo-prompts", type=int, default=2)
    parser.add_argument("--grpo-n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--grpo-new-tokens", type=int, default=128)
    parser.add_argument("--grpo-micro", type=int, default=4, help="actor.ppo_micro_batch_size")
    parser.add_argument("--grpo-steps", type=int, default=2, help="timed steps per cell (after one untimed)")
    parser.add_argument("--grpo-repeats", type=int, default=1)
    parser.add_argument("--grpo-timeout", type=float, default=1200, help="seconds per cell")
    parser.add_argument("--grpo-cell", help=argparse.SUPPRESS)  # internal: run one cell's overrides (JSON)
    args = parser.parse_args()
    if args.grpo_cell:
        print("RESULT " + json.dumps(grpo_cell(json.loads(args.grpo_cell), args.grpo_steps)), flush=True)
        return
    torch.set_num_threads(args.threads)
    with open("/proc/loadavg") as f:
        print(f"load average before: {f.read().split()[:3]}")
    if args.grpo:
        rows = run_grpo_rows(args.grpo_cells.split(","), args.grpo_layers, args.grpo_prompts, args.grpo_n,
                             args.grpo_new_tokens, args.grpo_micro, args.grpo_steps, args.grpo_repeats,
                             args.grpo_timeout)
    else:
        rows = vllm_rows_from_args(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
