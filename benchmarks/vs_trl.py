"""Head-to-head with TRL's GRPOTrainer: the same model, prompts, reward and settings, seconds per step and
tokens per second, each side at its precision, fresh processes, interleaved.

    python benchmarks/vs_trl.py [--models tiny,small,0.5b] [--steps 3] [--repeats 2] \
        [--trl-python /path/to/venv/bin/python] [--scalerl-precision auto] [--trl-precision fp32,bf16]

TRL is an optional dependency of this benchmark only: ``--trl-python`` is an interpreter that imports trl and
scalerl (``python -m venv V && V/bin/pip install torch trl -e .``); without one that imports trl it says so
and stops. Both sides train a random-weight Qwen2-architecture model directory written here (the built-in
character tokenizer, saved as a transformers tokenizer) on the demo's arithmetic prompts with the
exact-answer reward (scalerl's `RewardComputer`, called by TRL as a reward function), GRPO with
``num_generations`` = ``rollout.n``, ``max_completion_length`` = ``rollout.max_new_tokens``, temperature 1,
beta = 0 (no reference model), one PPO epoch, one optimizer step per generation batch (TRL's
``gradient_accumulation_steps`` x ``per_device_train_batch_size`` = the batch's completions, scalerl's
``ppo_mini_batch_size`` = all of them), token-mean loss (TRL's ``loss_type="dapo"``), the same torch threads.

Each (side, precision) cell is one process: one untimed step, then ``--steps`` timed; the table holds the
median over repeats, sides and precisions alternating order per repeat, wall and CPU seconds (the process's,
all threads: on a shared machine others' time on the cores is left out). A side's "best" precision is its
faster one (wall) among those run. Generation time is read from scalerl's ``timing_s/gen`` and, for TRL, by timing
its calls of the model's ``generate``; the rest of the step (log-probs, update, sync) is step - gen.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.precision import write_model

# name -> (model fields, prompts per step, completions per prompt, completions per micro-batch)
MODELS = {
    "tiny": (dict(vocab_size=128, hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2), 16, 8, 64),
    "small": (dict(vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=4), 8, 8, 32),
    "0.5b": (dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2), 2, 4, 4),
}
NEW_TOKENS, LR = 16, 1e-6

SCALERL_SCRIPT = r"""
import json, statistics, sys, tempfile, time
from scalerl.core.config import load_config
from scalerl.trainer.rl_trainer import RLTrainer
s = json.loads(sys.argv[1])
completions = s["prompts"] * s["n"]
cfg = load_config("scalerl/configs/demo.yaml", [
    f"model.path={s['model']}", "model.tokenizer=builtin", f"trainer.precision={s['precision']}",
    f"trainer.batch_size={s['prompts']}", f"rollout.n={s['n']}", f"rollout.max_new_tokens={s['new_tokens']}",
    "rollout.temperature=1.0", f"actor.ppo_mini_batch_size={completions}", f"actor.ppo_micro_batch_size={s['micro']}",
    "actor.ppo_epochs=1", f"actor.lr={s['lr']}", "actor.warmup_steps=0", "actor.loss_agg_mode=token-mean",
    "actor.use_kl_loss=false", "algorithm.adv_estimator=grpo", f"trainer.cpu_threads={s['threads']}",
    "trainer.logger=[]", "data.num_val=0", "trainer.eval_every=0", "trainer.monitor_every=0",
    f"trainer.output_dir={tempfile.mkdtemp()}"])
trainer = RLTrainer.from_config(cfg)
rows = []
for i in range(s["steps"] + 1):
    start, cpu = time.perf_counter(), time.process_time()
    m = trainer.advance()
    if i:
        rows.append({"step": time.perf_counter() - start, "cpu_step": time.process_time() - cpu, "gen": m["timing_s/gen"],
                     "tokens_per_s": m["perf/throughput"], "reward": m["critic/score/mean"]})
print("RESULT " + json.dumps({"precision": trainer.cfg.trainer.precision,
                              **{k: statistics.median(r[k] for r in rows) for k in rows[0]}}))
"""

TRL_SCRIPT = r"""
import json, statistics, sys, tempfile, time
import torch
s = json.loads(sys.argv[1])
torch.set_num_threads(s["threads"])
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer
from scalerl.data.arithmetic import make_arithmetic_rows
from scalerl.data.rewards.computer import RewardComputer

rows = make_arithmetic_rows("train", 9000, [1, 2], 0)
dataset = Dataset.from_list([{"prompt": r["prompt"], "ground_truth": r["ground_truth"]} for r in rows])
scorer = RewardComputer("auto", task="arithmetic")

def exact_answer(completions, ground_truth, **kwargs):
    return scorer.compute(completions, [{"ground_truth": g} for g in ground_truth])[0]

tokenizer = AutoTokenizer.from_pretrained(s["model"])
tokenizer.padding_side = "left"
model = AutoModelForCausalLM.from_pretrained(s["model"], dtype=torch.float32)
completions = s["prompts"] * s["n"]
args = GRPOConfig(
    output_dir=tempfile.mkdtemp(), per_device_train_batch_size=s["micro"],
    gradient_accumulation_steps=completions // s["micro"], num_generations=s["n"],
    max_completion_length=s["new_tokens"], temperature=1.0, top_p=1.0, beta=0.0, num_iterations=1,
    loss_type="dapo", learning_rate=s["lr"], lr_scheduler_type="constant", warmup_steps=0,
    max_steps=s["steps"] + 1, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
    bf16=s["precision"] == "bf16", seed=0, dataloader_num_workers=0, shuffle_dataset=True)

gen_time = [0.0]
original_generate = model.generate
def timed_generate(*a, **k):
    start = time.perf_counter()
    out = original_generate(*a, **k)
    gen_time[0] += time.perf_counter() - start
    return out
