"""Synchronous vs asynchronous RL with standalone rollout workers: step time (samples/s) and, on the demo,
the reward / held-out accuracy curve, same seed.

    python benchmarks/async_rl.py [--steps 120] [--sft-steps 1000] [--batch-size 64] [--json FILE]
    python benchmarks/async_rl.py --setting long [--staleness 0 1 2 4] [--workers 1 2] [--seeds 0 1 2] [--partial]
        [--stream-groups] [--rollout-dtype bf16]

``--setting long`` is generation-heavy: the demo's model untrained (no SFT), so responses run until the stop
character comes up at random or ``--max-new-tokens`` (256), ``--prompts`` (4) prompts x 8 samples per step.
Its reward is 0 everywhere (an untrained model never answers), so advantages are 0 and the weights never
change: every mode generates the same lengths from the same weights and the comparison is of the pipeline
alone, while the update still runs its full forward and backward. The push is dense
(``weight_sync.mode=full``), what a sync of weights that did change costs here. It prints, per worker count,
samples/s and each staleness's ratio over synchronous (the median step over steps 3 onwards; the median over
seeds of each), with the trainer's and the workers' idle time and the weight push's exposed and own time.
``--partial`` also runs every staleness >= 1 with ``rollout.partial=true`` (streaming workers: continuous
batching over every request in flight, pushes landing mid-response), right after the same seed's in-order run,
and adds the share of responses that span versions.

The demo's configuration (built-in model and task): an SFT warm start on the weak teacher's data (cached in
outputs/bench_async_rl/sft), then GRPO with one trainer rank and one rollout worker rank (world 2, gloo on
loopback, one thread each), `rollout.staleness=0` and `=1`. Each run reports the median step time (after
the first two steps), the final held-out accuracy and the score curve. The ratio printed is the
synchronous median step time over the asynchronous one (target >= 1.3x where generation and update take
similar time). `--rollout-dtype bf16` runs the worker in bf16, as deployments do; its log-probs are then
recomputed by the trainer in both modes. `--stale-logprobs behavior` makes the asynchronous run take PPO's
ratio against the rollout's own fp32 log-probs (`rollout.stale_logprobs`), skipping the recompute.
`--batch-size` sets the prompts per step (the demo's 64). In the long setting `--rollout-dtype bf16` gives every
mode an old-log-prob pass (bf16 workers' log-probs are recomputed), and `--stream-groups` runs each mode over
two or more workers once more with ``rollout.stream_groups=true`` and prints what streaming changed;
`--no-shuffle --mini-batch-size M` (M below the step's rows) lets the update's first mini-batches start too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.spawned_group import run_in_group  # noqa: E402

OUT = ROOT / "outputs" / "bench_async_rl"


def _demo_config(extra: list[str]):
    from scalerl.core.config import load_config

    return load_config(ROOT / "scalerl" / "configs" / "demo.yaml", ["trainer.logger=[jsonl]", *extra])


def warm_start(sft_steps: int) -> Path:
    """The demo's SFT phase on the weak teacher's demonstrations (reused when already there)."""
    model = OUT / f"sft{sft_steps}" / "model"
    if (model / "model.safetensors").is_file():
        return model
    from scalerl.demo import write_teacher_demonstrations
    from scalerl.trainer.sft_trainer import train_sft

    cfg = _demo_config([f"sft.steps={sft_steps}", f"trainer.output_dir={OUT}", f"sft.output_dir={model.parent}"])
    cfg.data.train_files = [str(write_teacher_demonstrations(cfg, OUT / "teacher.jsonl", 0))]
    return Path(train_sft(cfg)["model_dir"])


LONG = ["weight_sync.mode=full", "trainer.eval_every=0", "data.num_val=8"]


def digit_share(response: str, ground_truth: str) -> float:
    """The long setting's learnable reward (``--reward digits``): the share of the response's characters that
    are digits. An untrained model earns it from the start (about 10 of its 99 tokens are digits), so GRPO has
    a signal from step 1 while the responses stay long (the stop character still comes at random)."""
    return sum(c.isdigit() for c in response) / max(len(response), 1)


def _reward_overrides(reward: str, eval_every: int, lr: float | None) -> list[str]:
    if reward == "none":
        return []
    return [f"data.reward={Path(__file__).resolve()}:digit_share", f"trainer.eval_every={eval_every}",
            "data.num_val=32", *([f"actor.lr={lr}"] if lr else [])]


def _long_batch(prompts: int, batching: tuple[int | None, int | None, bool] = (None, None, True)) -> list[str]:
    """``prompts`` prompts x rollout.n samples per step; ``batching`` is (micro-batch rows, mini-batch rows,
    actor.shuffle): None rows mean the whole step's in one."""
    samples = prompts * _demo_config([]).rollout.n
    micro, mini, shuffle = batching
    return [f"trainer.batch_size={prompts}", f"actor.ppo_mini_batch_size={mini or samples}",
            f"actor.ppo_micro_batch_size={micro or mini or samples}", f"actor.shuffle={str(shuffle).lower()}"]


