"""Step rules on a MoE model's routing: expert load imbalance (the most loaded expert's tokens over the
mean per expert, ``moe/expert_load_imbalance``) and dropped assignments under a capacity factor
(``moe/dropped_token_fraction``), both already reduced over the data-parallel ranks by the trainer
(`scalerl.models.moe.RouterAuxLoss`).

A router's load moves from step to step, so a warning needs the value above the threshold in each of the
last ``sustained_steps`` steps the monitor remembers (``StepView.history``); a single step (a profile, or
the first steps of a run) is judged on its own value.
"""

from __future__ import annotations

from scalerl.health.thresholds import RULES
from scalerl.health.tree import OK, Finding, StepView
from scalerl.health.wording import finding, fix_text

IMBALANCE = "moe/expert_load_imbalance"
DROPPED = "moe/dropped_tokens"
DROPPED_FRACTION = "moe/dropped_token_fraction"


def _recent(view: StepView, key: str, steps: int) -> list[float]:
    """``key`` over the last ``steps`` steps, this one included (fewer when the history is shorter)."""
    past = [h[key] for h in view.history if key in h]
    if not past or past[-1] != view.metrics[key]:  # the monitor's history may or may not hold this step yet
        past.append(view.metrics[key])
    return past[-steps:]


def expert_load(view: StepView) -> list[Finding]:
    if IMBALANCE not in view.metrics:
        return [finding("expert_load_imbalance", OK, f"no experts to balance (no {IMBALANCE} in the step metrics: "
                         "a dense model)")]
    out = [_imbalance(view)]
    if DROPPED_FRACTION in view.metrics:
        out.append(_dropped(view))
    return out


def _imbalance(view: StepView) -> Finding:
    rule = RULES["expert_load_imbalance"]
    threshold = rule.thresholds["max_over_mean"]
    steps = int(rule.thresholds["sustained_steps"].warning)
    recent = _recent(view, IMBALANCE, steps)
    sustained = min(recent)  # what held in every one of these steps
    status = threshold.status(sustained)
    now = view.metrics[IMBALANCE]
    evidence = {"max_over_mean": round(now, 3), "recent": [round(v, 3) for v in recent],
                "lowest_recent": round(sustained, 3), "warning_above": threshold.warning}
    if "moe/aux_loss" in view.metrics:
        evidence["moe/aux_loss"] = round(view.metrics["moe/aux_loss"], 4)
    over = f"in each of the last {len(recent)} steps (at least {sustained:.2f}x)" if len(recent) > 1 else "this step"
    ep = int(view.context.get("ep", 1))
    return finding("expert_load_imbalance", status, f"the most loaded expert takes {now:.2f}x the mean tokens per "
                   f"expert (worst layer), above {threshold.warning:g}x {over}" if status != OK else
                   f"the most loaded expert takes {now:.2f}x the mean tokens per expert (worst layer)", evidence,
                   fix_text("expert_load_imbalance", capacity=_capacity_hint(view),
                            per_rank=f" (now parallel.ep={ep})" if ep > 1 else ""))


def _dropped(view: StepView) -> Finding:
    rule = RULES["dropped_tokens"]
    threshold = rule.thresholds["fraction"]
    fraction = view.metrics[DROPPED_FRACTION]
    status = threshold.status(fraction)
    dropped = view.metrics.get(DROPPED, 0.0)
    factor = view.context.get("moe_capacity_factor")
    evidence = {"dropped_assignments": dropped, "fraction": round(fraction, 4)}
    if factor:
        evidence["moe_capacity_factor"] = factor
    return finding("dropped_tokens", status, f"the capacity factor{f' {factor:g}' if factor else ''} dropped "
                   f"{dropped:.0f} token-to-expert assignments this step ({fraction:.1%} of them): those tokens "
                   "skip that expert", evidence,
                   fix_text("dropped_tokens", now=f" (now {factor:g})" if factor else ""))


def _capacity_hint(view: StepView) -> str:
    factor = view.context.get("moe_capacity_factor")
    return f"model.moe_capacity_factor is {factor:g}: drops bound it already" if factor else \
        "set model.moe_capacity_factor (e.g. 1.25) to bound the most loaded expert's work"
