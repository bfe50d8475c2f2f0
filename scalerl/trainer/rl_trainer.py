"""The RL trainer: any advantage estimator and policy loss by verl's name (`algorithm.adv_estimator`,
`actor.policy_loss`): GRPO with dual-clip PPO by default, PPO with a critic for gae.

One step (`RLTrainer.run_step`): prompts -> rollouts (``n`` per prompt; remax adds one greedy response per
prompt) -> rewards -> old (and reference) log-probs -> advantages -> ``ppo_epochs`` x mini-batches x
micro-batches of the policy loss (`run_update`) -> weight sync to the engine. The run around it (set-up, resume, the loop, the step's tail of timings, comm
and ``perf/*``, save and export) is `scalerl.trainer.run.TrainingRun`'s; what is RL's own is here: the
critic and the reference, the engine and the rollout source, prompts drawn per step (more rounds with
dynamic sampling, `scalerl.trainer.dynamic_sampling`) and sent up to ``rollout.staleness`` steps ahead. The same code runs on every layout: the model parts from `parallelize` hide whether this rank
trains a whole model or pipeline stages.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from typing import Any

import torch

from scalerl.algorithms.estimator_registry import (
    GROUP_LOCAL_ESTIMATORS,
    AdvantageInputs,
    get_advantage_estimator,
)
from scalerl.algorithms.importance import rollout_correction_weights
from scalerl.algorithms.loss_registry import get_policy_loss
from scalerl.core.algorithm_names import needs_critic, needs_greedy_baseline
from scalerl.core.config import Config
from scalerl.core.device import compute_dtype, resolve_device
from scalerl.data.errors import DataError
from scalerl.data.prompts import check_prompts, encode_prompts
from scalerl.data.sources import (
    prompt_stream_from_config,
    reward_from_config,
    rows_from_config,
)
from scalerl.models.decode_model import fused_decode_unsupported
from scalerl.models.value_model import ValueModel
from scalerl.parallel.activation_checkpointing import set_activation_checkpointing
from scalerl.parallel.distributed import DistContext
from scalerl.parallel.metric_reduction import reduce_metrics
from scalerl.perf.mfu import StepWork
from scalerl.perf.timing import StepTimer
from scalerl.rollout.batch import RolloutBatch
from scalerl.rollout.builtin_engine import BuiltinEngine
from scalerl.rollout.engine import SamplingParams
from scalerl.rollout.engine_choice import decide_engine
from scalerl.rollout.sources import (
    ColocatedRollouts,
    StandaloneRollouts,
    StepPrompts,
)
from scalerl.rollout.staleness import check_staleness
from scalerl.rollout.worker import RolloutWorker
from scalerl.tracking import plot_metrics
from scalerl.trainer.dynamic_sampling import GeneratedRound, fill_with_signal
from scalerl.trainer.evaluation import data_source_of, evaluate, evaluate_sampled
from scalerl.trainer.forward_passes import (
    packed_kernel_for,
    response_logprobs,
    response_values,
)
from scalerl.trainer.objectives import (
    PolicyObjective,
    ValueObjective,
    policy_loss_options,
)
from scalerl.trainer.optim import build_optimizer
from scalerl.trainer.reward_shaping import RewardShaping
from scalerl.trainer.rollout_rebalance import rebalance_batch
from scalerl.trainer.run import TrainingRun, run_output_dir, start_run, step_work
from scalerl.trainer.run_checks import check_rl_layout
from scalerl.trainer.run_directory import CHECKPOINTS_DIR
from scalerl.trainer.run_failures import last_good_checkpoint, run_reporting_failures
from scalerl.trainer.streamed_step import StreamedStep
from scalerl.trainer.update import OptimizerStep, UpdatePlan, UpdateRun, run_update

# Config keys a resumed run must share with the checkpoint it resumes (others, e.g. total_steps, may change).
RESUME_MUST_MATCH = [
    "model.path", "model.hidden_size", "model.num_hidden_layers", "model.num_attention_heads",
    "model.num_key_value_heads", "model.intermediate_size", "algorithm.adv_estimator", "trainer.init_from",
]


def loss_draw_seed(seed: int, step: int, dp_rank: int) -> int:
    """The seed of a step's policy-loss draws on one DP rank (distinct per step and rank, fixed by both)."""
    return ((seed * 1_000_003 + step) * 10_007 + dp_rank) % 2**63


def rollout_seed(seed: int, step: int, round_index: int = 0) -> int:
    """The sampling seed of a step's generation round (round 0: every step's one round without dynamic
    sampling; further rounds get seeds of their own, fixed by the step and round)."""
    base = seed * 1_000_003 + step
    return base if round_index == 0 else (base * 1_009 + round_index) % 2**63


