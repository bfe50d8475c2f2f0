"""A generative judge as the reward: RL step time with the judge in the trainer's process after generation
(``data.judge.workers=0``) vs in a pool of its own worker processes judging each part while the next part
generates (``data.judge.workers=W``, ``data.judge.parts=P``), side by side in one run.

    OMP_NUM_THREADS=1 python benchmarks/judge_overlap.py [--steps 8] [--workers 1] [--parts 2]

The policy is the built-in model at a small size (hidden 64, 2 layers), trained on the built-in arithmetic
task with GRPO (``--prompts`` 32 prompts x ``--n`` 4 samples a step, ``--max-new-tokens`` 32); the judge is a
random built-in model (``--judge-hidden`` 64, ``--judge-layers`` 2) saved as a model directory, grading each
response with ``--judge-tokens`` 4 greedy tokens (a random judge mostly repeats the response's last character:
a grade where that is a digit, else no verdict, a counted failure that costs the same judge work as a grade).
Each mode's trainer runs one warm-up step, then ``--steps`` steps, the modes' steps interleaved (a change in
the machine's load falls on every mode alike); the script prints the median step time, ``timing_s/gen`` and
``timing_s/reward`` (with the pool, the wait for the verdicts), each mode's speed-up over in-process (ratio of
the medians), and checks that every mode gave the same batch scores (greedy judging: the verdicts do not
depend on where the judge runs). Modes: the judge in process after generation; the pool with the generation
cut into ``--parts`` parts (each judged while the next generates); the pool with one part (the judge in its
worker after generation: what the pool costs without overlap).

On CPU the trainer and the workers share the machine's cores: the pool pays off where there are cores to
spare beyond the trainer's generation (the workers take cpu_count // (workers + 1) threads each).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path


def save_judge(path: Path, hidden: int, layers: int) -> str:
    import torch

    from scalerl.core.config import load_config
    from scalerl.models.decoder import build_model
    from scalerl.models.hf_checkpoint import save_pretrained
    from scalerl.models.load import builtin_model_config
    from scalerl.models.tokenizer import CharTokenizer

    tokenizer = CharTokenizer()
    cfg = load_config(None, [f"model.hidden_size={hidden}", f"model.intermediate_size={2 * hidden}",
                             "model.num_attention_heads=4", "model.num_key_value_heads=2",
                             f"model.num_hidden_layers={layers}"]).model
    model = build_model(builtin_model_config(cfg, tokenizer), seed=3)
    with torch.no_grad():
        model.norm.weight.mul_(8.0)  # a judge that prefers some tokens strongly, as tests/tiny.py's
    return str(save_pretrained(model, path, tokenizer=tokenizer))


def trainer_for(args: argparse.Namespace, judge: str, out: Path, workers: int, parts: int = 1):
    """An RL trainer judging with ``workers`` judge processes (0: in process), and the list its batches go to."""
    from scalerl.core.config import load_config
    from scalerl.trainer.rl_trainer import RLTrainer

    batches: list = []
    cfg = load_config(None, [
        "model.hidden_size=64", "model.intermediate_size=128", "model.num_attention_heads=4",
        "model.num_key_value_heads=2", "model.num_hidden_layers=2", "data.num_train=400", "data.num_val=8",
        f"rollout.n={args.n}", f"rollout.max_new_tokens={args.max_new_tokens}", f"trainer.batch_size={args.prompts}",
        f"actor.ppo_mini_batch_size={args.prompts * args.n}", "actor.ppo_micro_batch_size=16",
        f"trainer.total_steps={args.steps + 1}", "trainer.eval_every=0", "trainer.logger=[jsonl]",
        f"trainer.output_dir={out}", "data.reward=judge", f"data.judge.model={judge}",
        f"data.judge.max_new_tokens={args.judge_tokens}", f"data.judge.batch_size={args.judge_batch}",
        "data.judge.template='Question: {prompt} Grade 0-10 this response: {response}'",
        "data.max_reward_failures=0",  # a random judge: the verdicts' values are not what is measured
        f"data.judge.workers={workers}", f"data.judge.parts={parts}", "data.reward_timeout_s=600",
        f"actor.use_kl_loss={str(args.kl).lower()}",
    ])
    return RLTrainer.from_config(cfg, on_batch=batches.append), batches


def timed_step(trainer) -> tuple[float, float, float]:
    began = time.perf_counter()
    metrics = trainer.train_step()
    return (time.perf_counter() - began, metrics.get("timing_s/gen", float("nan")),
            metrics.get("timing_s/reward", float("nan")))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--parts", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--judge-hidden", type=int, default=64)
    parser.add_argument("--judge-layers", type=int, default=2)
    parser.add_argument("--judge-tokens", type=int, default=4)
    parser.add_argument("--judge-batch", type=int, default=8)
    parser.add_argument("--kl", action=argparse.BooleanOptionalAction, default=False,
                        help="actor.use_kl_loss: a reference log-prob pass each step")
    args = parser.parse_args(argv)
    load = os.getloadavg()[0]
    w = args.workers
    modes = [("judge in process, after generation", {"workers": 0}),
             (f"pool: {w} worker(s), {args.parts} parts", {"workers": w, "parts": args.parts}),
             (f"pool: {w} worker(s), 1 part (no overlap)", {"workers": w, "parts": 1})]
    with tempfile.TemporaryDirectory() as tmp:
        judge = save_judge(Path(tmp) / "judge", args.judge_hidden, args.judge_layers)
        trainers = [trainer_for(args, judge, Path(tmp) / f"mode{i}", **kw) for i, (_, kw) in enumerate(modes)]
        try:
            for trainer, _ in trainers:  # a warm-up step each (allocations, the workers' first calls)
                timed_step(trainer)
            # The modes' steps interleaved, so that a change in the machine's load falls on all of them alike.
            times: list[list[tuple[float, float, float]]] = [[] for _ in modes]
            for _ in range(args.steps):
                for i, (trainer, _) in enumerate(trainers):
                    times[i].append(timed_step(trainer))
        finally:
            for trainer, _ in trainers:
                trainer.close()
    results = [(name, {"step_s": statistics.median(s for s, _, _ in t), "gen_s": statistics.median(g for _, g, _ in t),
                       "reward_s": statistics.median(r for _, _, r in t),
                       "scores": [b.scores.tolist() for b in batches]})
               for (name, _), t, (_, batches) in zip(modes, times, trainers)]
    print(f"{args.prompts} prompts x {args.n} samples x {args.max_new_tokens} tokens a step, KL loss {args.kl}; "
          f"judge hidden {args.judge_hidden} x {args.judge_layers} layers, {args.judge_tokens} tokens a verdict; "
          f"{os.cpu_count()} cores, load {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end")
    base = results[0][1]["step_s"]
    print(f"{'mode':<42} {'step s':>8} {'gen s':>8} {'reward s':>9} {'vs in process':>14}")
    for name, r in results:
        print(f"{name:<42} {r['step_s']:8.2f} {r['gen_s']:8.2f} {r['reward_s']:9.2f} {base / r['step_s']:13.2f}x")
    same = all(r["scores"] == results[0][1]["scores"] for _, r in results)
    print(f"same batch scores in every mode: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
