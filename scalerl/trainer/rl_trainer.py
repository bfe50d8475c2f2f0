"""The RL trainer: any advantage estimator and policy loss by verl's name (`algorithm.adv_estimator`,
`actor.policy_loss`): GRPO with dual-clip PPO by default, PPO with a critic for gae.

One step (`RLTrainer.run_step`) reads top to bottom: the rollout phase (`scalerl.trainer.rl_step`: prompts ->
the rollout's parts, scored and passed as they come -> the prepared batch; the whole batch is its one-part
case) -> batch-wide terms (truncation mask, DP balancing) -> the critic's and the actor's update (``ppo_epochs``
x mini-batches x micro-batches, the first ones possibly already run as their groups arrived) -> weight sync.
The run around it (set-up, resume, the loop, the step's tail of timings, comm and ``perf/*``, save and
export) is `scalerl.trainer.run.TrainingRun`'s; what is RL's own is here: the critic and the reference, the
engine (``rollout.engine`` decided once, `decide_engine`) and the rollout source, evaluation. The same code
runs on every layout: the model parts from `parallelize` hide whether this rank trains a whole model or
pipeline stages.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from scalerl.algorithms.distillation import Teachers, load_teachers
from scalerl.algorithms.loss_registry import get_policy_loss
from scalerl.core.algorithm_names import needs_critic
from scalerl.core.config import Config
from scalerl.core.device import compute_dtype, resolve_device
from scalerl.data.prompts import check_prompts
from scalerl.data.sources import (
    prompt_stream_from_config,
    reward_from_config,
    rows_from_config,
    split_origin,
)
from scalerl.models.decode_model import fused_decode_unsupported
from scalerl.models.routing_replay import enable_router_replay
from scalerl.models.value_model import ValueModel
from scalerl.parallel.distributed import DistContext
from scalerl.parallel.metric_reduction import reduce_metrics
from scalerl.perf.memory import release_host_memory
from scalerl.perf.mfu import StepWork
from scalerl.perf.timing import StepTimer
from scalerl.rollout.agent.source import AgentRollouts, EvaluationEpisodes
from scalerl.rollout.batch import RolloutBatch
from scalerl.rollout.engines.builtin import BuiltinEngine
from scalerl.rollout.engines.choice import decide_engine
from scalerl.rollout.sources import ColocatedRollouts, StandaloneRollouts
from scalerl.rollout.worker.worker import RolloutWorker
from scalerl.tracking import plot_metrics
from scalerl.trainer.evaluation import data_source_of, evaluate, evaluate_sampled
from scalerl.trainer.forward_passes import packed_kernel_for
from scalerl.trainer.objectives import (
    PolicyObjective,
    ValueObjective,
    policy_loss_options,
)
from scalerl.trainer.optim import build_optimizer
from scalerl.trainer.reward_shaping import RewardShaping
from scalerl.trainer.rl_step import RolloutPhase
from scalerl.trainer.rollout_rebalance import rebalance_batch
from scalerl.trainer.run import TrainingRun, run_output_dir, start_run, step_work
from scalerl.trainer.run_checks import check_rl_layout
from scalerl.trainer.run_directory import CHECKPOINTS_DIR
from scalerl.trainer.run_failures import (
    StopSignals,
    last_good_checkpoint,
    run_reporting_failures,
)
from scalerl.trainer.update import OptimizerStep, UpdatePlan, UpdateRun, run_update

# Config keys a resumed run must share with the checkpoint it resumes (others, e.g. total_steps, may change).
RESUME_MUST_MATCH = [
    "model.path", "model.hidden_size", "model.num_hidden_layers", "model.num_attention_heads",
    "model.num_key_value_heads", "model.intermediate_size", "algorithm.adv_estimator", "trainer.init_from",
    "algorithm.distill.teacher", "algorithm.distill.teachers", "algorithm.distill.top_k",
]


def loss_draw_seed(seed: int, step: int, dp_rank: int) -> int:
    """The seed of a step's policy-loss draws on one DP rank (distinct per step and rank, fixed by both)."""
    return ((seed * 1_000_003 + step) * 10_007 + dp_rank) % 2**63


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
        if a.router_replay:  # before the reference, critic and old-policy copies, which inherit the mark
            enable_router_replay(model)  # a dense model is refused here, naming the key
            if self.engine_choice.name != "builtin":
                raise ValueError(f"actor.router_replay=true needs the built-in engine, which records routed experts; "
                                 f"rollout.engine={self.engine_choice.configured} resolved to "
                                 f"{self.engine_choice.name}: set rollout.engine=builtin")
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
        # Frozen and laid out like the reference; one model per teacher directory, each row's by its data source.
        teachers = {path: self.lay_out(m, trainable=False)
                    for path, m in load_teachers(cfg, self.tokenizer, self.device, model).items()}
        self.teacher = Teachers(teachers, cfg.algorithm.distill.teachers, cfg.data.task,
                                cfg.algorithm.distill.top_k).eval() if teachers else None
        self.trained = {"actor": self.policy, **({"critic": self.critic} if self.critic is not None else {})}

        self.reward = reward_from_config(cfg.data, self.device)

        def check(rows: list[dict], split: str) -> None:
            check_prompts(self.tokenizer, rows, cfg.data.chat_template, cfg.data.max_prompt_length, split)
            if not r.agent.env:  # an environment's episodes bring their own rewards (or rows it reads)
                self.reward.check_split(rows[:8], split_origin(cfg.data, "train" if split == "training" else "test"))

        # A streamed training set is checked as it is drawn (`PromptFeed.encode`), not up front.
        self.stream = prompt_stream_from_config(cfg.data, t.batch_size, t.seed, ctx,
                                                lambda rows: check(rows, "training"))
        all_val_rows = rows_from_config(cfg.data, "test", t.seed)
        self.val_rows = ctx.dp_share(all_val_rows)
        # Sampled evaluation's data sources, of the rows all ranks evaluate: every rank reports the same keys.
        evaluated = all_val_rows[: len(self.val_rows) * ctx.dp_size]
        self.val_sources = sorted({data_source_of(row, cfg.data.task) for row in evaluated})
        check(self.val_rows, "validation")
        self.reward.last_good_checkpoint = lambda: last_good_checkpoint(self.checkpoint_root)
        if self.engine_choice.decided and ctx.is_main:
            print(f"rollout.engine=auto: {self.engine_choice.name} ({self.engine_choice.why})", flush=True)
        self.engine = self._build_engine()  # generates when colocated, evaluates always
        if a.router_replay:
            self.engine.record_routes = True  # GenerationOutput.routed_experts, replayed by the passes and update
        if r.placement == "standalone":
            self.rollouts = StandaloneRollouts(self.policy, ctx, self.tokenizer.pad_token_id, r, cfg.weight_sync,
                                               self.precision_choice.requested, self.engine.compute_dtype
                                               if self.engine.logprobs_match_training_forward else None,
                                               self.engine_choice.name)
        elif r.agent.env:  # multi-turn episodes: trajectories with their loss mask, the step as before
            self.rollouts = AgentRollouts(self.engine, self.policy, ctx, cfg, self.tokenizer)
        else:
            self.rollouts = ColocatedRollouts(self.engine, self.policy, ctx)
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
                                                policy_loss_options(a), cfg.algorithm.distill)
        self.value_objective = ValueObjective(cfg.critic, a.loss_agg_mode)
        self.update_plan = UpdatePlan(
            epochs=a.ppo_epochs, mini_batch_size=a.ppo_mini_batch_size // ctx.dp_size,
            micro_batch_size=a.ppo_micro_batch_size, micro_batch_max_tokens=a.micro_batch_max_tokens,
            horizon=r.max_new_tokens, shuffle=a.shuffle, fixed_widths=(cfg.data.max_prompt_length, r.max_new_tokens),
            packed_kernel=self.packed_kernel,
        )
        self.update_generator = torch.Generator().manual_seed(t.seed + 1)
        self.generators = {"update": self.update_generator}
        self.rollout_phase = RolloutPhase(self)  # a step's prompts, parts, passes and prepared batch
        resumed = self.resume(RESUME_MUST_MATCH)
        # Rollouts start from the current weights: a restored pipeline replica, standalone workers' copies.
        if resumed or r.placement == "standalone":
            self.rollouts.sync_weights(version=self.step)
        self.start_logging()
        self.monitor.context.update(self.rollout_phase.health_context())

    def model_loaded(self, model) -> None:
        # rollout.engine, decided once (auto: from the model as loaded); the workers decide alike, with the
        # same inputs. Read by the precision rule (`bf16_recompute_reason`), the engine and the sources.
        self.engine_choice = decide_engine(self.cfg, model, self.dist.world_size)

    def bf16_recompute_reason(self, model) -> str | None:
        """Where the built-in engine would not decode by the bf16 training forward's recipe
        (`scalerl.rollout.engines.builtin.logprobs_match_forward`), so bf16 would add a log-prob pass."""
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
        from scalerl.rollout.engines.vllm import vllm_engine_from_config

        return vllm_engine_from_config(self.policy.model, self.cfg, self.output_dir, self.tokenizer.pad_token_id)

    # ------------------------------------------------------------------------------------------ one step
    def run_step(self) -> tuple[dict[str, float], StepWork]:
        """prompts -> rollouts and their passes, prepared (`RolloutPhase.collect`) -> batch-wide terms ->
        update -> weight sync."""
        cfg, timer, a = self.cfg, self.timer, self.cfg.actor
        # The losses' random draws (clip_cov's token picks): a function of the step and the DP rank, so a
        # resumed run repeats them; TP/PP peers hold the same rows and draw the same. Set before the rollout:
        # a streaming trainer may take mini-batches while the rows still arrive.
        self.policy_objective.generator = torch.Generator().manual_seed(
            loss_draw_seed(cfg.trainer.seed, self.step, self.dist.dp_rank))
        collected = self.rollout_phase.collect(self.step)
        batch, metrics = collected.batch, collected.metrics
        if self.on_batch is not None:
            self.on_batch(batch)
        work = step_work(batch, forward_passes=collected.forward_passes,
                         update_passes=a.ppo_epochs * (2 if self.critic is not None else 1))
        self.shaping.mask_loss(batch)  # actor.mask_truncated_completions: the loss's mask (perf/* counted them)
        if self.dist.dp_size > 1 and cfg.trainer.balance_batch:
            with timer("balance"):
                batch, balance_metrics = rebalance_batch(batch, self.dist, len(batch) // cfg.rollout.n)
            metrics.update(balance_metrics)
        metrics["perf/update_tokens"] = float(batch.attention_mask.sum())  # after balancing: this rank's share
        if self.critic is not None:
            with timer("update_critic"):
                metrics.update(run_update(self.critic, self.optimizer_step, batch, self.value_objective,
                                          self.update_plan, self.update_generator, self.dist, self.autocast))
        with timer("update_actor"):
            metrics.update((collected.update or self.actor_update(len(batch))).finish(batch))
            release_host_memory(self.device)  # what the update freed (gradients, activations): perf/memory.py
        metrics["actor/lr"] = self.optimizer.param_groups[0]["lr"]
        with timer("update_weights"):
            metrics.update(self.rollouts.sync_weights(version=self.step + 1))  # the policy after this update
        metrics.update(self.rollouts.step_metrics())
        metrics.update(collected.stream_metrics)
        return metrics, work

    def actor_update(self, rows: int) -> UpdateRun:
        """The actor's update over ``rows`` rows, its mini-batches run as they are given (`UpdateRun`)."""
        return UpdateRun(self.policy, self.optimizer_step, self.policy_objective, self.update_plan,
                         self.update_generator, self.dist, self.autocast, rows, self.device)

    # -------------------------------------------------------------------------------- around the loop
    def engine_with_current_weights(self):
        """What evaluation answers with: a multi-turn run's episodes (`AgentRollouts.episodes`, or standalone
        `EvaluationEpisodes` on the trainer's engine: evaluated as it trains), else the trainer's engine, its
        decode layout refreshed where no weight sync does it: standalone, the workers get the pushes and the
        fused optimizer's in-place updates leave no trace a stale check could see (fused AdamW does not move the
        parameters' ``_version`` counters), so evaluation would decode the first step's weights."""
        if isinstance(self.rollouts, AgentRollouts):
            return self.rollouts
        if not isinstance(self.rollouts, ColocatedRollouts):
            getattr(self.engine, "refresh_weights", lambda: 0)()
            if self.cfg.rollout.agent.env:  # the workers run the training episodes; evaluation runs its own
                return EvaluationEpisodes(self.cfg, self.tokenizer, self.engine)
        return self.engine

    def evaluate(self) -> dict[str, float]:
        self.policy.eval()
        with self.timer("eval"):
            local = evaluate(
                self.engine_with_current_weights(), self.tokenizer, self.val_rows, self.reward,
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
            self.engine_with_current_weights(), self.tokenizer, self.val_rows, self.reward, cfg.rollout.max_new_tokens, cfg.trainer.val_n,
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
        return self.rollout_phase.feed.state_dict()

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
            # A Ctrl-C reaches the workers too (the terminal's process group, torchrun's forwarding): they keep
            # serving, as the trainer finishes its step, saves and sends them STOP; a second one stops at once.
            with StopSignals():
                RolloutWorker(cfg, resolve_device(cfg.trainer.device), ctx.rollout_group).serve()
            return {}
        return RLTrainer(cfg, ctx).fit()

    return run_reporting_failures(run, run_output_dir(cfg, RLTrainer.kind) / CHECKPOINTS_DIR)
