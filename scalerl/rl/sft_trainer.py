"""Supervised fine-tuning on prompt/response pairs (loss on response tokens only), used for warm starts."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import torch

from scalerl.config import Config, config_to_dict
from scalerl.data.sources import PromptStream, reward_from_config, rows_from_config
from scalerl.parallel.distributed import init_distributed, reduce_metrics
from scalerl.parallel.grad_norm import clip_grad_norm, trainable_parameters
from scalerl.parallel.parallelize import parallelize, shard_pipeline_stage
from scalerl.parallel.pipeline import PipelineRunner
from scalerl.parallel.sharding import check_distributed_config, shard_rows
from scalerl.rl.entropy import logprobs_from_logits
from scalerl.rl.evaluation import evaluate
from scalerl.rl.optim import build_optimizer
from scalerl.rl.pipeline_update import SFTLossOnLastStage, sft_step_pipeline
from scalerl.rl.policy import encode_prompts, load_policy, resolve_device, save_policy
from scalerl.rl.runtime import AutocastFactory, grad_scaler, max_memory_gb, seed_everything
from scalerl.rollout.builtin_engine import BuiltinEngine
from scalerl.tracking import MetricsLogger


def sft_example(tokenizer: Any, row: dict, chat_template: bool = False) -> tuple[list[int], int]:
    """Token ids of ``prompt + response + eos`` and the prompt's length (tokens before it carry no loss)."""
    prompt = encode_prompts(tokenizer, [row["prompt"]], chat_template)[0]
    return prompt + tokenizer.encode(row["response"]) + [tokenizer.eos_token_id], len(prompt)