class RLTrainer(TrainingRun):
    kind, export_name, export_key, skipped_prefix = "rl", "final", "final_model", "actor"
    eval_at_start = True

    def __init__(self, cfg: Config, ctx: DistContext, *, timer: StepTimer | None = None,
                 wrap_optimizer_step: Callable[[OptimizerStep], OptimizerStep] | None = None,
                 on_batch: Callable[[RolloutBatch], None] | None = None):
        """The trainer on ``ctx`` (`start_run`'s), trusting ``cfg`` (checked there). ``on_batch`` sees each
        step's batch once its advantages are in."""
        t, a, r = cfg.trainer, cfg.actor, cfg.rollout
        check_rl_layout(cfg, ctx)
        super().__init__(cfg, ctx, total_steps=t.total_steps, eval_every=t.eval_every, timer=timer)
        self.on_batch = on_batch
        model = self.load_model()
        self.shaping = RewardShaping(cfg, self.tokenizer.stop_token_ids,
                                     all_reduce=ctx.all_reduce if ctx.dp_size > 1 else None)
        # The critic and the frozen reference start as copies of the policy, made before it is laid out.
        critic = ValueModel(model) if needs_critic(cfg.algorithm.adv_estimator) else None
        reference = copy.deepcopy(model).requires_grad_(False) if a.use_kl_loss or self.shaping.needs_reference else None
        self.packed_kernel = packed_kernel_for(model, a.use_remove_padding, ctx)
        self.policy = self.lay_out(model)
        self.critic = self.lay_out(critic) if critic is not None else None
        self.reference = self.lay_out(reference, trainable=False) if reference is not None else None
        if self.reference is not None:
            self.reference.eval()
        self.trained = {"actor": self.policy, **({"critic": self.critic} if self.critic is not None else {})}

        def check(rows: list[dict], split: str) -> None:
            check_prompts(self.tokenizer, rows, cfg.data.chat_template, cfg.data.max_prompt_length, split)

        # A streamed training set is checked as it is drawn (`_encode`), not up front.
        self.stream = prompt_stream_from_config(cfg.data, t.batch_size, t.seed, ctx,
                                                lambda rows: check(rows, "training"))
        all_val_rows = rows_from_config(cfg.data, "test", t.seed)
        self.val_rows = ctx.dp_share(all_val_rows)
        # Sampled evaluation's data sources, of the rows all ranks evaluate: every rank reports the same keys.
        evaluated = all_val_rows[: len(self.val_rows) * ctx.dp_size]
        self.val_sources = sorted({data_source_of(row, cfg.data.task) for row in evaluated})
        check(self.val_rows, "validation")
        self.reward = reward_from_config(cfg.data, self.device)
        self.reward.last_good_checkpoint = lambda: last_good_checkpoint(self.checkpoint_root)
        self.reward_extra_names: set[str] = set()
        if self.engine_choice.decided and ctx.is_main:
            print(f"rollout.engine=auto: {self.engine_choice.name} ({self.engine_choice.why})", flush=True)
        self.engine = self._build_engine()  # generates when colocated, evaluates always
        if r.placement == "standalone":
            self.rollouts = StandaloneRollouts(self.policy, ctx, self.tokenizer.pad_token_id, r, cfg.weight_sync,
                                               self.precision_choice.requested, self.engine.compute_dtype
                                               if self.engine.logprobs_match_training_forward else None,
                                               self.engine_choice.name)
        else:
            self.rollouts = ColocatedRollouts(self.engine, self.policy, ctx)
        # Steps drawn and sent ahead (rollout.staleness), each with the stream's state from before its draw.
        self.prefetched: dict[int, tuple[StepPrompts, dict]] = {}
        self.step_rows: list[dict] = []  # this rank's data rows of the current step
        # rollout.stream_groups: the step's per-token passes, run on the workers' parts as they arrived
        # (`_generate_streamed`), taken by `run_step` ("old", "ref": [B, R] each)
        self.streamed_passes: dict[str, torch.Tensor] = {}
        self.stream_overlap_s = 0.0  # this step's trainer seconds on parts before the last part came
        # rollout.stream_groups with nothing to stop it: the actor update whose first mini-batches ran as their
        # groups arrived (`_stream_mini_batches`), finished by `run_step`; how many ran before the last part
        self.actor_update: UpdateRun | None = None
        self.stream_early_mini_batches = 0

        # One optimizer for the policy and the critic; each update zeroes all gradients first, so a step
        # only moves the parameters that got gradients.
        param_sets = [(self.policy.parameters(), a.lr)]
        if self.critic is not None:
            param_sets.append((self.critic.parameters(), cfg.critic.lr))
        self.use_optimizer(*build_optimizer(
            param_sets, a.weight_decay, betas=tuple(a.betas), warmup_steps=a.warmup_steps,
            total_steps=t.total_steps, schedule=a.lr_schedule, min_lr_ratio=a.min_lr_ratio,
        ), a.grad_clip, wrap_optimizer_step)
        self.policy_objective = PolicyObjective(a, r.temperature, get_policy_loss(a.policy_loss),
                                                policy_loss_options(a))
        self.value_objective = ValueObjective(cfg.critic, a.loss_agg_mode)
        self.update_plan = UpdatePlan(
            epochs=a.ppo_epochs, mini_batch_size=a.ppo_mini_batch_size // ctx.dp_size,
            micro_batch_size=a.ppo_micro_batch_size, micro_batch_max_tokens=a.micro_batch_max_tokens,
            horizon=r.max_new_tokens, shuffle=a.shuffle, fixed_widths=(cfg.data.max_prompt_length, r.max_new_tokens),
            packed_kernel=self.packed_kernel,
        )
        self.update_generator = torch.Generator().manual_seed(t.seed + 1)
        self.generators = {"update": self.update_generator}
        self.updates_wait_for = self._why_updates_wait() if r.stream_groups else None
        # An early optimizer step changes the policy the old log-probs of later parts are recomputed with, so
        # where they are recomputed those passes run on a copy of the policy taken before the step's update
        # (refreshed each step, `_refresh_old_policy`): its weights are the trained ones, so the same numbers.
        self.old_policy = None
        if r.stream_groups and self.updates_wait_for is None and not self.rollouts.logprobs_match_training_forward:
            self.old_policy = copy.deepcopy(self.policy.model).requires_grad_(False).eval()
            set_activation_checkpointing(self.old_policy, False)
        if r.stream_groups and ctx.is_main:
            copied = "" if self.old_policy is None else (
                "; the old log-probs are recomputed on a copy of the pre-update policy ("
                f"{sum(p.numel() * p.element_size() for p in self.old_policy.parameters()) / 2**20:.1f} MiB)")
            print("rollout.stream_groups: " + ("the update's mini-batches start as their groups arrive" + copied
                  if self.updates_wait_for is None else f"the update waits for the whole batch: {self.updates_wait_for}"),
                  flush=True)
        resumed = self.resume(RESUME_MUST_MATCH)
        # Rollouts start from the current weights: a restored pipeline replica, standalone workers' copies.
        if resumed or r.placement == "standalone":
            self.rollouts.sync_weights(version=self.step)
        self.start_logging()
        if r.stream_groups:  # the doctor's trainer-idle fix names it (`scalerl.health.rollout_rules`)
            self.monitor.context["stream_update_waits_for"] = self.updates_wait_for

    def _why_updates_wait(self) -> str | None:
        """With rollout.stream_groups, why the actor's update cannot start before the batch is whole (None: its
        first-epoch mini-batches start as their groups arrive). An early optimizer step is exact only if nothing
        the rest of the step computes reads the weights it changes or the rows still to come."""
        cfg, a, alg = self.cfg, self.cfg.actor, self.cfg.algorithm
        if a.shuffle:
            return "actor.shuffle=true draws every mini-batch from the whole batch (set it false for row order)"
        if self.critic is not None:
            return "the critic's values and update come before the actor's"
        dims = self.dist.dims
        if not self.rollouts.logprobs_match_training_forward and (self.policy.sharded or dims.ep > 1 or dims.sp > 1):
            # the pre-update copy the recompute would run on is kept for whole (unsharded) models only
            return ("the old log-probs are recomputed, and with a sharded or split policy (FSDP, TP, EP, SP) no "
                    "pre-update copy is kept for them (fp32 workers with rollout.staleness=0 or "
                    "rollout.stale_logprobs=behavior give them with the rollout)")
        if alg.adv_estimator not in GROUP_LOCAL_ESTIMATORS:
            return f"algorithm.adv_estimator={alg.adv_estimator} reads more than a row's own group"
        if alg.filter_groups.enable:
            return "dynamic sampling (algorithm.filter_groups) chooses the batch's groups first"
        if alg.use_kl_in_reward:
            return "the KL-in-reward controller updates once per step from the whole batch"
        if self.dist.dp_size > 1 and cfg.trainer.balance_batch:
            return "trainer.balance_batch moves rows between the DP ranks once the batch is whole"
        if self.update_plan.mini_batch_size >= cfg.trainer.batch_size * cfg.rollout.n // self.dist.dp_size:
            return "actor.ppo_mini_batch_size is the whole batch (one optimizer step per step)"
        return None

    def model_loaded(self, model) -> None:
        # rollout.engine, decided once (auto: from the model as loaded); the workers decide alike, with the
        # same inputs. Read by the precision rule (`bf16_recompute_reason`), the engine and the sources.
        self.engine_choice = decide_engine(self.cfg, model, self.dist.world_size)

    def bf16_recompute_reason(self, model) -> str | None:
        """Where the built-in engine would not decode by the bf16 training forward's recipe
        (`scalerl.rollout.builtin_engine.logprobs_match_forward`), so bf16 would add a log-prob pass."""
        r, dims = self.cfg.rollout, self.dist.dims
        if self.device.type != "cpu":
            return None  # CUDA: auto goes by the tensor cores (the recompute is cheap beside them)
        engine = self.engine_choice.name
        if engine != "builtin":
            return f"rollout.engine={engine} generates in its own numerics"
        if r.placement == "standalone":
            return "standalone workers started before auto resolves decode in rollout.dtype"
        if r.max_num_seqs:
            return "continuous batching (rollout.max_num_seqs) decodes with the model's own fp32 forward"
        if dims.dp_shard > 1 or dims.tp > 1 or dims.pp > 1:
            return "sharded or pipeline-cut weights decode with the model's own fp32 forward"
        unsupported = fused_decode_unsupported(model)
        return None if unsupported is None else f"no fused bf16 decode path ({unsupported})"

    def _build_engine(self):
        """The engine the trainer's ranks generate with (colocated) and evaluate with. Standalone, the workers
        run ``rollout.engine`` and the trainer evaluates with the built-in one."""
        r = self.cfg.rollout
        if self.engine_choice.name == "builtin" or r.placement == "standalone":
            return BuiltinEngine(self.policy.model, self.tokenizer.pad_token_id, all_finished=self.dist.all_finished,
                                 max_num_seqs=r.max_num_seqs,
                                 dtype=compute_dtype(self.autocast.precision, getattr(torch, self.cfg.model.dtype)))
        from scalerl.rollout.vllm_engine import vllm_engine_from_config

        return vllm_engine_from_config(self.policy.model, self.cfg, self.output_dir, self.tokenizer.pad_token_id)

    # ------------------------------------------------------------------------------------------ one step
    def run_step(self) -> tuple[dict[str, float], StepWork]:
        """rollout -> reward -> old (and reference) log-probs -> advantages -> update -> weight sync."""
        cfg, timer, a = self.cfg, self.timer, self.cfg.actor
        temperature, micro = cfg.rollout.temperature or 1.0, a.ppo_micro_batch_size
        # The losses' random draws (clip_cov's token picks): a function of the step and the DP rank, so a
        # resumed run repeats them; TP/PP peers hold the same rows and draw the same. Set before the rollout:
        # a streaming trainer may take mini-batches while the rows still arrive.
        self.policy_objective.generator = torch.Generator().manual_seed(
            loss_draw_seed(cfg.trainer.seed, self.step, self.dist.dp_rank))
        batch, metrics = self._rollout()
        reward_baselines = None
        if needs_greedy_baseline(cfg.algorithm.adv_estimator):
            with timer("gen_max"):  # verl's name for ReMax's greedy generation
                reward_baselines = self._greedy_baselines(self.step_rows, metrics)
        # The rollout's log-probs equal the training forward's where its source says so (fp32, or bf16 on CPU
        # with the built-in engine: one recipe; with rollout.stale_logprobs=behavior, of the one-step-old policy
        # PPO then takes its ratio against); otherwise (bf16 on CUDA, bf16 workers' copies, stale weights,
        # another engine) they are recomputed (decoupled PPO's proximal policy), and the rollout's own log-probs
        # weigh the loss (rollout.is_level/is_mode/is_cap).
        reuse_logprobs = self.rollouts.logprobs_match_training_forward
        streamed = self.streamed_passes  # rollout.stream_groups: passes run on the parts as they arrived
        self.streamed_passes = {}
        with timer("old_log_prob"):
            if reuse_logprobs:
                batch.old_logprobs = batch.rollout_logprobs
            else:
                batch.old_logprobs = streamed["old"] if "old" in streamed else response_logprobs(
                    self.policy.model, batch, temperature, micro, self.autocast, self.packed_kernel)
                metrics.update(self._correct_for_rollout(batch))
        if self.reference is not None:
            with timer("ref"):
                batch.ref_logprobs = streamed["ref"] if "ref" in streamed else response_logprobs(
                    self.reference.model, batch, temperature, micro, self.autocast, self.packed_kernel)
        with timer("adv"):
            self._advantages(batch, reward_baselines, metrics)
        if self.on_batch is not None:
            self.on_batch(batch)
        work = step_work(batch, forward_passes=int(not reuse_logprobs) + (self.reference is not None)
                         + (self.critic is not None), update_passes=a.ppo_epochs * (2 if self.critic is not None else 1))
        self.shaping.mask_loss(batch)  # actor.mask_truncated_completions: the loss's mask (perf/* counted them)
        if self.dist.dp_size > 1 and cfg.trainer.balance_batch:
            with timer("balance"):
                batch, balance_metrics = rebalance_batch(batch, self.dist, len(self.step_rows))
            metrics.update(balance_metrics)
        metrics["perf/update_tokens"] = float(batch.attention_mask.sum())  # after balancing: this rank's share
        if self.critic is not None:
            with timer("update_critic"):
                metrics.update(run_update(self.critic, self.optimizer_step, batch, self.value_objective,
                                          self.update_plan, self.update_generator, self.dist, self.autocast))
        with timer("update_actor"):
            update, self.actor_update = self.actor_update or self._actor_update(len(batch)), None
            metrics.update(update.finish(batch))
        metrics["actor/lr"] = self.optimizer.param_groups[0]["lr"]
        with timer("update_weights"):
            metrics.update(self.rollouts.sync_weights(version=self.step + 1))  # the policy after this update
        metrics.update(self.rollouts.step_metrics())
        if cfg.rollout.stream_groups:
            metrics["timing_s/stream_overlap"], self.stream_overlap_s = self.stream_overlap_s, 0.0
            metrics["perf/stream_early_mini_batches"] = float(self.stream_early_mini_batches)
        return metrics, work

    def _actor_update(self, rows: int) -> UpdateRun:
        return UpdateRun(self.policy, self.optimizer_step, self.policy_objective, self.update_plan,
                         self.update_generator, self.dist, self.autocast, rows, self.device)

    def _rollout(self) -> tuple[RolloutBatch, dict[str, float]]:
        cfg, timer = self.cfg, self.timer
        n, filtering = cfg.rollout.n, cfg.algorithm.filter_groups
        with timer("data"):
            step_prompts = self._prompts_for(self.step)
        self.policy.eval()
        generated = self._generate_round(step_prompts, prefetch_after_gen=not filtering.enable)
        filter_metrics: dict[str, float] = {}
        if filtering.enable:  # DAPO's dynamic sampling: further rounds until the batch has signal
            generated, filter_metrics = fill_with_signal(
                generated, self._next_round, self.dist, n=n, groups_per_rank=cfg.trainer.batch_size // self.dist.dp_size,
                max_rounds=filtering.max_num_gen_batches, pad_token_id=self.tokenizer.pad_token_id,
                groups_multiple=self._pipeline_groups_multiple())
            self._prefetch_next()  # after every draw of this step, so the saved stream position is exact
        rows, out, scores, failures = generated.rows, generated.out, generated.scores, generated.failures
        self.step_rows = rows  # remax scores its greedy baselines against them
        group_ids = torch.arange(len(rows)).repeat_interleave(n)
        batch = RolloutBatch.from_generation(out, group_ids, torch.tensor(scores, dtype=torch.float32))
        staleness_metrics: dict[str, float] = {}
        if out.weight_versions is not None and cfg.rollout.placement == "standalone":
            check = check_staleness(out.weight_versions, out.response_mask, self.step, cfg.rollout.staleness)
            batch.response_mask[~check.keep.to(batch.response_mask.device)] = 0.0  # out of the loss, counted
            staleness_metrics = check.metrics
        shaping_metrics = self.shaping.shape_scores(batch)  # the overlong buffer, part of the score from here on
        lengths = out.response_lengths.float()
        metrics = {  # per rank here; `reduce_metrics` combines them over ranks
            "critic/score/mean": float(batch.scores.mean()),
            "critic/score/max": float(batch.scores.max()),
            "critic/score/min": float(batch.scores.min()),
            "reward/num_failures": float(failures),
            "response_length/mean": float(lengths.mean()),
            "response_length/max": float(lengths.max()),
            "response_length/clip_ratio": sum(r == "length" for r in out.finish_reasons) / len(out.finish_reasons),
            **shaping_metrics,
            **staleness_metrics,
        }
        # A reward's extra numbers, under every name seen so far: the same keys on every rank each step (the
        # metrics gather needs them), NaN where this rank's calls gave none (reduced over the ranks that did).
        self.reward_extra_names.update(self.reward.last_metrics)
        metrics.update({k: self.reward.last_metrics.get(k, math.nan) for k in sorted(self.reward_extra_names)})
        metrics.update(filter_metrics)
        return batch, metrics

    def _pipeline_groups_multiple(self) -> int:
        """The fewest groups that fill whole mini-batches (1 without a pipeline, whose schedule runs one
        mini-batch shape)."""
        rows, n = self.update_plan.mini_batch_size, self.cfg.rollout.n
        return math.lcm(rows, n) // n if self.dist.dims.pp > 1 else 1

    def _generate_round(self, step_prompts: StepPrompts, prefetch_after_gen: bool = False) -> GeneratedRound:
        """This DP rank's share of ``step_prompts`` generated and scored (with ``prefetch_after_gen``, the
        next step's prompts go to the workers before the reward runs)."""
        if self.cfg.rollout.stream_groups:
            return self._generate_streamed(step_prompts, prefetch_after_gen)
        n = self.cfg.rollout.n
        rows = self.dist.dp_share(step_prompts.rows)  # this DP rank's share of the global batch
        with self.timer("gen"):
            out = self.rollouts.generate(step_prompts)
        if prefetch_after_gen:
            self._prefetch_next()
        with self.timer("reward"):
            texts = self.tokenizer.batch_decode(out.response_ids.tolist())
            scores, failures = self.reward.compute(texts, [rows[i // n] for i in range(len(rows) * n)])
        return GeneratedRound(rows, out, scores, failures)

    def _generate_streamed(self, step_prompts: StepPrompts, prefetch_after_gen: bool) -> GeneratedRound:
        """`_generate_round` by parts (rollout.stream_groups): each worker's reply, whole groups, is scored as
        it arrives (this DP rank's rows of it) and its rows go through the old/reference log-prob passes
        (`StreamedStep`, the whole batch's micro-batch grid: the same numbers as one pass; in lockstep over
        the DP ranks) and, where exact, the update's first mini-batches, while the other workers still
        generate. With dynamic sampling the passes wait for the filtered batch (they would run
        on groups it drops); the scoring still streams. ``timing_s/gen`` is the wait for the parts,
        ``timing_s/stream_overlap`` the trainer's work on parts before the last one came."""
        cfg, timer, n, dp = self.cfg, self.timer, self.cfg.rollout.n, self.dist.dp_size
        rows = self.dist.dp_share(step_prompts.rows)  # this DP rank's share of the step, whole groups
        total = len(rows) * n
        own = self.dist.dp_rank * total  # where this share's rows start in the step's
        streamed = StreamedStep(total, cfg.actor.ppo_micro_batch_size,
                                {} if cfg.algorithm.filter_groups.enable else self._part_passes(),
                                self.tokenizer.pad_token_id, tuple(r * total for r in range(dp)), own)
        scores, failures, extras = [0.0] * total, 0, []  # extras: (samples, the reward's metrics of a part)
        parts, work_s, last_work_s = self.rollouts.generate_parts(step_prompts), 0.0, 0.0
        update = self._actor_update(total) if self.updates_wait_for is None else None
        if self.old_policy is not None:
            self._refresh_old_policy()
        self.stream_early_mini_batches = 0
        while True:
            with timer("gen"):
                arrived = next(parts, None)
            if arrived is None:
                break
            start, out, last = arrived
            if last and update is not None:
                self.stream_early_mini_batches = update.first_done
            if last and prefetch_after_gen:
                self._prefetch_next()  # the next steps' prompts go out before this one's remaining work
            began = time.perf_counter()
            lo, hi = max(start, own) - own, min(start + len(out.finish_reasons), own + total) - own  # this share's
            if lo < hi:
                with timer("reward"):
                    texts = self.tokenizer.batch_decode(out.rows(lo + own - start, hi + own - start).response_ids.tolist())
                    part_scores, part_failures = self.reward.compute(texts, [rows[(lo + i) // n] for i in range(len(texts))])
                scores[lo:hi], failures = part_scores, failures + part_failures
                extras.append((len(texts), dict(self.reward.last_metrics)))
            streamed.add(start, out)
            if update is not None:
                self._stream_mini_batches(update, streamed, scores)
            last_work_s = time.perf_counter() - began
            work_s += last_work_s
        self.stream_overlap_s += work_s - last_work_s
        self.reward.last_metrics = _weighted_means(extras)
        out = streamed.output()
        self.streamed_passes = streamed.pass_results(out.response_ids.shape[1])
        self.actor_update = update
        return GeneratedRound(rows, out, scores, failures)

    def _correct_for_rollout(self, batch: RolloutBatch) -> dict[str, float]:
        """Recomputed old log-probs against the rollout's own: the importance weights the loss takes
        (rollout.is_level/is_mode/is_cap; none with a cap of 0) set on ``batch``, and their metrics (only the
        mismatch ``rollout/*`` without a cap)."""
        r, cap = self.cfg.rollout, self.cfg.rollout.correction_cap
        weights, mismatch = rollout_correction_weights(batch.old_logprobs, batch.rollout_logprobs,
                                                       batch.response_mask, r.is_level, r.is_mode, cap or 1.0)
        batch.is_weights = weights if cap else None
        return mismatch if cap else {k: v for k, v in mismatch.items() if k.startswith("rollout/")}

    @torch.no_grad()
    def _refresh_old_policy(self) -> None:
        """The pre-update copy's weights set to the policy's, before this step's first optimizer step. Only the
        trainable parameters: the frozen ones (a LoRA base, buffers) are the deep copy's and never change."""
        with self.timer("old_policy_copy"):
            for copied, trained in zip(self.old_policy.parameters(), self.policy.model.parameters()):
                if trained.requires_grad:
                    copied.copy_(trained)

    def _stream_mini_batches(self, update: UpdateRun, streamed: StreamedStep, scores: list[float]) -> None:
        """Every first-epoch mini-batch of ``update`` whose groups are in, in order (rows in row order:
        actor.shuffle=false). Its groups get what `_rollout` and `run_step` give the whole batch, each a function
        of a row or its group (`_why_updates_wait` refuses the rest): staleness mask, overlong penalty, old
        log-probs from the rollout or the streamed pass (on the pre-update copy) with their importance weights,
        reference log-probs from the streamed pass, advantages, truncation mask."""
        cfg, n = self.cfg, self.cfg.rollout.n
        while (rows := update.next_rows()) is not None:
            lo, hi = int(rows[0]), int(rows[-1]) + 1
            first, stop = lo // n * n, -(-hi // n) * n  # the whole groups the rows belong to
            if not streamed.ready(first, stop):
                return
            out, passes = streamed.rows_with_passes(first, stop)
            groups = torch.arange(first // n, stop // n).repeat_interleave(n)
            batch = RolloutBatch.from_generation(out, groups, torch.tensor(scores[first:stop], dtype=torch.float32))
            if out.weight_versions is not None:
                keep = check_staleness(out.weight_versions, out.response_mask, self.step, cfg.rollout.staleness).keep
                batch.response_mask[~keep.to(batch.response_mask.device)] = 0.0
            self.shaping.shape_scores(batch)
            if "old" in passes:  # recomputed (on the pre-update copy), and the rollout's own weigh the loss
                batch.old_logprobs = passes["old"]
                self._correct_for_rollout(batch)  # its metrics come from the whole batch in `run_step`
            else:
                batch.old_logprobs = batch.rollout_logprobs
            if "ref" in passes:
                batch.ref_logprobs = passes["ref"]
            self._advantages(batch)
            self.shaping.mask_loss(batch)
            with self.timer("update_actor"):
                update.run_next(batch.select(torch.arange(lo - first, hi - first, device=batch.input_ids.device)))

    def _part_passes(self) -> dict[str, Callable[[RolloutBatch], torch.Tensor]]:
        """The per-token passes `run_step` would run on the whole batch, as functions of one micro-batch,
        each timed under its own name: old log-probs where they are recomputed, reference log-probs."""
        temperature, micro = self.cfg.rollout.temperature or 1.0, self.cfg.actor.ppo_micro_batch_size

        def timed(name: str, model) -> Callable[[RolloutBatch], torch.Tensor]:
            def run(batch: RolloutBatch) -> torch.Tensor:
                with self.timer(name):
                    return response_logprobs(model, batch, temperature, micro, self.autocast, self.packed_kernel)
            return run

        passes = {}
        if not self.rollouts.logprobs_match_training_forward:
            passes["old"] = timed("old_log_prob", self.old_policy if self.old_policy is not None else self.policy.model)
        if self.reference is not None:
            passes["ref"] = timed("ref", self.reference.model)
        return passes

    def _next_round(self, round_index: int) -> GeneratedRound:
        """Dynamic sampling's round ``round_index`` (> 0) of this step: a further batch drawn and generated."""
        with self.timer("data"):
            step_prompts = self._prompts_for(self.step, round_index)
        return self._generate_round(step_prompts)

    def _advantages(self, batch: RolloutBatch, reward_baselines: torch.Tensor | None = None,
                    metrics: dict[str, float] | None = None) -> None:
        """``algorithm.adv_estimator`` on this rank's batch: critic values first where it needs them; whole
        groups are on one rank, and the estimators that whiten or count over the batch all-reduce over DP.
        With ``algorithm.use_kl_in_reward`` the token rewards carry the KL penalty (its metrics to ``metrics``)."""
        alg, micro = self.cfg.algorithm, self.cfg.actor.ppo_micro_batch_size
        if self.critic is not None:
            batch.values = response_values(self.critic.model, batch, micro, self.autocast, self.packed_kernel)
        device = batch.response_mask.device
        token_rewards, kl_metrics = self.shaping.token_rewards(batch)
        if metrics is not None:
            metrics.update(kl_metrics)
        inputs = AdvantageInputs(
            token_rewards, batch.response_mask, index=batch.group_ids, values=batch.values,
            reward_baselines=reward_baselines.to(device) if reward_baselines is not None else None,
            gamma=alg.gamma, lam=alg.lam, norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo,
            all_reduce=self.dist.all_reduce if self.dist.dp_size > 1 else None,
        )
        batch.advantages, batch.returns = get_advantage_estimator(alg.adv_estimator)(inputs)

    def _greedy_baselines(self, rows: list[dict], metrics: dict[str, float]) -> torch.Tensor:
        """ReMax's baseline: the reward of one greedy response per prompt, from the engine that evaluates
        (the current weights on every placement), repeated for the prompt's ``n`` samples ([B])."""
        sampling = SamplingParams(max_new_tokens=self.cfg.rollout.max_new_tokens, temperature=0.0,
                                  stop_token_ids=self.tokenizer.stop_token_ids, seed=self.cfg.trainer.seed)
        out = self._engine_with_current_weights().generate(self._encode(rows), sampling)
        scores, failures = self.reward.compute(self.tokenizer.batch_decode(out.response_ids.tolist()), rows)
        baselines = torch.tensor(scores, dtype=torch.float32)
        metrics["critic/reward_baseline/mean"] = float(baselines.mean())
        metrics["reward/num_failures"] += float(failures)
        return baselines.repeat_interleave(self.cfg.rollout.n)

    def _prompts_for(self, step: int, round_index: int = 0) -> StepPrompts:
        """The whole batch of ``step`` (every rank draws it and keeps its share later); dynamic sampling's
        further rounds (``round_index`` > 0) draw the stream's next batches."""
        if round_index == 0 and step in self.prefetched:
            return self.prefetched.pop(step)[0]
        r = self.cfg.rollout
        rows = self.stream.next_batch()
        prompts = [p for p in self._encode(rows) for _ in range(r.n)]
        # The seed is a function of the step (and round), so a resumed run samples exactly what the original did.
        sampling = SamplingParams(
            max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
            stop_token_ids=self.tokenizer.stop_token_ids, seed=rollout_seed(self.cfg.trainer.seed, step, round_index),
            total_rows=len(prompts),
        )
        return StepPrompts(step, prompts, sampling, rows)

    def _encode(self, rows: list[dict]) -> list[list[int]]:
        prompts = encode_prompts(self.tokenizer, [r["prompt"] for r in rows], self.cfg.data.chat_template)
        limit = self.cfg.data.max_prompt_length
        for row, ids in zip(rows, prompts):
            if len(ids) > limit:
                raise DataError(
                    f"prompt of {len(ids)} tokens exceeds data.max_prompt_length={limit}: {row['prompt'][:80]!r}; "
                    "raise data.max_prompt_length or shorten the prompts"
                )
        return prompts

    def _prefetch_next(self) -> None:
        """Asynchronous rollouts (rollout.staleness=K): the prompts of steps up to K ahead go to the workers
        before this update, drawn in step order."""
        last = min(self.step + self.cfg.rollout.staleness, self.cfg.trainer.total_steps - 1)
        for ahead in range(self.step + 1, last + 1):
            if ahead not in self.prefetched:
                state = self.stream.state_dict()
                batch = self._prompts_for(ahead)
                self.prefetched[ahead] = (batch, state)
                self.rollouts.prefetch(batch)

    # -------------------------------------------------------------------------------- around the loop
    def _engine_with_current_weights(self):
        """The trainer's engine, its decode layout refreshed where no weight sync does it: standalone, the
        workers get the pushes and the fused optimizer's in-place updates leave no trace a stale check could
        see (fused AdamW does not move the parameters' ``_version`` counters), so evaluation would decode the
        first step's weights."""
        if not isinstance(self.rollouts, ColocatedRollouts):
            getattr(self.engine, "refresh_weights", lambda: 0)()
        return self.engine

    def evaluate(self) -> dict[str, float]:
        self.policy.eval()
        with self.timer("eval"):
            local = evaluate(
                self._engine_with_current_weights(), self.tokenizer, self.val_rows, self.reward,
                self.cfg.rollout.max_new_tokens,
                temperature=self.cfg.rollout.val_temperature, seed=self.cfg.trainer.seed,
                chat_template=self.cfg.data.chat_template, row_offset=self.dist.dp_rank * len(self.val_rows),
                total_rows=len(self.val_rows) * self.dist.dp_size,
            )
            if self.cfg.trainer.val_n > 1:  # every rank holds the whole set's values: their mean is the value
                local.update(self._evaluate_sampled())
        return reduce_metrics(local, self.dist)  # equal shards, so the mean of rank means is the mean

    def _evaluate_sampled(self) -> dict[str, float]:
        cfg, share = self.cfg, len(self.val_rows)
        return evaluate_sampled(
            self.engine, self.tokenizer, self.val_rows, self.reward, cfg.rollout.max_new_tokens, cfg.trainer.val_n,
            cfg.rollout.val_temperature, self.val_sources, cfg.data.task, seed=cfg.trainer.seed,
            chat_template=cfg.data.chat_template, row_offset=self.dist.dp_rank * share,
            total_rows=share * self.dist.dp_size, all_reduce=self.dist.all_reduce if self.dist.dp_size > 1 else None,
        )

    def trainer_state(self) -> dict[str, Any]:
        return {**super().trainer_state(), **self.shaping.state_dict()}

    def load_trainer_state(self, state: dict[str, Any]) -> None:
        super().load_trainer_state(state)
        self.shaping.load_state_dict(state)

    def data_state(self) -> dict[str, Any]:
        # Steps in flight are drawn and generated again after a resume: save the stream from before the first.
        return self.prefetched[min(self.prefetched)][1] if self.prefetched else self.stream.state_dict()

    def export(self) -> dict[str, str]:
        exported = super().export()
        if "jsonl" in self.cfg.trainer.logger and self.dist.is_main:
            exported["plot"] = str(plot_metrics(self.output_dir / "metrics.jsonl", self.output_dir / "metrics.png"))
        return exported

    def close(self) -> None:
        self.rollouts.close()
        getattr(self.engine, "close", lambda: None)()  # a vLLM engine's child process
        super().close()


def train(cfg: Config) -> dict[str, Any]:
    """Run RL training as configured; returns initial/last metrics and output paths. With standalone
    rollout workers, the world's last ``rollout.workers`` ranks serve generation instead (and return {})."""
    ctx = start_run(cfg, RLTrainer.kind)

    def run() -> dict[str, Any]:
        if not ctx.is_trainer:
            RolloutWorker(cfg, resolve_device(cfg.trainer.device), ctx.rollout_group).serve()
            return {}
        return RLTrainer(cfg, ctx).fit()

    return run_reporting_failures(run, run_output_dir(cfg, RLTrainer.kind) / CHECKPOINTS_DIR)


def _weighted_means(parts: list[tuple[int, dict[str, float]]]) -> dict[str, float]:
    """A reward's per-call metric means over several calls (a streamed step's parts), weighted by each call's
    samples: the whole batch's mean where every sample reports the number."""
    total: dict[str, float] = {}
    weight: dict[str, int] = {}
    for samples, metrics in parts:
        for key, value in metrics.items():
            total[key] = total.get(key, 0.0) + samples * value
            weight[key] = weight.get(key, 0) + samples
    return {key: total[key] / weight[key] for key in total}
