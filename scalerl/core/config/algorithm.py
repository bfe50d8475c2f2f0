"""The `algorithm` section: the advantage estimator, KL in the reward (`algorithm.kl_ctrl`), DAPO's overlong
buffer and dynamic sampling (`algorithm.overlong_buffer`, `algorithm.filter_groups`), on-policy distillation
(`algorithm.distill`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from scalerl.core.algorithm_names import (
    ADVANTAGE_ESTIMATOR_NAMES,
    choices_help,
    needs_critic,
    needs_greedy_baseline,
    needs_groups,
    not_trainable_reason,
)
from scalerl.core.config.actor import KL_LOSS_TYPES
from scalerl.core.config.tree import Section, _check, _check_choice, opt

KL_CONTROLLER_TYPES = ("fixed", "adaptive")  # scalerl.algorithms.kl_reward's (core sits below algorithms)
ADV_ESTIMATORS = tuple(ADVANTAGE_ESTIMATOR_NAMES)  # verl's names (`scalerl.core.algorithm_names`)


def _estimator_help() -> str:
    """`algorithm.adv_estimator`'s help: every name with its line and what it needs beyond the rollouts."""
    rows = {}
    for name, entry in ADVANTAGE_ESTIMATOR_NAMES.items():
        needs = ("trains a critic" if needs_critic(name) else
                 "one greedy response per prompt as the baseline" if needs_greedy_baseline(name) else
                 "" if needs_groups(name) else "no groups: rollout.n may be 1")
        rows[name] = entry.description + (f" [{needs}]" if needs else "")
    return ("advantage estimator by verl's name (docs/algorithms-formulas.md); unless marked, it compares the "
            "rollout.n >= 2 samples of each prompt:" + choices_help(rows))


FILTER_GROUPS_METRICS = ("score",)  # per-sample values dynamic sampling can test for zero variance


@dataclass
class FilterGroupsSection(Section):
    """DAPO's dynamic sampling (verl's algorithm.filter_groups): drop the prompt groups whose metric has zero
    variance and draw more prompts until the batch is full (docs/algorithms.md, Dynamic sampling)."""

    name = "algorithm.filter_groups"
    enable: bool = opt(False, "drop groups whose samples all share one metric value (their GRPO advantages are 0) "
                              "and generate further batches until trainer.batch_size groups remain")
    metric: str = opt("score", "the per-sample value tested: " + " | ".join(FILTER_GROUPS_METRICS)
                               + " (the reward before any shaping)")
    max_num_gen_batches: int = opt(10, "most generation rounds per step; once reached the step trains on the groups "
                                       "kept so far (filter/batch_full=0); 0 = no limit")

    def problems(self) -> list[str]:
        p: list[str] = []
        _check_choice(p, "algorithm.filter_groups.metric", self.metric, FILTER_GROUPS_METRICS)
        _check(p, self.max_num_gen_batches >= 0, "algorithm.filter_groups.max_num_gen_batches", ">= 0 (0 = no limit)",
               self.max_num_gen_batches)
        return p


@dataclass
class OverlongBufferSection(Section):
    """DAPO's soft overlong punishment (verl's reward_model.overlong_buffer): 0 up to rollout.max_new_tokens - len
    response tokens, then linearly down to -penalty_factor at rollout.max_new_tokens, added to the score."""

    name = "algorithm.overlong_buffer"
    enable: bool = opt(False, "add the overlong penalty to every score (reward/overlong_penalty/mean)")
    len: int = opt(0, "the buffer: the last len tokens before rollout.max_new_tokens are penalised", at_least=0)
    penalty_factor: float = opt(1.0, "the penalty at rollout.max_new_tokens tokens", at_least=0)