def collate(examples: list[tuple[list[int], int]], pad_token_id: int, width: int | None = None) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``/``attention_mask`` and ``loss_mask`` marking the tokens to predict
    (``width``: pad to this many columns instead of the longest example)."""
    width = width or max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
    loss_mask = torch.zeros((len(examples), width), dtype=torch.float32)
    for i, (ids, prompt_len) in enumerate(examples):
        input_ids[i, : len(ids)] = torch.as_tensor(ids)
        attention_mask[i, : len(ids)] = 1
        loss_mask[i, prompt_len : len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}


def sft_loss(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], num_tokens: torch.Tensor, dp_size: int = 1
) -> torch.Tensor:
    """Next-token cross-entropy summed over loss tokens and divided by the global batch's count (all
    micro-batches, all DP ranks), times the DP size that gradient averaging divides by: micro-batch and
    rank losses then add up to the global token-mean."""
    logits = model(batch["input_ids"], attention_mask=batch["attention_mask"])[:, :-1].float()
    logp = logprobs_from_logits(logits, batch["input_ids"][:, 1:])
    mask = batch["loss_mask"][:, 1:]
    return -(logp * mask).sum() / num_tokens * dp_size


def train_sft(cfg: Config) -> dict[str, Any]:
    """Run SFT as configured by the ``sft`` section (model/data/trainer sections as for RL)."""
    cfg.validate()
    s, t = cfg.sft, cfg.trainer
    seed_everything(t.seed)
    device = resolve_device(t.device)
    ctx = init_distributed(cfg.parallel, device)
    check_distributed_config(cfg, ctx)
    out_dir = Path(s.output_dir or Path(t.output_dir) / "sft")
    model, tokenizer = load_policy(cfg, device, t.seed)
    pipeline = None
    if ctx.dims.pp > 1:  # stages are cut from the unsharded model, before it becomes the replica
        pipeline_loss = SFTLossOnLastStage()
        pipeline = PipelineRunner(model, ctx, cfg.parallel.pp_schedule, cfg.parallel.microbatches, pipeline_loss,
                                  lambda stage: shard_pipeline_stage(stage, ctx))
    train_model = parallelize(model, ctx, cfg.model.activation_checkpointing)
    train_rows = rows_from_config(cfg.data, "train", t.seed)
    val_rows = shard_rows(rows_from_config(cfg.data, "test", t.seed), ctx)
    examples = [sft_example(tokenizer, row, cfg.data.chat_template) for row in train_rows]
    stream = PromptStream(list(range(len(examples))), s.batch_size, t.seed, cfg.data.shuffle)
    optimizer, scheduler = build_optimizer(
        [(pipeline.parameters() if pipeline else model.parameters(), s.lr)], s.weight_decay, warmup_steps=s.warmup_steps, total_steps=s.steps,
        schedule=s.lr_schedule,
    )
    autocast = AutocastFactory(t.precision, device) if t.precision != "fp32" else contextlib.nullcontext()
    scaler = grad_scaler(t.precision, device)
    engine = BuiltinEngine(model, tokenizer.pad_token_id, all_finished=ctx.all_finished)
    reward = reward_from_config(cfg.data)
    pipeline_width = max(len(ids) for ids, _ in examples) if pipeline else None
    summary: dict[str, Any] = {}

    def run_eval() -> dict[str, float]:
        if not val_rows:
            return {}
        return reduce_metrics(evaluate(engine, tokenizer, val_rows, reward, cfg.rollout.max_new_tokens, seed=t.seed,
                                       chat_template=cfg.data.chat_template), ctx)

    backends = t.logger if ctx.is_main else []
    with MetricsLogger(out_dir, backends=backends, total_steps=s.steps, config=config_to_dict(cfg), resume_step=0) as logger:
        for step in range(1, s.steps + 1):
            start = time.perf_counter()
            model.train()
            local = shard_rows(stream.next_batch(), ctx)  # each rank draws the global batch, keeps its part
            # Pipeline stages fix activation shapes at their first step: pad every batch to one width.
            batch = collate([examples[i] for i in local], tokenizer.pad_token_id, pipeline_width)
            batch = {k: v.to(device) for k, v in batch.items()}
            num_tokens = ctx.all_reduce(batch["loss_mask"][:, 1:].sum()).clamp(min=1)
            optimizer.zero_grad(set_to_none=True)
            loss_total = torch.zeros((), device=device)
            starts = [] if pipeline else list(range(0, len(local), s.micro_batch_size))
            if pipeline is not None:  # parallel.microbatches replaces sft.micro_batch_size here
                loss_total += sft_step_pipeline(pipeline, batch, pipeline_loss, num_tokens, ctx)
            for i, lo in enumerate(starts):
                micro = {k: v[lo : lo + s.micro_batch_size] for k, v in batch.items()}
                with autocast:
                    loss = sft_loss(train_model, micro, num_tokens, ctx.dp_size)
                no_sync = getattr(train_model, "no_sync", None) if i < len(starts) - 1 else None
                with no_sync() if no_sync else contextlib.nullcontext():
                    (scaler.scale(loss) if scaler else loss).backward()
                loss_total += loss.detach()
            if scaler:
                scaler.unscale_(optimizer)
            if pipeline is not None:
                grad_norm = clip_grad_norm(pipeline.parameters(), s.grad_clip, pipeline.norm_parameters(), pipeline.pp_group)
            else:
                grad_norm = clip_grad_norm(trainable_parameters(model), s.grad_clip)
            if scaler:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            if pipeline is not None:
                pipeline.refresh_replica()  # evaluation and the saved model read the full replica
            lr = optimizer.param_groups[0]["lr"]
            scheduler.step()
            elapsed = time.perf_counter() - start
            tokens = int(batch["attention_mask"].sum())
            metrics = {
                "sft/loss": float(loss_total), "sft/grad_norm": float(grad_norm), "sft/lr": lr,
                "timing_s/step": elapsed, "perf/throughput": tokens / elapsed,
                "perf/max_memory_gb": max_memory_gb(device),
            }
            metrics = reduce_metrics(metrics, ctx)
            if step == s.steps:
                metrics.update(run_eval())
                summary["final"] = metrics
            logger.log(metrics, step=step)
    summary["model_dir"] = str(save_policy(model, tokenizer, out_dir / "model", ctx))
    return summary