def _long(rank: int, steps: int, staleness: int, workers: int, seed: int, max_new_tokens: int,
          background: bool = True, stale_logprobs: str = "recompute", partial: bool = False, stream: bool = False,
          rollout_dtype: str = "fp32", batching: tuple[int | None, int | None, bool] = (None, None, True),
          prompts: int = 4,
          learning: tuple[str, int, float | None] = ("none", 10, None)) -> None:
    from scalerl.trainer.rl_trainer import train

    train(_demo_config([*LONG, *_reward_overrides(*learning), *_long_batch(prompts, batching),
                        f"trainer.total_steps={steps}",
                        f"trainer.seed={seed}", "trainer.overwrite=true",
                        f"rollout.max_new_tokens={max_new_tokens}", "rollout.placement=standalone",
                        f"rollout.workers={workers}", f"rollout.staleness={staleness}",
                        f"weight_sync.background={str(background).lower()}",
                        *([f"rollout.stale_logprobs={stale_logprobs}"] if staleness else []),
                        f"rollout.partial={str(partial).lower()}", f"rollout.stream_groups={str(stream).lower()}",
                        f"rollout.dtype={rollout_dtype}",
                        "trainer.output_dir=" + str(_long_dir(staleness, workers, seed, background, stale_logprobs,
                                                              partial, stream, rollout_dtype, prompts,
                                                              learning[0]))]))


def _long_dir(staleness: int, workers: int, seed: int, background: bool = True, stale_logprobs: str = "recompute",
              partial: bool = False, stream: bool = False, rollout_dtype: str = "fp32", prompts: int = 4,
              reward: str = "none") -> Path:
    suffix = ("" if background else "-inline-push") + ("-behavior" if staleness and stale_logprobs == "behavior" else "")
    suffix += ("-partial" if partial else "") + ("-stream" if stream else "")
    suffix += ("" if rollout_dtype == "fp32" else f"-{rollout_dtype}") + (f"-prompts{prompts}" if prompts != 4 else "")
    suffix += "" if reward == "none" else f"-{reward}"
    return OUT / "long" / f"workers{workers}-staleness{staleness}-seed{seed}{suffix}"


def summarize_long(run: Path) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0][2:]
    median = {k: statistics.median(r[k] for r in steps) for k in (
        "timing_s/step", "timing_s/trainer_idle", "timing_s/rollout_idle", "timing_s/update_actor",
        "timing_s/old_log_prob", "timing_s/weight_sync_exposed", "weight_sync/push_s", "response_length/mean")}
    for key in ("timing_s/stream_overlap", "perf/stream_early_mini_batches"):
        median[key] = statistics.median(r.get(key, 0.0) for r in steps)
    scores = [(r["step"], r["val/score/mean"]) for r in rows if "val/score/mean" in r]
    return {"median": median, "staleness_max": max(r["rollout/staleness/max"] for r in steps), "val_scores": scores,
            "partial_fraction": statistics.mean(r.get("rollout/partial_fraction", 0.0) for r in steps)}