@dataclass
class DistillSection(Section):
    """On-policy distillation (docs/algorithms.md, On-policy distillation): a teacher scores the student's own
    sampled tokens and each token's advantage is ``-coef * k(student, teacher)`` (with k1: ``coef * (log p_teacher -
    log p_student)``, the negative reverse KL on that token), added to ``task_weight`` times the task reward's
    advantage."""

    name = "algorithm.distill"
    teacher: str | None = opt(None, "the teacher's model directory (same tokenizer as the student); null = off")
    coef: float = opt(1.0, "weight of the per-token distillation advantage", above=0)
    task_weight: float = opt(0.0, "weight of algorithm.adv_estimator's advantage from the task reward "
                                  "(0 = distillation alone; the reward is still scored and logged)", at_least=0)
    estimator: str = opt("k1", "the per-token KL estimate whose negative is the advantage: " + " | ".join(KL_LOSS_TYPES)
                         + " (k1: teacher log-prob - student log-prob; verl's distillation_loss.loss_mode)")
    max_clamp: float | None = opt(None, "clamp each token's estimate to [-max_clamp, max_clamp] (verl's "
                                        "loss_max_clamp); null = none")
    top_k: int = opt(0, "k > 0: train on verl's forward_kl_topk, the forward KL over the teacher's k likeliest tokens "
                        "per position, as a loss term (estimator unused); 0 = the sampled tokens' reverse KL",
                     at_least=0)
    teachers: dict[str, str] = opt(help="a teacher per data source, {data_source: model directory} (one model per "
                                        "directory; rows of another source get no distillation term); instead of "
                                        "algorithm.distill.teacher", factory=dict)

    def problems(self) -> list[str]:
        p: list[str] = []
        _check_choice(p, "algorithm.distill.estimator", self.estimator, KL_LOSS_TYPES)
        if self.teacher is not None and self.teachers:
            p.append("algorithm.distill.teacher and algorithm.distill.teachers are both set: give one teacher for "
                     "every row (teacher) or one per data source (teachers), not both")
        for source, path in self.teachers.items():
            if not isinstance(path, str) or not path.strip():
                p.append(f"algorithm.distill.teachers.{source} must be a model directory, got {path!r}: write "
                         "teachers as {data_source: directory}")
        if self.max_clamp is not None and not self.max_clamp > 0:
            p.append(f"algorithm.distill.max_clamp must be > 0 or null, got {self.max_clamp}")
        if self.teacher is not None and not str(self.teacher).strip():
            p.append("algorithm.distill.teacher is empty: give the teacher's model directory, or null for no "
                     "distillation")
        return p


@dataclass
class KLControlSection(Section):
    """The coefficient beta of KL in the reward (verl's algorithm.kl_ctrl), read with algorithm.use_kl_in_reward."""

    name = "algorithm.kl_ctrl"
    type: str = opt("fixed", "fixed (beta = kl_coef) | adaptive (beta moves to keep the KL at target_kl)")
    kl_coef: float = opt(0.001, "beta (adaptive: its initial value)", at_least=0)
    target_kl: float = opt(0.1, "adaptive: the KL beta steers toward", above=0)
    horizon: int = opt(10000, "adaptive: sequences over which beta moves by up to 20%", at_least=1)

    def problems(self) -> list[str]:
        p: list[str] = []
        _check_choice(p, "algorithm.kl_ctrl.type", self.type, KL_CONTROLLER_TYPES)
        return p


@dataclass
class AlgorithmSection(Section):
    name = "algorithm"
    adv_estimator: str = opt("grpo", _estimator_help())
    norm_adv_by_std_in_grpo: bool = opt(True, "GRPO: divide by the group's reward std (false = Dr. GRPO)")
    gamma: float = opt(1.0, "discount: gae, reinforce_plus_plus", at_least=0, at_most=1)
    lam: float = opt(1.0, "GAE lambda", at_least=0, at_most=1)
    # Reward shaping (scalerl/trainer/reward_shaping.py; verl's names, docs/algorithms.md#reward-shaping)
    use_kl_in_reward: bool = opt(False, "subtract beta * KL(policy || reference) from the token rewards (builds the "
                                 "reference model; beta from algorithm.kl_ctrl)")
    kl_penalty: str = opt("kl", "the KL estimate in the reward: " + " | ".join(KL_LOSS_TYPES))
    kl_ctrl: KLControlSection = field(default_factory=KLControlSection)
    overlong_buffer: OverlongBufferSection = field(default_factory=OverlongBufferSection)
    filter_groups: FilterGroupsSection = field(default_factory=FilterGroupsSection)
    distill: DistillSection = field(default_factory=DistillSection)

    def problems(self) -> list[str]:
        p: list[str] = []
        _check_choice(p, "algorithm.adv_estimator", self.adv_estimator, ADV_ESTIMATORS)
        if (why := not_trainable_reason("algorithm.adv_estimator", self.adv_estimator)) is not None:
            p.append(why)
        _check_choice(p, "algorithm.kl_penalty", self.kl_penalty, KL_LOSS_TYPES)
        p += self.kl_ctrl.all_problems() + self.overlong_buffer.all_problems()
        p += self.filter_groups.all_problems() + self.distill.all_problems()
        return p
