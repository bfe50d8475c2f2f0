"""The rollout phase of an RL step, read top to bottom: the step's prompts (drawn in step order, sent up to
``rollout.staleness`` steps ahead), the rollout's parts as they come, each part scored and passed, and the
batch prepared for the update.

There is one path. The rollout source yields *parts* (`scalerl.rollout.sources`: colocated, this rank's rows as
one part marked last, or ``data.judge.parts`` parts for a judge pool; standalone, each worker's reply as it
arrives with ``rollout.stream_groups``, the replies joined without it), and the whole batch is the one-part
case. A judge pool (``data.judge.workers``) gets each part's responses as the part arrives and its verdicts are
taken once the round is in (or before a part's early mini-batches), so judging overlaps the later parts'
generation and the part's passes. Where it is exact, a part's rows go through
the per-token passes (old log-probs where they are recomputed, reference log-probs) on the whole batch's
micro-batch grid as they arrive (`StreamedStep`), and the update's first-epoch mini-batches step as soon as
their groups are in (`_why_updates_wait` names what stops that). Every batch, a mini-batch's groups or the
whole step's rows, is made by one `RolloutPhase.prepare`: staleness mask, overlong shaping, old log-probs
(the rollout's, or the pass with the rollout correction's importance weights), reference log-probs, the
distillation teacher's (`algorithm.distill`), advantages. Nothing of a step outlives `RolloutPhase.collect`, which returns it as one `CollectedStep`.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from scalerl.algorithms.distillation import combine_advantages, distill_advantages, split_teacher_outputs
from scalerl.algorithms.estimator_registry import (
    GROUP_LOCAL_ESTIMATORS,
    AdvantageInputs,
    get_advantage_estimator,
)
from scalerl.algorithms.importance import rollout_correction_weights
from scalerl.core.algorithm_names import needs_greedy_baseline
from scalerl.data.errors import DataError
from scalerl.data.prompts import encode_prompts
from scalerl.parallel.activation_checkpointing import set_activation_checkpointing
from scalerl.perf.memory import release_host_memory
from scalerl.rollout.batch import RolloutBatch
from scalerl.rollout.engines.engine import GenerationOutput, SamplingParams
from scalerl.rollout.sources import StepPrompts
from scalerl.rollout.staleness import check_staleness
from scalerl.trainer.dynamic_sampling import GeneratedRound, fill_with_signal
from scalerl.trainer.forward_passes import response_logprobs, response_values, teacher_outputs
from scalerl.trainer.streamed_step import StreamedStep
from scalerl.trainer.update import UpdateRun


def rollout_seed(seed: int, step: int, round_index: int = 0) -> int:
    """The sampling seed of a step's generation round (round 0: every step's one round without dynamic
    sampling; further rounds get seeds of their own, fixed by the step and round)."""
    base = seed * 1_000_003 + step
    return base if round_index == 0 else (base * 1_009 + round_index) % 2**63


class PromptFeed:
    """Each step's prompts: drawn from the training stream in step order, encoded, with the step's sampling
    (its seed a function of the step and round, so a resumed run samples what the original did); with
    ``rollout.staleness=K`` the next K steps' prompts go to the rollout source early, each kept with the
    stream's state from before its draw, so a resume draws the steps in flight again."""

    def __init__(self, cfg, stream, tokenizer, rollouts):
        self.cfg, self.stream, self.tokenizer, self.rollouts = cfg, stream, tokenizer, rollouts
        self.prefetched: dict[int, tuple[StepPrompts, dict]] = {}

    def draw(self, step: int, round_index: int = 0) -> StepPrompts:
        """The whole batch of ``step`` (every rank draws it and keeps its share later); dynamic sampling's
        further rounds (``round_index`` > 0) draw the stream's next batches."""
        if round_index == 0 and step in self.prefetched:
            return self.prefetched.pop(step)[0]
        r = self.cfg.rollout
        rows = self.stream.next_batch()
        prompts = [p for p in self.encode(rows) for _ in range(r.n)]
        sampling = SamplingParams(
            max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
            stop_token_ids=self.tokenizer.stop_token_ids, seed=rollout_seed(self.cfg.trainer.seed, step, round_index),
            total_rows=len(prompts),
        )
        return StepPrompts(step, prompts, sampling, rows)

    def encode(self, rows: list[dict]) -> list[list[int]]:
        prompts = encode_prompts(self.tokenizer, [r["prompt"] for r in rows], self.cfg.data.chat_template)
        limit = self.cfg.data.max_prompt_length
        for row, ids in zip(rows, prompts):
            if len(ids) > limit:
                raise DataError(
                    f"prompt of {len(ids)} tokens exceeds data.max_prompt_length={limit}: {row['prompt'][:80]!r}; "
                    "raise data.max_prompt_length or shorten the prompts"
                )
        return prompts

    def send_ahead(self, step: int) -> None:
        """The prompts of the steps up to ``rollout.staleness`` after ``step`` to the rollout source, in step
        order (before this step's update, so the workers generate while the trainer trains)."""
        last = min(step + self.cfg.rollout.staleness, self.cfg.trainer.total_steps - 1)
        for ahead in range(step + 1, last + 1):
            if ahead not in self.prefetched:
                state = self.stream.state_dict()
                batch = self.draw(ahead)
                self.prefetched[ahead] = (batch, state)
                self.rollouts.prefetch(batch)

    def state_dict(self) -> dict[str, Any]:
        """The stream's position a checkpoint saves: from before the first step in flight."""
        return self.prefetched[min(self.prefetched)][1] if self.prefetched else self.stream.state_dict()