model.generate = timed_generate

class StepTimes(TrainerCallback):
    def __init__(self):
        self.rows, self.start, self.tokens = [], None, 0.0
    def on_step_begin(self, args, state, control, **kw):
        self.start, self.cpu, gen_time[0] = time.perf_counter(), time.process_time(), 0.0
    def on_step_end(self, args, state, control, **kw):
        self.rows.append({"step": time.perf_counter() - self.start, "cpu_step": time.process_time() - self.cpu,
                          "gen": gen_time[0]})
    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "num_tokens" in logs and self.rows:
            self.rows[-1]["num_tokens"] = logs["num_tokens"]
            self.rows[-1]["reward"] = logs.get("reward", float("nan"))

times = StepTimes()
trainer = GRPOTrainer(model=model, reward_funcs=exact_answer, args=args, train_dataset=dataset,
                      processing_class=tokenizer, callbacks=[times])
trainer.train()
rows = times.rows
for prev, row in zip(rows, rows[1:]):
    row["tokens_per_s"] = (row["num_tokens"] - prev["num_tokens"]) / row["step"]
timed = rows[1:]
print("RESULT " + json.dumps({"precision": s["precision"],
                              **{k: statistics.median(r[k] for r in timed) for k in ("step", "cpu_step", "gen", "tokens_per_s", "reward")}}))
"""


def trl_missing(python: str) -> str:
    """Why ``python`` cannot run the TRL side ("" when it can)."""
    done = subprocess.run([python, "-c", "import trl, transformers; print(trl.__version__, transformers.__version__)"],
                          capture_output=True, text=True, cwd=ROOT, check=False)
    if done.returncode:
        return (f"{python} cannot import trl ({done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ''}).\n"
                "TRL is an optional dependency of this benchmark only: python -m venv /tmp/trl-venv && "
                "/tmp/trl-venv/bin/pip install torch trl -e . ; then --trl-python /tmp/trl-venv/bin/python")
    print(f"trl {done.stdout.strip()} (trl, transformers) at {python}")
    return ""


def run_cell(python: str, script: str, settings: dict, timeout_s: float) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(settings["threads"]))
    done = subprocess.run([python, "-c", script, json.dumps(settings)], capture_output=True, text=True,
                          timeout=timeout_s, cwd=ROOT, env=env, check=False)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"cell {settings} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="tiny,small,0.5b")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--trl-python", default=sys.executable)
    parser.add_argument("--scalerl-precision", default="auto", help="comma-separated: fp32, bf16, auto")
    parser.add_argument("--trl-precision", default="fp32,bf16", help="comma-separated: fp32, bf16")
    parser.add_argument("--layers-0.5b", dest="layers_05b", type=int, default=24)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    why = trl_missing(args.trl_python)
    if why:
        print(why)
        return 2
    results = {}
    with tempfile.TemporaryDirectory() as workdir:
        for name in args.models.split(","):
            fields, prompts, n, micro = MODELS[name]
            if name == "0.5b":
                fields = dict(fields, num_hidden_layers=args.layers_05b)
            from scalerl.models.tokenizer import CharTokenizer

            model_dir = write_model(fields, Path(workdir) / name)
            CharTokenizer().save_pretrained(model_dir)
            base = dict(model=str(model_dir), prompts=prompts, n=n, micro=micro, new_tokens=NEW_TOKENS, lr=LR,
                        steps=args.steps, threads=args.threads)
            cells = [("scalerl", p) for p in args.scalerl_precision.split(",")] + \
                    [("trl", p) for p in args.trl_precision.split(",")]
            runs: dict[tuple[str, str], list[dict]] = {c: [] for c in cells}
            for repeat in range(args.repeats):
                for side, precision in (cells if repeat % 2 == 0 else cells[::-1]):
                    python, script = (sys.executable, SCALERL_SCRIPT) if side == "scalerl" else (args.trl_python, TRL_SCRIPT)
                    r = run_cell(python, script, dict(base, precision=precision), args.timeout)
                    runs[(side, precision)].append(r)
                    print(f"{name} {side} {precision} (ran {r['precision']}) repeat {repeat}: {r['step']:.3f} s/step "
                          f"({r['cpu_step']:.3f} CPU s), "
                          f"gen {r['gen']:.3f} s, {r['tokens_per_s']:.0f} tokens/s", flush=True)
            row = {f"{s} {p}": {k: statistics.median(r[k] for r in rs)
                                for k in ("step", "cpu_step", "gen", "tokens_per_s", "reward")}
                   | {"ran": rs[0]["precision"]} for (s, p), rs in runs.items()}
            results[name] = row
    print("\nmodel  side     precision  s/step   CPU s   gen s  rest s  tokens/s")
    for name, row in results.items():
        best = {}
        for key, r in row.items():
            side = key.split()[0]
            print(f"{name:6s} {key:18s} {r['step']:7.3f} {r['cpu_step']:7.3f} {r['gen']:7.3f} {r['step'] - r['gen']:7.3f} "
                  f"{r['tokens_per_s']:9.0f}"
                  f"  (ran {r['ran']})")
            if side not in best or r["step"] < best[side][1]["step"]:
                best[side] = (key, r)
        (sk, s), (tk, t) = best["scalerl"], best["trl"]
        print(f"{name:6s} best: {sk} vs {tk}: step time {t['step'] / s['step']:.2f}x (CPU time "
              f"{t['cpu_step'] / s['cpu_step']:.2f}x), tokens/s "
              f"{s['tokens_per_s'] / t['tokens_per_s']:.2f}x; gen {t['gen'] / s['gen']:.2f}x, rest "
              f"{(t['step'] - t['gen']) / (s['step'] - s['gen']):.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results},
                                        indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
