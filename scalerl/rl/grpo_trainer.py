"""The RL trainer loop (GRPO by default, PPO with a critic and GAE as the second estimator).

One step: prompts -> rollouts (``n`` per prompt) -> rewards -> old (and reference) log-probs ->
advantages -> ``ppo_epochs`` x mini-batches x micro-batches of PPO-clip -> weight sync -> metrics.
"""

from __future__ import annotations

import copy
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from scalerl.checkpoint import load_checkpoint, resolve_resume, save_checkpoint
from scalerl.config import Config, config_to_dict
from scalerl.data.sources import PromptStream, reward_from_config, rows_from_config
from scalerl.diagnose.flops import mfu
from scalerl.parallel.dcp_checkpoint import load_distributed_checkpoint, save_distributed_checkpoint
from scalerl.parallel.distributed import init_distributed, reduce_metrics
from scalerl.parallel.parallelize import parallelize, shard_pipeline_stage
from scalerl.parallel.pipeline import PipelineRunner
from scalerl.parallel.rebalance import rebalance_batch
from scalerl.parallel.sharding import check_distributed_config, shard_rows
from scalerl.rl.actor import compute_logprobs, update_policy
from scalerl.rl.advantages import gae_advantages, grpo_advantages
from scalerl.rl.batch import RolloutBatch
from scalerl.rl.critic import ValueModel, compute_values, parallelize_critic, update_critic
from scalerl.rl.evaluation import evaluate
from scalerl.rl.optim import build_optimizer
from scalerl.rl.pipeline_update import PolicyLossOnLastStage, update_policy_pipeline
from scalerl.rl.policy import encode_prompts, load_policy, resolve_device, save_policy
from scalerl.rl.runtime import AutocastFactory, StepTimer, grad_scaler, max_memory_gb, seed_everything
from scalerl.rollout.builtin_engine import BuiltinEngine
from scalerl.rollout.engine import SamplingParams
from scalerl.tracking import MetricsLogger, plot_metrics

# Config keys a resumed run must share with the checkpoint it resumes (others, e.g. total_steps, may change).
RESUME_MUST_MATCH = [
    "model.path", "model.hidden_size", "model.num_hidden_layers", "model.num_attention_heads",
    "model.num_key_value_heads", "model.intermediate_size", "algorithm.adv_estimator", "trainer.init_from",
]


