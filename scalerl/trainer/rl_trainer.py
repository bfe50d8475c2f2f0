"""The RL trainer: GRPO by default, PPO with a critic and GAE as the second estimator.

One step: prompts -> rollouts (``n`` per prompt) -> rewards -> old (and reference) log-probs ->
advantages -> ``ppo_epochs`` x mini-batches x micro-batches of PPO-clip (`run_update`) -> weight sync to
the engine -> metrics, reduced over ranks as each declares. The same code runs on every layout: the model
parts from `parallelize` hide whether this rank trains a whole model or pipeline stages.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from scalerl import checkpoint
from scalerl.algorithms.advantages import gae_advantages, grpo_advantages
from scalerl.comm.gradient_reducer import merged_comm_metrics
from scalerl.core.config import Config, config_to_dict
from scalerl.core.device import Autocast, compute_dtype, grad_scaler, resolve_device
from scalerl.core.rng_state import seed_everything
from scalerl.data.prompts import encode_prompts
from scalerl.data.sources import PromptStream, reward_from_config, rows_from_config
from scalerl.models.load import load_model_and_tokenizer
from scalerl.models.value_model import ValueModel
from scalerl.parallel.distributed import init_distributed
from scalerl.parallel.metric_reduction import reduce_metrics
from scalerl.parallel.parallelize import PipelineOptions, parallelize
from scalerl.perf.memory import max_memory_gb
from scalerl.perf.mfu import RankShare, StepWork, step_mfu
from scalerl.perf.timing import StepTimer
from scalerl.rollout.batch import RolloutBatch
from scalerl.rollout.builtin_engine import BuiltinEngine
from scalerl.rollout.engine import SamplingParams
from scalerl.tracking import MetricsLogger, plot_metrics
from scalerl.trainer.evaluation import evaluate
from scalerl.trainer.forward_passes import response_logprobs, response_values
from scalerl.trainer.layout_checks import check_rl_layout
from scalerl.trainer.objectives import PolicyObjective, ValueObjective
from scalerl.trainer.optim import build_optimizer
from scalerl.trainer.rollout_rebalance import rebalance_batch
from scalerl.trainer.update import OptimizerStep, UpdatePlan, run_update

# Config keys a resumed run must share with the checkpoint it resumes (others, e.g. total_steps, may change).
RESUME_MUST_MATCH = [
    "model.path", "model.hidden_size", "model.num_hidden_layers", "model.num_attention_heads",
    "model.num_key_value_heads", "model.intermediate_size", "algorithm.adv_estimator", "trainer.init_from",
]


class RLTrainer:
    def __init__(self, cfg: Config):
        cfg.validate()
        self.cfg = cfg
        t, a, r = cfg.trainer, cfg.actor, cfg.rollout
        seed_everything(t.seed)
        self.device = resolve_device(t.device)
        self.dist = init_distributed(cfg.parallel, self.device)
        check_rl_layout(cfg, self.dist)
        self.output_dir = Path(t.output_dir)
        model, self.tokenizer = load_model_and_tokenizer(cfg.model, t.init_from, self.device, t.seed)
        self.model_config = model.config
        self.autocast = Autocast(t.precision, self.device)
        # The critic and the frozen reference start as copies of the policy, made before it is laid out.
        critic = ValueModel(model) if cfg.algorithm.adv_estimator == "gae" else None
        reference = copy.deepcopy(model).requires_grad_(False) if a.use_kl_loss else None
        layout = dict(activation_checkpointing=cfg.model.activation_checkpointing, autocast=self.autocast,
                      pipeline=PipelineOptions(cfg.parallel.pp_schedule, cfg.parallel.microbatches), comm=cfg.comm)
        self.policy = parallelize(model, self.dist, **layout)
        self.critic = parallelize(critic, self.dist, **layout) if critic is not None else None
        self.reference = parallelize(reference, self.dist, trainable=False) if reference is not None else None
        if self.reference is not None:
            self.reference.eval()

        self.train_rows = rows_from_config(cfg.data, "train", t.seed)
        self.val_rows = self.dist.dp_share(rows_from_config(cfg.data, "test", t.seed))
        self.reward = reward_from_config(cfg.data)
        self.stream = PromptStream(self.train_rows, t.batch_size, t.seed, cfg.data.shuffle)
        self.engine = self._build_engine()

        # One optimizer for the policy and the critic; each update zeroes all gradients first, so a step
        # only moves the parameters that got gradients.
        param_sets = [(self.policy.parameters(), a.lr)]
        if self.critic is not None:
            param_sets.append((self.critic.parameters(), cfg.critic.lr))
        self.optimizer, self.scheduler = build_optimizer(
            param_sets, a.weight_decay, betas=tuple(a.betas), warmup_steps=a.warmup_steps,
            total_steps=t.total_steps, schedule=a.lr_schedule, min_lr_ratio=a.min_lr_ratio,
        )
        self.scaler = grad_scaler(t.precision, self.device)
        self.optimizer_step = OptimizerStep(self.optimizer, self.scaler, a.grad_clip)
        self.policy_objective = PolicyObjective(a, r.temperature)
        self.value_objective = ValueObjective(cfg.critic, a.loss_agg_mode)
        self.update_plan = UpdatePlan(
            epochs=a.ppo_epochs, mini_batch_size=a.ppo_mini_batch_size // self.dist.dp_size,
            micro_batch_size=a.ppo_micro_batch_size, micro_batch_max_tokens=a.micro_batch_max_tokens,
            horizon=r.max_new_tokens, fixed_widths=(cfg.data.max_prompt_length, r.max_new_tokens),
        )
        self.update_generator = torch.Generator().manual_seed(t.seed + 1)
        self.timer = StepTimer(self.device)
        self.step = 0
        self.checkpoint_root = self.output_dir / "checkpoints"
        resume_from = checkpoint.resolve_resume(t.resume, self.checkpoint_root)
        if resume_from is not None:
            loaded = checkpoint.load(
                resume_from, ctx=self.dist, model=self._state_module(), optimizer=self.optimizer,
                scheduler=self.scheduler, grad_scaler=self.scaler, generators={"update": self.update_generator},
                expected_config=config_to_dict(cfg), strict_config_keys=RESUME_MUST_MATCH,
            )
            self.step = loaded.step
            self.stream.load_state_dict(loaded.trainer_state["data"])
            self.policy.refresh_generation_copy()  # rollouts must start from the restored weights
        self.logger = MetricsLogger(
            self.output_dir, backends=t.logger if self.dist.is_main else [], total_steps=t.total_steps,
            config=config_to_dict(cfg) if self.dist.is_main else None,
            resume_step=self.step + 1 if resume_from is not None else 0,  # a fresh run starts fresh files
        )

    def _build_engine(self):
        if self.cfg.rollout.engine == "builtin":
            return BuiltinEngine(self.policy.model, self.tokenizer.pad_token_id, all_finished=self.dist.all_finished)
        from scalerl.rollout.vllm_engine import VLLMEngine

        source = self.cfg.trainer.init_from or self.cfg.model.path
        if not source:
            raise ValueError("rollout.engine=vllm needs model.path (vLLM loads the model directory itself)")
        return VLLMEngine(source, self.tokenizer.pad_token_id)

    def _state_module(self) -> nn.Module:
        """What a checkpoint holds on this rank: the policy (or its pipeline stages), and the critic."""
        modules = nn.ModuleDict({"actor": self.policy.state_module()})
        if self.critic is not None:
            modules["critic"] = self.critic.state_module()
        return modules

    # ------------------------------------------------------------------------------------------ one step
    def _sampling(self) -> SamplingParams:
        r = self.cfg.rollout
        # The seed is a function of the step, so a resumed run samples exactly what the original did.
        return SamplingParams(
            max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
            stop_token_ids=self.tokenizer.stop_token_ids, seed=self.cfg.trainer.seed * 1_000_003 + self.step,
            row_offset=self.dist.dp_rank * self.cfg.trainer.batch_size // self.dist.dp_size * r.n,
            total_rows=self.cfg.trainer.batch_size * r.n,
        )

    def _encode(self, rows: list[dict]) -> list[list[int]]:
        prompts = encode_prompts(self.tokenizer, [r["prompt"] for r in rows], self.cfg.data.chat_template)
        limit = self.cfg.data.max_prompt_length
        for row, ids in zip(rows, prompts):
            if len(ids) > limit:
                raise ValueError(
                    f"prompt of {len(ids)} tokens exceeds data.max_prompt_length={limit}: {row['prompt'][:80]!r}; "
                    "raise data.max_prompt_length or shorten the prompts"
                )
        return prompts

    def _rollout(self) -> tuple[RolloutBatch, dict[str, float]]:
        cfg, timer = self.cfg, self.timer
        rows = self.dist.dp_share(self.stream.next_batch())  # every rank draws the global batch, keeps its part
        n = cfg.rollout.n
        prompts = [p for p in self._encode(rows) for _ in range(n)]
        group_ids = torch.arange(len(rows)).repeat_interleave(n)
        self.policy.eval()
        with timer("gen"):
            out = self.engine.generate(prompts, self._sampling())
        with timer("reward"):
            texts = self.tokenizer.batch_decode(out.response_ids.tolist())
            scores, failures = self.reward.compute(texts, [rows[i // n] for i in range(len(prompts))])
        batch = RolloutBatch.from_generation(out, group_ids, torch.tensor(scores, dtype=torch.float32))
        lengths = out.response_lengths.float()
        metrics = {  # per rank here; `reduce_metrics` combines them over ranks
            "critic/score/mean": float(batch.scores.mean()),
            "critic/score/max": float(batch.scores.max()),
            "critic/score/min": float(batch.scores.min()),
            "reward/num_failures": float(failures),
            "response_length/mean": float(lengths.mean()),
            "response_length/max": float(lengths.max()),
            "response_length/clip_ratio": sum(r == "length" for r in out.finish_reasons) / len(prompts),
        }
        return batch, metrics

    def _advantages(self, batch: RolloutBatch) -> None:
        alg, micro = self.cfg.algorithm, self.cfg.actor.ppo_micro_batch_size
        token_rewards = batch.token_rewards()
        if self.critic is None:
            batch.advantages, batch.returns = grpo_advantages(
                token_rewards, batch.response_mask, batch.group_ids, norm_by_std=alg.norm_adv_by_std_in_grpo
            )
            return
        batch.values = response_values(self.critic.model, batch, micro, self.autocast)
        batch.advantages, batch.returns = gae_advantages(
            token_rewards, batch.values, batch.response_mask, alg.gamma, alg.lam,
            all_reduce=self.dist.all_reduce if self.dist.dp_size > 1 else None,
        )

    def train_step(self) -> dict[str, float]:
        cfg, timer, a = self.cfg, self.timer, self.cfg.actor
        temperature, micro = cfg.rollout.temperature or 1.0, a.ppo_micro_batch_size
        step_start = time.perf_counter()
        batch, metrics = self._rollout()
        # The engine's log-probs equal an fp32 training forward where it says so; otherwise (autocast,
        # another engine) the numerics differ and they are recomputed.
        reuse_logprobs = self.engine.logprobs_match_training_forward and cfg.trainer.precision == "fp32"
        with timer("old_log_prob"):
            if reuse_logprobs:
                batch.old_logprobs = batch.rollout_logprobs
            else:
                batch.old_logprobs = response_logprobs(self.policy.model, batch, temperature, micro, self.autocast)
        if self.reference is not None:
            with timer("ref"):
                batch.ref_logprobs = response_logprobs(self.reference.model, batch, temperature, micro, self.autocast)
        with timer("adv"):
            self._advantages(batch)
        work = self._work(batch, forward_passes=int(not reuse_logprobs) + (self.reference is not None)
                          + (self.critic is not None))
        if self.dist.dp_size > 1 and cfg.trainer.balance_batch:
            with timer("balance"):
                batch, balance_metrics = rebalance_batch(batch, self.dist, cfg.trainer.batch_size // self.dist.dp_size)
            metrics.update(balance_metrics)
        if self.critic is not None:
            with timer("update_critic"):
                metrics.update(run_update(self.critic, self.optimizer_step, batch, self.value_objective,
                                          self.update_plan, self.update_generator, self.dist, self.autocast))
        with timer("update_actor"):
            metrics.update(run_update(self.policy, self.optimizer_step, batch, self.policy_objective,
                                      self.update_plan, self.update_generator, self.dist, self.autocast))
        metrics["actor/lr"] = self.optimizer.param_groups[0]["lr"]
        metrics.update(merged_comm_metrics([p.gradient_reducer for p in (self.policy, self.critic)
                                            if p is not None and p.gradient_reducer is not None]))
        self.scheduler.step()
        with timer("update_weights"):
            metrics["comm/weight_sync_bytes"] = float(self._sync_engine_weights())
        step_time = time.perf_counter() - step_start
        metrics.update(self.timer.pop())
        metrics["timing_s/step"] = step_time
        metrics.update(self._performance(work, metrics, step_time))
        return reduce_metrics(metrics, self.dist)

    def _sync_engine_weights(self) -> int:
        """Bring the generating weights up to date: the pipeline replica from the stages, and an engine
        with its own copy of the weights from the policy. Returns the bytes moved."""
        moved = self.policy.refresh_generation_copy()
        if not self.engine.shares_trainer_weights:
            moved += self.engine.sync_weights({n: p.detach() for n, p in self.policy.model.named_parameters()})
        return moved

    def _work(self, batch: RolloutBatch, forward_passes: int) -> StepWork:
        response_tokens = int(batch.response_mask.sum())
        prompt_tokens = int(batch.attention_mask.sum()) - response_tokens
        updates = self.cfg.actor.ppo_epochs * (2 if self.critic is not None else 1)
        return StepWork(prompt_tokens, response_tokens, prompt_tokens / len(batch), response_tokens / len(batch),
                        forward_passes=forward_passes, update_passes=updates)

    def _performance(self, work: StepWork, metrics: dict[str, float], step_time: float) -> dict[str, float]:
        tokens = work.prompt_tokens + work.response_tokens
        seconds = {"step": step_time, "gen": metrics.get("timing_s/gen", 0.0),
                   "update": metrics.get("timing_s/update_actor", 0.0) + metrics.get("timing_s/update_critic", 0.0)}
        dims = self.dist.dims
        dtype = compute_dtype(self.cfg.trainer.precision, getattr(torch, self.cfg.model.dtype))
        return {
            "perf/total_num_tokens": float(tokens),
            "perf/time_per_step": step_time,
            "perf/throughput": tokens / step_time,
            **step_mfu(self.model_config, work, seconds, RankShare(dims.tp, dims.pp), self.device, dtype),
            "perf/max_memory_gb": max_memory_gb(self.device),
        }

    # ----------------------------------------------------------------------------------------- the loop
    def evaluate(self) -> dict[str, float]:
        self.policy.eval()
        with self.timer("eval"):
            local = evaluate(
                self.engine, self.tokenizer, self.val_rows, self.reward, self.cfg.rollout.max_new_tokens,
                temperature=self.cfg.rollout.val_temperature, seed=self.cfg.trainer.seed,
                chat_template=self.cfg.data.chat_template,
            )
        return reduce_metrics(local, self.dist)  # equal shards, so the mean of rank means is the mean

    def save(self) -> Path:
        return checkpoint.save(
            self.checkpoint_root, self.step, ctx=self.dist, model=self._state_module(), optimizer=self.optimizer,
            scheduler=self.scheduler, grad_scaler=self.scaler, generators={"update": self.update_generator},
            trainer_state={"step": self.step, "data": self.stream.state_dict()},
            config=config_to_dict(self.cfg), keep_last=self.cfg.trainer.keep_last,
        )

    def fit(self) -> dict[str, Any]:
        t = self.cfg.trainer
        summary: dict[str, Any] = {}
        try:
            if self.step == 0 and self.val_rows:
                summary["initial"] = self.evaluate()
                self.logger.log({**summary["initial"], **reduce_metrics(self.timer.pop(), self.dist)}, step=0)
            while self.step < t.total_steps:
                metrics = self.train_step()
                self.step += 1
                last = self.step == t.total_steps
                if self.val_rows and (last or (t.eval_every and self.step % t.eval_every == 0)):
                    metrics.update(self.evaluate())
                    metrics.update(reduce_metrics(self.timer.pop(), self.dist))
                self.logger.log(metrics, step=self.step)
                if (t.save_every and self.step % t.save_every == 0) or last:
                    self.save()
                summary["last"] = metrics
            final_dir = checkpoint.export_hf_model(self.policy.model, self.tokenizer, self.output_dir / "final", self.dist)
            summary["final_model"] = str(final_dir)
            if "jsonl" in t.logger and self.dist.is_main:
                summary["plot"] = str(plot_metrics(self.output_dir / "metrics.jsonl", self.output_dir / "metrics.png"))
        finally:
            self.logger.close()
        return summary


def train(cfg: Config) -> dict[str, Any]:
    """Run RL training as configured; returns initial/last metrics and output paths."""
    return RLTrainer(cfg).fit()