@dataclass
class CollectedStep:
    """What the rollout phase hands the update: this rank's prepared batch (advantages in; the truncation
    mask not yet, so the step's work counts every token), the step's metrics, and the actor update whose
    first mini-batches already ran as their groups arrived (None: the update starts now)."""

    batch: RolloutBatch
    rows: list[dict]  # the data rows the batch's groups came from (this rank's, one per group)
    metrics: dict[str, float]
    forward_passes: int  # per-token passes over the batch besides the update's (old, reference, critic values)
    update: UpdateRun | None = None
    stream_metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class _Round:
    """One generation round on this DP rank, with what its parts' streaming did."""

    generated: GeneratedRound
    passes: dict[str, torch.Tensor]  # "old"/"ref" run on the parts as they came ([B, R]); empty: not run
    update: UpdateRun | None
    early_mini_batches: int = 0
    overlap_s: float = 0.0  # trainer seconds on parts before the last one came


class RolloutPhase:
    """The rollout phase of every step of ``trainer``, the RL trainer (`scalerl.trainer.rl_trainer.RLTrainer`),
    whose parts it reads: rollout source, reward, policy/reference/critic, update plan, timer."""

    def __init__(self, trainer: Any):
        self.t = trainer
        cfg, r = trainer.cfg, trainer.cfg.rollout
        self.feed = PromptFeed(cfg, trainer.stream, trainer.tokenizer, trainer.rollouts)
        self.reward_extra_names: set[str] = set()
        self.updates_wait_for = self._why_updates_wait() if r.stream_groups else "one part per step"
        self.early_updates = self.updates_wait_for is None
        # A judge in its own pool of workers (data.judge.workers) judges each part while the next generates:
        # colocated, the rank's generation is cut into data.judge.parts parts of whole groups for it.
        cut_into = getattr(trainer.rollouts, "cut_into", None)
        if trainer.reward.overlaps and cut_into is not None and not r.agent.env:
            cut_into(cfg.data.judge.parts, r.n)
        # An early optimizer step changes the policy the old log-probs of later parts are recomputed with, so
        # where they are recomputed those passes run on a copy of the policy taken before the step's update
        # (refreshed each step, `_refresh_old_policy`): its weights are the trained ones, so the same numbers.
        self.old_policy = None
        if self.early_updates and not trainer.rollouts.logprobs_match_training_forward:
            self.old_policy = copy.deepcopy(trainer.policy.model).requires_grad_(False).eval()
            set_activation_checkpointing(self.old_policy, False)
        if r.stream_groups and trainer.dist.is_main:
            copied = "" if self.old_policy is None else (
                "; the old log-probs are recomputed on a copy of the pre-update policy ("
                f"{sum(p.numel() * p.element_size() for p in self.old_policy.parameters()) / 2**20:.1f} MiB)")
            print("rollout.stream_groups: " + ("the update's mini-batches start as their groups arrive" + copied
                  if self.early_updates else f"the update waits for the whole batch: {self.updates_wait_for}"),
                  flush=True)

    def health_context(self) -> dict[str, Any]:
        """What the doctor's trainer-idle fix reads (`scalerl.health.rollout_rules`): with rollout.stream_groups,
        why the update waits for the whole batch (None: it streams)."""
        return {"stream_update_waits_for": self.updates_wait_for} if self.t.cfg.rollout.stream_groups else {}

    def _why_updates_wait(self) -> str | None:
        """With rollout.stream_groups, why the actor's update cannot start before the batch is whole (None: its
        first-epoch mini-batches start as their groups arrive). An early optimizer step is exact only if nothing
        the rest of the step computes reads the weights it changes or the rows still to come."""
        t = self.t
        cfg, a, alg = t.cfg, t.cfg.actor, t.cfg.algorithm
        if a.shuffle:
            return "actor.shuffle=true draws every mini-batch from the whole batch (set it false for row order)"
        if t.critic is not None:
            return "the critic's values and update come before the actor's"
        dims = t.dist.dims
        if not t.rollouts.logprobs_match_training_forward and (t.policy.sharded or dims.ep > 1 or dims.sp > 1):
            # the pre-update copy the recompute would run on is kept for whole (unsharded) models only
            return ("the old log-probs are recomputed, and with a sharded or split policy (FSDP, TP, EP, SP) no "
                    "pre-update copy is kept for them (fp32 workers with rollout.staleness=0 or "
                    "rollout.stale_logprobs=behavior give them with the rollout)")
        if alg.adv_estimator not in GROUP_LOCAL_ESTIMATORS:
            return f"algorithm.adv_estimator={alg.adv_estimator} reads more than a row's own group"
        if alg.filter_groups.enable:
            return "dynamic sampling (algorithm.filter_groups) chooses the batch's groups first"
        teacher = getattr(t, "teacher", None)
        if teacher is not None and not teacher.single:
            return "several teachers (algorithm.distill.teachers) score each row by its data source on the whole batch"
        if alg.use_kl_in_reward:
            return "the KL-in-reward controller updates once per step from the whole batch"
        if t.dist.dp_size > 1 and cfg.trainer.balance_batch:
            return "trainer.balance_batch moves rows between the DP ranks once the batch is whole"
        if t.update_plan.mini_batch_size >= cfg.trainer.batch_size * cfg.rollout.n // t.dist.dp_size:
            return "actor.ppo_mini_batch_size is the whole batch (one optimizer step per step)"
        return None

    # ------------------------------------------------------------------------------------------ one step
    def collect(self, step: int) -> CollectedStep:
        """``step``'s prompts -> rollouts (their parts scored and passed as they come; more rounds with dynamic
        sampling) -> the prepared batch and the step's metrics."""
        t, cfg = self.t, self.t.cfg
        n, filtering = cfg.rollout.n, cfg.algorithm.filter_groups
        with t.timer("data"):
            prompts = self.feed.draw(step)
        t.policy.eval()
        first = self._round(step, prompts, send_ahead=not filtering.enable)
        generated, filter_metrics = first.generated, {}
        if filtering.enable:  # DAPO's dynamic sampling: further rounds until the batch has signal
            generated, filter_metrics = fill_with_signal(
                generated, lambda k: self._round(step, self._draw_round(step, k)).generated, t.dist, n=n,
                groups_per_rank=cfg.trainer.batch_size // t.dist.dp_size, max_rounds=filtering.max_num_gen_batches,
                pad_token_id=t.tokenizer.pad_token_id, groups_multiple=self._pipeline_groups_multiple())
            self.feed.send_ahead(step)  # after every draw of this step, so the saved stream position is exact
        metrics: dict[str, float] = {"reward/num_failures": float(generated.failures)}
        # A reward's extra numbers, under every name seen so far: the same keys on every rank each step (the
        # metrics gather needs them), NaN where this rank's calls gave none (reduced over the ranks that did).
        self.reward_extra_names.update(t.reward.last_metrics)
        metrics.update({k: t.reward.last_metrics.get(k, math.nan) for k in sorted(self.reward_extra_names)})
        baselines = None
        if needs_greedy_baseline(cfg.algorithm.adv_estimator):
            with t.timer("gen_max"):  # verl's name for ReMax's greedy generation
                baselines = self._greedy_baselines(generated.rows, metrics)
        batch = self.prepare(generated.out, 0, generated.scores, first.passes, step, metrics, baselines,
                             generated.rows)
        lengths = generated.out.response_lengths.float()
        finish = generated.out.finish_reasons
        metrics.update({  # per rank here; `reduce_metrics` combines them over ranks
            "critic/score/mean": float(batch.scores.mean()), "critic/score/max": float(batch.scores.max()),
            "critic/score/min": float(batch.scores.min()),
            "response_length/mean": float(lengths.mean()), "response_length/max": float(lengths.max()),
            "response_length/clip_ratio": sum(f == "length" for f in finish) / len(finish),
        })
        metrics.update(filter_metrics)
        reused = t.rollouts.logprobs_match_training_forward
        stream_metrics = {"timing_s/stream_overlap": first.overlap_s,
                          "perf/stream_early_mini_batches": float(first.early_mini_batches)} \
            if cfg.rollout.stream_groups else {}
        passes = int(not reused) + (t.reference is not None) + (t.teacher is not None) + (t.critic is not None)
        return CollectedStep(batch, generated.rows, metrics, passes,
                             first.update, stream_metrics)

    def _draw_round(self, step: int, round_index: int) -> StepPrompts:
        with self.t.timer("data"):
            return self.feed.draw(step, round_index)

    def _round(self, step: int, prompts: StepPrompts, send_ahead: bool = False) -> _Round:
        """This DP rank's share of ``prompts`` generated and scored, part by part as the source yields them
        (with ``send_ahead``, the next steps' prompts go out once the last part is in, before its reward).
        Where streaming is exact, each part's rows go through the per-token passes (`StreamedStep`: the whole
        batch's micro-batch grid, the same numbers as one pass, in lockstep over the DP ranks) and the
        update's first mini-batches, while the other workers still generate. ``timing_s/gen`` is the wait
        for the parts."""
        t, cfg, n = self.t, self.t.cfg, self.t.cfg.rollout.n
        rows = t.dist.dp_share(prompts.rows)  # this DP rank's share of the step, whole groups
        total = len(rows) * n
        own = t.dist.dp_rank * total  # where this share's rows start in the step's
        stream_passes = cfg.rollout.stream_groups and not cfg.algorithm.filter_groups.enable
        streamed = StreamedStep(total, cfg.actor.ppo_micro_batch_size, self._part_passes() if stream_passes else {},
                                t.tokenizer.pad_token_id, tuple(r * total for r in range(t.dist.dp_size)), own)
        scores, failures, extras = [0.0] * total, 0, []  # extras: (samples, the reward's metrics of a part)
        judged: list[tuple[int, int, GenerationOutput, list[dict]]] = []  # parts handed to the judge pool
        update = t.actor_update(total) if self.early_updates else None
        if self.old_policy is not None:
            self._refresh_old_policy()
        parts, early, work_s, last_work_s = t.rollouts.parts(prompts), 0, 0.0, 0.0
        while True:
            with t.timer("gen"):
                arrived = next(parts, None)
                if arrived is None:  # generation is over: what it freed (KV cache, gathered weights) goes back
                    release_host_memory(t.device)  # before the training passes (perf/memory.py)
            if arrived is None:
                break
            start, out, last = arrived
            if last and update is not None:
                early = update.first_done
            if last and send_ahead:
                self.feed.send_ahead(step)  # the next steps' prompts go out before this one's remaining work
            began = time.perf_counter()
            lo, hi = max(start, own) - own, min(start + len(out.finish_reasons), own + total) - own  # this share's
            if lo < hi:
                mine = out.rows(lo + own - start, hi + own - start)
                part_rows = [rows[(lo + i) // n] for i in range(hi - lo)]
                if t.reward.overlaps:  # a judge pool: judged during the part's passes and the next parts
                    self._start_score(mine, part_rows)
                    judged.append((lo, hi, mine, part_rows))
                else:
                    with t.timer("reward"):
                        part_scores, part_failures = self._score(mine, part_rows)
                    scores[lo:hi], failures = part_scores, failures + part_failures
                    extras.append((hi - lo, dict(t.reward.last_metrics)))
            streamed.add(start, out, last)
            if update is not None:
                failures += self._take_scores(judged, scores, extras)  # the mini-batches need them now
                self._early_mini_batches(update, streamed, scores, step)
            last_work_s = time.perf_counter() - began
            work_s += last_work_s
        failures += self._take_scores(judged, scores, extras)
        t.reward.last_metrics = _weighted_means(extras)
        out = streamed.output()
        passes = streamed.pass_results(out.response_ids.shape[1])
        return _Round(GeneratedRound(rows, out, scores, failures), passes, update, early, work_s - last_work_s)

    def _score(self, out: GenerationOutput, rows: list[dict]) -> tuple[list[float], int]:
        """Each sample's score and how many failed: the environment's own reward where a multi-turn episode
        gave one (`GenerationOutput.reward_inputs`), the run's reward function on the decoded text elsewhere."""
        given = [None if not r else r.get("env_reward") for r in (out.reward_inputs or [None] * len(rows))]
        todo = [i for i, g in enumerate(given) if g is None]
        scores = [0.0 if g is None else float(g) for g in given]
        failures = 0
        if not todo:
            self.t.reward.last_metrics = {}  # no call: no reward metrics of this part
        if todo:
            texts = self.t.tokenizer.batch_decode(out.response_ids[todo].tolist())
            computed, failures = self.t.reward.compute(texts, [rows[i] for i in todo])
            for i, score in zip(todo, computed):
                scores[i] = score
        return scores, failures

    def _take_scores(self, judged: list, scores: list[float], extras: list) -> int:
        """The scores of the parts `_start_score` handed out (in order, emptying ``judged``), written into
        ``scores`` and their metrics into ``extras``; how many failed."""
        failures = 0
        while judged:
            lo, hi, mine, part_rows = judged.pop(0)
            with self.t.timer("reward"):
                scores[lo:hi], part_failures = self._score(mine, part_rows)
            failures += part_failures
            extras.append((hi - lo, dict(self.t.reward.last_metrics)))
        return failures

    def _start_score(self, out: GenerationOutput, rows: list[dict]) -> None:
        """Hand the samples `_score` will send to the reward function to it now (`RewardComputer.start`)."""
        given = [None if not r else r.get("env_reward") for r in (out.reward_inputs or [None] * len(rows))]
        todo = [i for i, g in enumerate(given) if g is None]
        if todo:
            self.t.reward.start(self.t.tokenizer.batch_decode(out.response_ids[todo].tolist()),
                                [rows[i] for i in todo])

    def _early_mini_batches(self, update: UpdateRun, streamed: StreamedStep, scores: list[float], step: int) -> None:
        """Every first-epoch mini-batch of ``update`` whose groups are in, in order (rows in row order:
        actor.shuffle=false), each prepared from its groups as the whole batch is (`prepare`: each term a
        function of a row or its group, `_why_updates_wait` refuses the rest)."""
        n = self.t.cfg.rollout.n
        while (rows := update.next_rows()) is not None:
            lo, hi = int(rows[0]), int(rows[-1]) + 1
            first, stop = lo // n * n, -(-hi // n) * n  # the whole groups the rows belong to
            if not streamed.ready(first, stop):
                return
            out, passes = streamed.rows_with_passes(first, stop)
            batch = self.prepare(out, first // n, scores[first:stop], passes, step)
            self.t.shaping.mask_loss(batch)
            with self.t.timer("update_actor"):
                update.run_next(batch.select(torch.arange(lo - first, hi - first, device=batch.input_ids.device)))

    # ------------------------------------------------------------------------------------- one batch
    def prepare(self, out: GenerationOutput, first_group: int, scores: list[float], passes: dict[str, torch.Tensor],
                step: int, metrics: dict[str, float] | None = None,
                reward_baselines: torch.Tensor | None = None, rows: list[dict] | None = None) -> RolloutBatch:
        """Rows of whole groups (from ``first_group``, this share's numbering) made ready for the update:
        stale samples masked out, the overlong penalty added to the scores, old log-probs (the rollout's where
        they equal the training forward's: fp32, or bf16 on CPU with the built-in engine, or of the behaviour
        policy with rollout.stale_logprobs=behavior; else recomputed, decoupled PPO's proximal policy, and the
        rollout's own weigh the loss), reference log-probs, and advantages. ``passes`` holds what already ran
        on these rows; the rest runs here. ``metrics`` (the whole batch only) takes what they report. ``rows``
        (the share's data rows, one per group) give each row's teacher with several (algorithm.distill.teachers)."""
        t, cfg = self.t, self.t.cfg
        n, temperature, micro = cfg.rollout.n, cfg.rollout.temperature or 1.0, cfg.actor.ppo_micro_batch_size
        groups = torch.arange(first_group, first_group + len(out.finish_reasons) // n).repeat_interleave(n)
        batch = RolloutBatch.from_generation(out, groups, torch.tensor(scores, dtype=torch.float32))
        said = {} if metrics is None else metrics
        if out.weight_versions is not None and cfg.rollout.placement == "standalone":
            check = check_staleness(out.weight_versions, out.response_mask, step, cfg.rollout.staleness)
            batch.response_mask[~check.keep.to(batch.response_mask.device)] = 0.0  # out of the loss, counted
            said.update(check.metrics)
        said.update(t.shaping.shape_scores(batch))  # the overlong buffer, part of the score from here on
        with t.timer("old_log_prob"):
            if t.rollouts.logprobs_match_training_forward:
                batch.old_logprobs = batch.rollout_logprobs
            else:
                batch.old_logprobs = passes["old"] if "old" in passes else response_logprobs(
                    t.policy.model, batch, temperature, micro, t.autocast, t.packed_kernel)
                said.update(self._correct_for_rollout(batch))
        if t.reference is not None:
            with t.timer("ref"):
                batch.ref_logprobs = passes["ref"] if "ref" in passes else response_logprobs(
                    t.reference.model, batch, temperature, micro, t.autocast, t.packed_kernel)
        if t.teacher is not None:
            with t.timer("teacher"):
                top_k, groups = t.teacher.top_k, len(batch) // n
                sources = None if rows is None else t.teacher.sources(rows[first_group : first_group + groups], n)
                values, batch.distilled = (passes["teacher"], None) if "teacher" in passes else t.teacher.score(
                    batch, sources, lambda model, part: teacher_outputs(model, part, temperature, micro, top_k,
                                                                        t.autocast, t.packed_kernel))
                batch.teacher_logprobs, batch.teacher_topk = split_teacher_outputs(values, top_k)
        with t.timer("adv"):
            self._advantages(batch, reward_baselines, said)
        return batch

    def _correct_for_rollout(self, batch: RolloutBatch) -> dict[str, float]:
        """Recomputed old log-probs against the rollout's own: the importance weights the loss takes
        (rollout.is_level/is_mode/is_cap; none with a cap of 0) set on ``batch``, and their metrics (only the
        mismatch ``rollout/*`` without a cap)."""
        r, cap = self.t.cfg.rollout, self.t.cfg.rollout.correction_cap
        weights, mismatch = rollout_correction_weights(batch.old_logprobs, batch.rollout_logprobs,
                                                       batch.response_mask, r.is_level, r.is_mode, cap or 1.0)
        batch.is_weights = weights if cap else None
        return mismatch if cap else {k: v for k, v in mismatch.items() if k.startswith("rollout/")}

    def _advantages(self, batch: RolloutBatch, reward_baselines: torch.Tensor | None,
                    metrics: dict[str, float]) -> None:
        """``algorithm.adv_estimator`` on the batch: critic values first where it needs them; whole groups are
        on one rank, and the estimators that whiten or count over the batch all-reduce over DP. With
        ``algorithm.use_kl_in_reward`` the token rewards carry the KL penalty (its metrics to ``metrics``)."""
        t, alg = self.t, self.t.cfg.algorithm
        if t.critic is not None:
            batch.values = response_values(t.critic.model, batch, t.cfg.actor.ppo_micro_batch_size, t.autocast,
                                           t.packed_kernel)
        device = batch.response_mask.device
        token_rewards, kl_metrics = t.shaping.token_rewards(batch)
        metrics.update(kl_metrics)
        inputs = AdvantageInputs(
            token_rewards, batch.response_mask, index=batch.group_ids, values=batch.values,
            reward_baselines=reward_baselines.to(device) if reward_baselines is not None else None,
            gamma=alg.gamma, lam=alg.lam, norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo,
            all_reduce=t.dist.all_reduce if t.dist.dp_size > 1 else None,
        )
        batch.advantages, batch.returns = get_advantage_estimator(alg.adv_estimator)(inputs)
        if t.teacher is not None:  # on-policy distillation: the teacher's per-token advantage on the sampled tokens
            d = alg.distill
            distill, distill_metrics = distill_advantages(batch.teacher_logprobs, batch.old_logprobs, batch.response_mask,
                                                          d.coef, inputs.all_reduce, d.estimator, d.max_clamp,
                                                          batch.distilled, batch.teacher_topk)
            # top-k: the distillation is the loss's term (`PolicyObjective`), the advantage the task's alone
            batch.advantages = combine_advantages(batch.advantages, distill * (d.top_k == 0), d.task_weight)
            metrics.update(distill_metrics)

    # ------------------------------------------------------------------------------------ the passes
    def _part_passes(self) -> dict[str, Callable[[RolloutBatch], torch.Tensor]]:
        """The per-token passes `prepare` would run on the whole batch, as functions of one micro-batch, each
        timed under its own name: old log-probs where they are recomputed, reference log-probs."""
        t = self.t
        temperature, micro = t.cfg.rollout.temperature or 1.0, t.cfg.actor.ppo_micro_batch_size

        def timed(name: str, model, top_k: int = 0) -> Callable[[RolloutBatch], torch.Tensor]:
            def run(batch: RolloutBatch) -> torch.Tensor:
                with t.timer(name):
                    return teacher_outputs(model, batch, temperature, micro, top_k, t.autocast, t.packed_kernel)
            return run

        passes = {}
        if not t.rollouts.logprobs_match_training_forward:
            passes["old"] = timed("old_log_prob", self.old_policy if self.old_policy is not None else t.policy.model)
        if t.reference is not None:
            passes["ref"] = timed("ref", t.reference.model)
        if t.teacher is not None and t.teacher.single:  # several: each row's by its source, in `prepare`
            passes["teacher"] = timed("teacher", t.teacher.model, t.teacher.top_k)
        return passes

    @torch.no_grad()
    def _refresh_old_policy(self) -> None:
        """The pre-update copy's weights set to the policy's, before this step's first optimizer step. Only the
        trainable parameters: the frozen ones (a LoRA base, buffers) are the deep copy's and never change."""
        with self.t.timer("old_policy_copy"):
            for copied, trained in zip(self.old_policy.parameters(), self.t.policy.model.parameters()):
                if trained.requires_grad:
                    copied.copy_(trained)

    def _greedy_baselines(self, rows: list[dict], metrics: dict[str, float]) -> torch.Tensor:
        """ReMax's baseline: the reward of one greedy response per prompt, from the engine that evaluates
        (the current weights on every placement), repeated for the prompt's ``n`` samples ([B])."""
        t = self.t
        sampling = SamplingParams(max_new_tokens=t.cfg.rollout.max_new_tokens, temperature=0.0,
                                  stop_token_ids=t.tokenizer.stop_token_ids, seed=t.cfg.trainer.seed)
        out = t.engine_with_current_weights().generate(self.feed.encode(rows), sampling)
        scores, failures = t.reward.compute(t.tokenizer.batch_decode(out.response_ids.tolist()), rows)
        baselines = torch.tensor(scores, dtype=torch.float32)
        metrics["critic/reward_baseline/mean"] = float(baselines.mean())
        metrics["reward/num_failures"] += float(failures)
        return baselines.repeat_interleave(t.cfg.rollout.n)

    def _pipeline_groups_multiple(self) -> int:
        """The fewest groups that fill whole mini-batches (1 without a pipeline, whose schedule runs one
        mini-batch shape)."""
        rows, n = self.t.update_plan.mini_batch_size, self.t.cfg.rollout.n
        return math.lcm(rows, n) // n if self.t.dist.dims.pp > 1 else 1


def _weighted_means(parts: list[tuple[int, dict[str, float]]]) -> dict[str, float]:
    """A reward's per-call metric means over several calls (a streamed step's parts), weighted by each call's
    samples: the whole batch's mean where every sample reports the number (one call's own means as they are)."""
    if len(parts) == 1:
        return parts[0][1]
    total: dict[str, float] = {}
    weight: dict[str, int] = {}
    for samples, metrics in parts:
        for key, value in metrics.items():
            total[key] = total.get(key, 0.0) + samples * value
            weight[key] = weight.get(key, 0) + samples
    return {key: total[key] / weight[key] for key in total}