class RLTrainer:
    def __init__(self, cfg: Config):
        cfg.validate()
        self.cfg = cfg
        t = cfg.trainer
        seed_everything(t.seed)
        self.device = resolve_device(t.device)
        self.dist = init_distributed(cfg.parallel, self.device)
        check_distributed_config(cfg, self.dist)
        self.output_dir = Path(t.output_dir)
        self.model, self.tokenizer = load_policy(cfg, self.device, t.seed)
        self.ref_model = None
        if cfg.actor.use_kl_loss:  # a frozen copy of the initial policy, laid out like the policy
            self.ref_model = copy.deepcopy(self.model).requires_grad_(False)
            self.ref_model = parallelize(self.ref_model, self.dist, trainable=False).eval()
        self.pipeline = None
        if self.dist.dims.pp > 1:  # stages are cut from the unsharded model, before it becomes the replica
            self.pipeline_loss = PolicyLossOnLastStage(cfg.actor, cfg.rollout.temperature or 1.0, cfg.rollout.max_new_tokens)
            self.pipeline = PipelineRunner(
                self.model, self.dist, cfg.parallel.pp_schedule, cfg.parallel.microbatches, self.pipeline_loss,
                lambda stage: shard_pipeline_stage(stage, self.dist),
            )
        critic = ValueModel(self.model) if cfg.algorithm.adv_estimator == "gae" else None  # before sharding
        self.train_critic = parallelize_critic(critic, self.dist) if critic is not None else None
        self.train_model = parallelize(self.model, self.dist, cfg.model.activation_checkpointing)
        self.train_rows = rows_from_config(cfg.data, "train", t.seed)
        self.val_rows = shard_rows(rows_from_config(cfg.data, "test", t.seed), self.dist)
        self.reward = reward_from_config(cfg.data)
        self.stream = PromptStream(self.train_rows, t.batch_size, t.seed, cfg.data.shuffle)
        self.engine = self._build_engine()
        # The checkpointed module: the policy, plus the critic when PPO/GAE is on (one optimizer for both,
        # each update zeroes grads first, so a step only moves the parameters that got gradients).
        self.modules = nn.ModuleDict({"actor": self.model})
        a = cfg.actor
        if critic is not None:
            self.modules["critic"] = critic
        optim_args = dict(
            betas=tuple(a.betas), warmup_steps=a.warmup_steps, total_steps=t.total_steps,
            schedule=a.lr_schedule, min_lr_ratio=a.min_lr_ratio,
        )
        param_sets = [(self.pipeline.parameters() if self.pipeline else self.model.parameters(), a.lr)]
        if "critic" in self.modules:
            param_sets.append((self.modules["critic"].parameters(), cfg.critic.lr))
        self.optimizer, self.scheduler = build_optimizer(param_sets, a.weight_decay, **optim_args)
        self.update_generator = torch.Generator().manual_seed(t.seed + 1)
        self.autocast = AutocastFactory(t.precision, self.device) if t.precision != "fp32" else None
        self.scaler = grad_scaler(t.precision, self.device)
        self.timer = StepTimer(self.device)
        self.step = 0
        self.checkpoint_root = self.output_dir / "checkpoints"
        resume_from = resolve_resume(t.resume, self.checkpoint_root)
        if resume_from is not None:
            load = load_checkpoint if self.dist.world_size == 1 else partial(load_distributed_checkpoint, ctx=self.dist)
            loaded = load(
                resume_from, model=self._checkpointed(), optimizer=self.optimizer, scheduler=self.scheduler,
                generators={"update": self.update_generator}, expected_config=config_to_dict(cfg),
                strict_config_keys=RESUME_MUST_MATCH,
            )
            self.step = loaded.step
            self.stream.load_state_dict(loaded.trainer_state["data"])
            if self.pipeline is not None:
                self.pipeline.refresh_replica()  # rollouts must start from the restored stage weights
        self.logger = MetricsLogger(
            self.output_dir, backends=t.logger if self.dist.is_main else [], total_steps=t.total_steps,
            config=config_to_dict(cfg) if self.dist.is_main else None,
            resume_step=self.step + 1 if resume_from is not None else 0,  # a fresh run starts fresh files
        )

    def _build_engine(self):
        if self.cfg.rollout.engine == "builtin":
            return BuiltinEngine(self.model, self.tokenizer.pad_token_id, all_finished=self.dist.all_finished)
        from scalerl.rollout.vllm_engine import VLLMEngine

        source = self.cfg.trainer.init_from or self.cfg.model.path
        if not source:
            raise ValueError("rollout.engine=vllm needs model.path (vLLM loads the model directory itself)")
        return VLLMEngine(source, self.tokenizer.pad_token_id)

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

    def _rollout(self) -> tuple[RolloutBatch, dict[str, float], list[str]]:
        cfg, timer = self.cfg, self.timer
        rows = shard_rows(self.stream.next_batch(), self.dist)  # every rank draws the global batch, keeps its part
        n = cfg.rollout.n
        prompts = [p for p in self._encode(rows) for _ in range(n)]
        group_ids = torch.arange(len(rows)).repeat_interleave(n)
        self.model.eval()
        with timer("gen"):
            out = self.engine.generate(prompts, self._sampling())
        with timer("reward"):
            texts = self.tokenizer.batch_decode(out.response_ids.tolist())
            scores, failures = self.reward.compute(texts, [rows[i // n] for i in range(len(prompts))])
        batch = RolloutBatch.from_generation(out, group_ids, torch.tensor(scores, dtype=torch.float32))
        lengths = out.response_lengths.float()
        metrics = {  # per rank here; `reduce_metrics` combines them over DP
            "critic/score/mean": float(batch.scores.mean()),
            "critic/score/max": float(batch.scores.max()),
            "critic/score/min": float(batch.scores.min()),
            "reward/num_failures": float(failures),
            "response_length/mean": float(lengths.mean()),
            "response_length/max": float(lengths.max()),
            "response_length/clip_ratio": sum(r == "length" for r in out.finish_reasons) / len(prompts),
        }
        return batch, metrics, texts

    def train_step(self) -> dict[str, float]:
        cfg, timer = self.cfg, self.timer
        a, r = cfg.actor, cfg.rollout
        step_start = time.perf_counter()
        batch, metrics, _ = self._rollout()
        micro = a.ppo_micro_batch_size
        with timer("old_log_prob"):
            # The built-in engine's log-probs equal a fp32 forward pass (tested), so recomputing them is
            # skipped there; under autocast or another engine the numerics differ and they are recomputed.
            if isinstance(self.engine, BuiltinEngine) and cfg.trainer.precision == "fp32":
                batch.old_logprobs = batch.rollout_logprobs
            else:
                batch.old_logprobs = compute_logprobs(self.train_model, batch, r.temperature or 1.0, micro, self.autocast)
        if self.ref_model is not None:
            with timer("ref"):
                batch.ref_logprobs = compute_logprobs(self.ref_model, batch, r.temperature or 1.0, micro, self.autocast)
        with timer("adv"):
            token_rewards = batch.token_rewards()
            if cfg.algorithm.adv_estimator == "grpo":
                batch.advantages, batch.returns = grpo_advantages(
                    token_rewards, batch.response_mask, batch.group_ids, norm_by_std=cfg.algorithm.norm_adv_by_std_in_grpo
                )
            else:
                batch.values = compute_values(self.train_critic, batch, micro, self.autocast)
                batch.advantages, batch.returns = gae_advantages(
                    token_rewards, batch.values, batch.response_mask, cfg.algorithm.gamma, cfg.algorithm.lam,
                    all_reduce=self.dist.all_reduce if self.dist.dp_size > 1 else None,
                )
        if self.dist.dp_size > 1 and cfg.trainer.balance_batch:
            with timer("balance"):
                batch, balance_metrics = rebalance_batch(batch, self.dist, cfg.trainer.batch_size // self.dist.dp_size)
            metrics.update(balance_metrics)
        if "critic" in self.modules:
            with timer("update_critic"):
                metrics.update(update_critic(
                    self.train_critic, self.optimizer, batch, a, cfg.critic, r.max_new_tokens,
                    self.update_generator, self.autocast, self.dist,
                ))
        with timer("update_actor"):
            if self.pipeline is not None:
                fixed = batch.padded_to(cfg.data.max_prompt_length, r.max_new_tokens)
                metrics.update(update_policy_pipeline(
                    self.pipeline, self.optimizer, fixed, a, self.pipeline_loss, self.update_generator, self.dist
                ))
            else:
                metrics.update(update_policy(
                    self.train_model, self.optimizer, batch, a, r.temperature or 1.0, r.max_new_tokens,
                    self.update_generator, self.autocast, self.scaler, self.dist,
                ))
        metrics["actor/lr"] = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step()
        with timer("update_weights"):
            if self.pipeline is not None:  # stages -> the full replica the engine generates with
                metrics["comm/weight_sync_bytes"] = float(self.pipeline.refresh_replica())
            else:
                metrics["comm/weight_sync_bytes"] = float(self.engine.sync_weights(self._weights_for_engine()))
        step_time = time.perf_counter() - step_start
        metrics.update(self.timer.pop())
        metrics["timing_s/step"] = step_time
        num_tokens = int(batch.attention_mask.sum())
        seq_len = num_tokens / len(batch)
        metrics.update({
            "perf/total_num_tokens": float(num_tokens),
            "perf/time_per_step": step_time,
            "perf/throughput": num_tokens / step_time,
            "perf/mfu": mfu(num_tokens * a.ppo_epochs, seq_len, step_time, self.model.config, device=self.device),
            "perf/max_memory_gb": max_memory_gb(self.device),
        })
        return reduce_metrics(metrics, self.dist)

    def _weights_for_engine(self) -> dict[str, torch.Tensor] | None:
        if isinstance(self.engine, BuiltinEngine):
            return None  # colocated: the engine generates with the trained parameters themselves
        return {n: p.detach() for n, p in self.model.named_parameters()}

    # ----------------------------------------------------------------------------------------- the loop
    def evaluate(self) -> dict[str, float]:
        with self.timer("eval"):
            local = evaluate(
                self.engine, self.tokenizer, self.val_rows, self.reward, self.cfg.rollout.max_new_tokens,
                temperature=self.cfg.rollout.val_temperature, seed=self.cfg.trainer.seed,
                chat_template=self.cfg.data.chat_template,
            )
        return reduce_metrics(local, self.dist)  # equal shards, so the mean of rank means is the mean

    def _checkpointed(self) -> nn.Module:
        """The modules whose state a checkpoint holds on this rank: the policy (and critic), or this rank's
        pipeline stages."""
        if self.pipeline is not None:
            return nn.ModuleDict({f"stage{s}": m for s, m in zip(self.pipeline.stage_ids, self.pipeline.modules)})
        return self.modules

    def save(self) -> Path:
        save = save_checkpoint if self.dist.world_size == 1 else partial(save_distributed_checkpoint, ctx=self.dist)
        return save(
            self.checkpoint_root, self.step, model=self._checkpointed(), optimizer=self.optimizer,
            scheduler=self.scheduler, generators={"update": self.update_generator},
            trainer_state={"step": self.step, "data": self.stream.state_dict()},
            config=config_to_dict(self.cfg), keep_last=self.cfg.trainer.keep_last,
        )

    def fit(self) -> dict[str, Any]:
        t = self.cfg.trainer
        summary: dict[str, Any] = {}
        try:
            if self.step == 0 and self.val_rows:
                summary["initial"] = self.evaluate()
                self.logger.log({**summary["initial"], **self.timer.pop()}, step=0)
            while self.step < t.total_steps:
                metrics = self.train_step()
                self.step += 1
                last = self.step == t.total_steps
                if self.val_rows and (last or (t.eval_every and self.step % t.eval_every == 0)):
                    metrics.update(self.evaluate())
                    metrics.update(self.timer.pop())
                self.logger.log(metrics, step=self.step)
                if (t.save_every and self.step % t.save_every == 0) or last:
                    self.save()
                summary["last"] = metrics
            final_dir = save_policy(self.model, self.tokenizer, self.output_dir / "final", self.dist)
            summary["final_model"] = str(final_dir)
            if "jsonl" in t.logger and self.dist.is_main:
                summary["plot"] = str(plot_metrics(self.output_dir / "metrics.jsonl", self.output_dir / "metrics.png"))
        finally:
            self.logger.close()
        return summary


def train(cfg: Config) -> dict[str, Any]:
    """Run RL training as configured; returns initial/last metrics and output paths."""
    return RLTrainer(cfg).fit()
