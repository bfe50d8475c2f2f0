"""Step rules on the training signal: non-finite values and skipped steps, reward collapse."""

from __future__ import annotations

import math
import statistics

from scalerl.health.thresholds import RULES
from scalerl.health.tree import FAULT, NOT_MEASURED, OK, WARNING, Finding
from scalerl.health.view import StepView
from scalerl.health.wording import finding, fix_text

SKIPPED_STEP_METRICS = ("actor/skipped_steps", "critic/skipped_steps", "sft/skipped_steps")


def non_finite(view: StepView) -> list[Finding]:
    bad = sorted(k for k, v in view.metrics.items() if isinstance(v, float) and not math.isfinite(v))
    if bad:
        return [finding("non_finite", FAULT, f"non-finite values: {', '.join(bad[:6])}", {"metrics": bad},
                         fix_text("non_finite"))]
    skipped = {k: view.metrics[k] for k in SKIPPED_STEP_METRICS if view.metrics.get(k, 0) > 0}
    if skipped:
        return [finding("non_finite", WARNING, "optimizer steps skipped for non-finite gradients: " +
                         ", ".join(f"{k}={v:g}" for k, v in skipped.items()), skipped, fix_text("non_finite"))]
    return [finding("non_finite", OK, "every metric finite, no skipped steps")]


def reward_collapse(history: list[dict[str, float]]) -> list[Finding]:
    """``history``: ``critic/score/{mean,max,min}`` of each step so far, oldest first."""
    rule = RULES["reward_collapse"]
    flat_n = int(rule.thresholds["flat_steps"].warning)
    scored = [h for h in history if "critic/score/mean" in h]
    if not scored:
        return [finding("reward_collapse", NOT_MEASURED, "no rewards in these steps (SFT has none)")]
    if len(scored) < flat_n:
        return [finding("reward_collapse", NOT_MEASURED, f"{len(scored)} step(s) with rewards so far; needs "
                         f"{flat_n} (the monitor watches it during training: trainer.monitor_every)")]
    recent = scored[-flat_n:]
    evidence = {"recent_mean": [round(h["critic/score/mean"], 4) for h in recent]}
    if all(h["critic/score/max"] - h["critic/score/min"] <= 1e-9 for h in recent):
        top = max(h["critic/score/max"] for h in scored)
        saturated = recent[-1]["critic/score/max"] >= top and any(h["critic/score/max"] > h["critic/score/min"] for h in scored)
        if saturated:
            fix = "every sample earns the top reward: give it harder prompts (e.g. data.difficulty=[3,4])"
        else:
            fix = ("check data.reward on a few responses (scalerl generate); start from an SFT model "
                   "(trainer.init_from); more diverse samples: rollout.n, rollout.temperature")
        return [finding("reward_collapse", WARNING, f"every sample scored {recent[-1]['critic/score/mean']:g} in the "
                         f"last {flat_n} steps: GRPO advantages are all 0", evidence, fix)]
    window = 3
    means = [h["critic/score/mean"] for h in scored]
    averages = [statistics.mean(means[i:i + window]) for i in range(len(means) - window + 1)]
    best, now = max(averages), averages[-1]
    drop = (best - now) / abs(best) if best else 0.0
    evidence.update(best_window_mean=round(best, 4), window_mean=round(now, 4), drop=round(drop, 3))
    status = rule.thresholds["drop_from_best"].status(drop)
    fix = ("lower actor.lr; add a KL penalty (actor.use_kl_loss=true, actor.kl_loss_coef); resume from a "
           "checkpoint before the drop (trainer.resume=<checkpoint dir>)")
    return [finding("reward_collapse", status, f"mean reward over the last {window} steps {now:.4g}, best "
                     f"{best:.4g} ({drop:.0%} below it)", evidence, fix)]