def main_long(args) -> None:
    n = _demo_config([]).rollout.n
    sequences = args.prompts * n
    table: dict[tuple[int, int, bool, bool], list[dict]] = {}
    learning = (args.reward, args.eval_every, args.lr)
    batching = (args.micro_batch_size, args.mini_batch_size, not args.no_shuffle)
    modes = [(s, False) for s in args.staleness]
    if args.partial:
        modes = [m for s in args.staleness for m in ([(s, False), (s, True)] if s else [(s, False)])]
    # --stream-groups: each mode also with rollout.stream_groups=true (two workers or more), right after it
    streams = [False, True] if args.stream_groups else [False]
    for workers in args.workers:
        for seed in args.seeds:  # every mode of a seed back to back: a shared machine's load drifts slowly
            for staleness, partial in modes:
                for stream in streams if workers > 1 else [False]:
                    run_in_group(_long, 1 + workers, args.steps, staleness, workers, seed, args.max_new_tokens, True,
                                 args.stale_logprobs, partial, stream, args.rollout_dtype, batching,
                                 args.prompts, learning, timeout_s=3600)
                    table.setdefault((workers, staleness, partial, stream), []).append(summarize_long(_long_dir(
                        staleness, workers, seed, True, args.stale_logprobs, partial, stream, args.rollout_dtype,
                        args.prompts, args.reward)))
    results = {}
    for (workers, staleness, partial, stream), runs in table.items():
        med = {k: statistics.median(r["median"][k] for r in runs) for k in runs[0]["median"]}
        steps = [r["median"]["timing_s/step"] for r in runs]
        base = [r["median"]["timing_s/step"] for r in table.get((workers, 0, False, False), [])]
        ratios = [b / s for b, s in zip(base, steps)]  # per seed: synchronous step over this one, same block
        unstreamed = [r["median"]["timing_s/step"] for r in table.get((workers, staleness, partial, False), [])]
        results[f"workers={workers},staleness={staleness},partial={partial}" + (",stream=True" if stream else "")] = {
            "stream_ratio_per_seed": [b / s for b, s in zip(unstreamed, steps)],
            **med, "samples_per_s": sequences / med["timing_s/step"], "step_s_per_seed": steps,
            "ratio_per_seed": ratios, "staleness_max": max(r["staleness_max"] for r in runs),
            "partial_fraction": statistics.mean(r["partial_fraction"] for r in runs),
            "val_scores_per_seed": [r["val_scores"] for r in runs]}
    print(f"{sequences} samples per step, {args.steps} steps, seeds {args.seeds}, rollout.stale_logprobs="
          f"{args.stale_logprobs} when stale; medians over steps 3+ and seeds")
    print("| workers | staleness | partial | step | samples/s | trainer idle | rollout idle | update | old log-probs | "
          "push exposed | push own | responses spanning versions | vs sync, per seed (median) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for workers in args.workers:
        for staleness, partial in modes:
            r = results[f"workers={workers},staleness={staleness},partial={partial}"]
            ratios = r["ratio_per_seed"]
            ratio = (f"{', '.join(f'{x:.2f}' for x in ratios)} ({statistics.median(ratios):.2f}x)" if ratios
                     else "-")
            print(f"| {workers} | {staleness} | {'yes' if partial else 'no'} | {r['timing_s/step']:.3f} s | "
                  f"{r['samples_per_s']:.1f} | {r['timing_s/trainer_idle']:.3f} s | {r['timing_s/rollout_idle']:.3f} s | "
                  f"{r['timing_s/update_actor']:.3f} s | {r['timing_s/old_log_prob']:.3f} s | "
                  f"{r['timing_s/weight_sync_exposed']:.3f} s | {r['weight_sync/push_s']:.3f} s | "
                  f"{r['partial_fraction']:.0%} | {ratio} |")
    if args.reward != "none":  # the held-out score curve of each mode, per seed (greedy, data.num_val=32)
        print(f"held-out {args.reward} reward (greedy), per seed: step: score ...")
        for workers in args.workers:
            for staleness, partial in modes:
                r = results[f"workers={workers},staleness={staleness},partial={partial}"]
                curves = ["  ".join(f"{step}: {score:.3f}" for step, score in seed_scores)
                          for seed_scores in r["val_scores_per_seed"]]
                finals = [seed_scores[-1][1] for seed_scores in r["val_scores_per_seed"] if seed_scores]
                print(f"workers {workers}, staleness {staleness}, partial {'yes' if partial else 'no'}: final "
                      f"{', '.join(f'{x:.3f}' for x in finals)} (mean {statistics.mean(finals):.3f}) | "
                      + " / ".join(curves))
    if args.stream_groups:  # the same modes with the trainer working on each worker's part as it arrives
        print("| workers | staleness | partial | stream_groups | step | trainer idle | old log-probs | update | "
              "trainer work before the last part | optimizer steps before it | unstreamed step over streamed, "
              "per seed (median) |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for workers in (w for w in args.workers if w > 1):
            for staleness, partial in modes:
                for stream in streams:
                    key = f"workers={workers},staleness={staleness},partial={partial}"
                    key += ",stream=True" if stream else ""
                    r, ratios = results[key], results[key]["stream_ratio_per_seed"]
                    print(f"| {workers} | {staleness} | {'yes' if partial else 'no'} | {'on' if stream else 'off'} | "
                          f"{r['timing_s/step']:.3f} s | {r['timing_s/trainer_idle']:.3f} s | "
                          f"{r['timing_s/old_log_prob']:.3f} s | {r['timing_s/update_actor']:.3f} s | "
                          f"{r['timing_s/stream_overlap']:.3f} s | {r['perf/stream_early_mini_batches']:g} | "
                          + (f"{', '.join(f'{x:.2f}' for x in ratios)} ({statistics.median(ratios):.2f}x) |"
                             if stream else "- |"))
    if args.inline_push:  # the same staleness with the push in the step: what the background push saves
        print("| workers | staleness | push | step | push exposed | push own |")
        print("| --- | --- | --- | --- | --- | --- |")
        for workers in args.workers:
            for staleness in (s for s in args.staleness if s > 0):
                for background in (False, True):
                    if not background:
                        run_in_group(_long, 1 + workers, args.steps, staleness, workers, args.seeds[0],
                                     args.max_new_tokens, False, args.stale_logprobs, False, False,
                                     args.rollout_dtype, batching, args.prompts, learning,
                                     timeout_s=3600)
                    m = summarize_long(_long_dir(staleness, workers, args.seeds[0], background, args.stale_logprobs,
                                                 False, False, args.rollout_dtype, args.prompts,
                                                 args.reward))["median"]
                    results[f"workers={workers},staleness={staleness},background={background}"] = m
                    print(f"| {workers} | {staleness} | {'background' if background else 'in the step'} | "
                          f"{m['timing_s/step']:.3f} s | {m['timing_s/weight_sync_exposed']:.3f} s | "
                          f"{m['weight_sync/push_s']:.3f} s |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


def _grpo(rank: int, sft_model: str, steps: int, staleness: int, batch_size: int, rollout_dtype: str,
          stale_logprobs: str, sync_mode: str) -> None:
    from scalerl.trainer.rl_trainer import train

    cfg = _demo_config([])
    sequences = batch_size * cfg.rollout.n
    mini = min(cfg.actor.ppo_mini_batch_size, sequences)
    train(_demo_config([
        f"trainer.init_from={sft_model}", f"trainer.total_steps={steps}", "trainer.eval_every=10",
        "rollout.placement=standalone", f"rollout.staleness={staleness}", "trainer.overwrite=true",
        f"trainer.batch_size={batch_size}", f"actor.ppo_mini_batch_size={mini}",
        f"actor.ppo_micro_batch_size={min(cfg.actor.ppo_micro_batch_size, mini)}",
        f"rollout.dtype={rollout_dtype}",
        f"weight_sync.mode={sync_mode}",
        f"trainer.output_dir={_run_dir(staleness, batch_size, rollout_dtype, stale_logprobs, sync_mode)}",
        *([f"rollout.stale_logprobs={stale_logprobs}"] if staleness else []),
    ]))


def _run_dir(staleness: int, batch_size: int, rollout_dtype: str, stale_logprobs: str, sync_mode: str) -> Path:
    suffix = f"-{stale_logprobs}" if staleness and stale_logprobs != "recompute" else ""
    suffix += "" if sync_mode == "delta" else f"-{sync_mode}"
    return OUT / f"batch{batch_size}-{rollout_dtype}" / f"staleness{staleness}{suffix}"


def summarize(run: Path) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    times = [r["timing_s/step"] for r in steps[2:]]
    return {
        "median_step_s": statistics.median(times),
        "final_accuracy": next(r["val/accuracy"] for r in reversed(rows) if "val/accuracy" in r),
        "initial_accuracy": rows[0].get("val/accuracy"),
        "score_curve": [round(r["critic/score/mean"], 4) for r in steps],
        "median_gen_s": statistics.median(r["timing_s/gen"] for r in steps[2:]),
        "median_update_s": statistics.median(r["timing_s/update_actor"] for r in steps[2:]),
        "median_old_log_prob_s": statistics.median(r["timing_s/old_log_prob"] for r in steps[2:]),
        "median_update_weights_s": statistics.median(r["timing_s/update_weights"] for r in steps[2:]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps per run (demo: the demo's 120; "
                        "long: 12)")
    parser.add_argument("--sft-steps", type=int, default=1000, help="SFT warm-start steps (the demo's 1000)")
    parser.add_argument("--batch-size", type=int, default=64, help="prompts per step (the demo's 64)")
    parser.add_argument("--rollout-dtype", default="fp32", choices=("fp32", "bf16"),
                        help="the rollout worker's weights (bf16: as deployments run them; its log-probs are then "
                             "recomputed in both modes)")
    parser.add_argument("--stale-logprobs", default="recompute", choices=("recompute", "behavior"),
                        help="the asynchronous run's rollout.stale_logprobs (behavior: PPO's ratio against the "
                             "rollout's own fp32 log-probs, no recompute)")
    parser.add_argument("--weight-sync", default="delta", choices=("delta", "full", "auto"),
                        help="weight_sync.mode of both runs (full: dense pushes, cheaper in time than encoding "
                             "deltas when the worker is on the same host)")
    parser.add_argument("--setting", default="demo", choices=("demo", "long"),
                        help="demo: the demo's SFT warm start, synchronous vs one-step; long: generation-heavy")
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2, 4], help="long: rollout.staleness values")
    parser.add_argument("--workers", type=int, nargs="+", default=[1], help="long: rollout.workers values")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="long: trainer.seed values")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="long: rollout.max_new_tokens")
    parser.add_argument("--prompts", type=int, default=4,
                        help="long: prompts per step (trainer.batch_size; x rollout.n samples, one mini-batch). "
                             "Fewer make generation the longer side: its time follows the longest response, "
                             "the update's the number of tokens")
    parser.add_argument("--reward", default="none", choices=("none", "digits"),
                        help="long: none (reward 0, the weights never change: the pipeline alone) or digits (the "
                             "share of digits in a response, which the untrained model can learn: held-out score "
                             "curves per mode and seed)")
    parser.add_argument("--eval-every", type=int, default=None,
                        help="long, --reward digits: trainer.eval_every (10 if unset)")
    parser.add_argument("--lr", type=float, default=None, help="long, --reward digits: actor.lr (the demo's if unset)")
    parser.add_argument("--partial", action="store_true",
                        help="long: also run each staleness >= 1 with rollout.partial=true (streaming workers)")
    parser.add_argument("--stream-groups", action="store_true",
                        help="long, workers >= 2: also run each mode with rollout.stream_groups=true (the trainer "
                             "scores each worker's part and runs its log-prob passes as it arrives), right after it")
    parser.add_argument("--micro-batch-size", type=int, default=None,
                        help="long: actor.ppo_micro_batch_size (default: the whole step's rows in one micro-batch, "
                             "which rollout.stream_groups can only run once every part is in)")
    parser.add_argument("--mini-batch-size", type=int, default=None,
                        help="long: actor.ppo_mini_batch_size (default: the whole step's rows, one optimizer step)")
    parser.add_argument("--no-shuffle", action="store_true",
                        help="long: actor.shuffle=false (mini-batches in row order: with --stream-groups and a "
                             "--mini-batch-size below the step's rows the update's first mini-batches start as "
                             "their groups arrive)")
    parser.add_argument("--inline-push", action="store_true",
                        help="long: also run each staleness >= 1 with weight_sync.background=false (first seed), "
                             "and print the push's exposed time both ways")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    if args.reward == "none" and (args.eval_every is not None or args.lr is not None):
        parser.error("--eval-every and --lr set the learning run of --reward digits; with --reward none the "
                     "weights never change: add --reward digits or drop them")
    args.eval_every = args.eval_every or 10
    if args.setting == "long":
        args.steps = args.steps or 12
        main_long(args)
        return
    args.steps = args.steps or 120
    sft_model = warm_start(args.sft_steps)
    results = {}
    for staleness in (0, 1):
        run_in_group(_grpo, 2, str(sft_model), args.steps, staleness, args.batch_size, args.rollout_dtype,
                     args.stale_logprobs, args.weight_sync, timeout_s=3600)
        results[f"staleness={staleness}"] = summarize(_run_dir(staleness, args.batch_size, args.rollout_dtype,
                                                                   args.stale_logprobs, args.weight_sync))
    for name, r in results.items():
        print(f"{name}: median step {r['median_step_s']:.3f} s (gen {r['median_gen_s']:.3f} s, old log-probs "
              f"{r['median_old_log_prob_s']:.3f} s, update {r['median_update_s']:.3f} s, weight sync "
              f"{r['median_update_weights_s']:.3f} s), held-out accuracy {r['initial_accuracy']:.3f} -> "
              f"{r['final_accuracy']:.3f}")
    ratio = results["staleness=0"]["median_step_s"] / results["staleness=1"]["median_step_s"]
    print(f"step time, synchronous / one-step asynchronous: {ratio:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
