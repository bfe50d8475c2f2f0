"""Supervised fine-tuning on prompt/response pairs (loss on response tokens only), used for warm starts.

One step (`SFTTrainer.run_step`): this rank's share of ``sft.batch_size`` demonstrations -> one mini-batch
of `run_update`. The run around it is `scalerl.trainer.run.TrainingRun`'s, as for RL: the same layout
(`parallelize`), checkpoints every ``trainer.save_every`` steps, ``trainer.resume=auto`` with
bitwise-identical continuation; held-out accuracy at the last step.
"""

from __future__ import annotations

from typing import Any, Callable

from scalerl.core.config import Config
from scalerl.data.prompts import encode_demonstrations
from scalerl.data.sources import PromptStream, reward_from_config, rows_from_config, split_origin
from scalerl.parallel.distributed import DistContext
from scalerl.parallel.metric_reduction import reduce_metrics
from scalerl.perf.memory import max_memory_gb
from scalerl.perf.mfu import StepWork
from scalerl.perf.timing import StepTimer
from scalerl.rollout.batch import RolloutBatch
from scalerl.rollout.engines.builtin import BuiltinEngine
from scalerl.trainer.evaluation import evaluate
from scalerl.trainer.objectives import SFTObjective
from scalerl.trainer.optim import build_optimizer
from scalerl.trainer.run import TrainingRun, run_output_dir, start_run, step_work
from scalerl.trainer.run_checks import check_sft_layout
from scalerl.trainer.run_directory import CHECKPOINTS_DIR, say
from scalerl.trainer.run_failures import run_reporting_failures
from scalerl.trainer.update import OptimizerStep, UpdatePlan, run_update

RESUME_MUST_MATCH = [
    "model.path", "model.hidden_size", "model.num_hidden_layers", "model.num_attention_heads",
    "model.num_key_value_heads", "model.intermediate_size", "trainer.init_from", "data.train_files",
]


def compression_warning(cfg: Config, dp_size: int) -> str | None:
    """Said at start when SFT trains a fresh model with top-k gradient compression: measured on the demo,
    it ended 16-36 points of held-out accuracy below dense where PowerSGD and bf16 did not."""
    if cfg.comm.gradient_compression != "topk" or cfg.trainer.init_from is not None or dp_size <= 1:
        return None
    return ("top-k gradient compression on SFT from a freshly initialised model ended 16-36 points of "
            "held-out accuracy below dense on the demo (docs/comm-compression.md); "
            "comm.gradient_compression=powersgd or bf16 kept dense's accuracy there")


class SFTTrainer(TrainingRun):
    kind, export_name, export_key, skipped_prefix = "sft", "model", "model_dir", "sft"

    def __init__(self, cfg: Config, ctx: DistContext, *, timer: StepTimer | None = None,
                 wrap_optimizer_step: Callable[[OptimizerStep], OptimizerStep] | None = None):
        """The trainer on ``ctx`` (`start_run`'s), trusting ``cfg`` (checked there)."""
        s, t = cfg.sft, cfg.trainer
        check_sft_layout(cfg, ctx)
        super().__init__(cfg, ctx, total_steps=s.steps, eval_every=0, timer=timer)
        model = self.load_model()
        warning = compression_warning(cfg, ctx.dp_size)
        if warning:
            say(ctx, warning, warning=True)
        self.policy = self.lay_out(model)
        self.trained = {"actor": self.policy}
        files = cfg.data.train_files
        source = f"data.train_files ({', '.join(files)})" if files else f"the built-in {cfg.data.task} task"
        self.examples = encode_demonstrations(self.tokenizer, rows_from_config(cfg.data, "train", t.seed),
                                              cfg.data.chat_template, model.config.max_position_embeddings,
                                              source)
        self.val_rows = ctx.dp_share(rows_from_config(cfg.data, "test", t.seed))
        self.stream = PromptStream(list(range(len(self.examples))), s.batch_size, t.seed, cfg.data.shuffle,
                                   batch_key="sft.batch_size")
        self.use_optimizer(*build_optimizer(
            [(self.policy.parameters(), s.lr)], s.weight_decay, warmup_steps=s.warmup_steps, total_steps=s.steps,
            schedule=s.lr_schedule,
        ), s.grad_clip, wrap_optimizer_step)
        self.objective = SFTObjective()
        # One optimizer step per SFT step over this rank's share, in order; pipeline stages see one shape
        # (the widest prompt and response of the data) every step.
        self.update_plan = UpdatePlan(
            epochs=1, mini_batch_size=s.batch_size // ctx.dp_size, micro_batch_size=s.micro_batch_size,
            shuffle=False, fixed_widths=(max(len(p) for p, _ in self.examples), max(len(r) for _, r in self.examples)),
        )
        self.engine = BuiltinEngine(self.policy.model, self.tokenizer.pad_token_id, all_finished=ctx.all_finished)
        self.reward = reward_from_config(cfg.data, self.device)
        self.reward.check_split(self.val_rows[:8], split_origin(cfg.data, "test"))
        self.resume(RESUME_MUST_MATCH)
        self.start_logging()

    def run_step(self) -> tuple[dict[str, float], StepWork]:
        """A batch of demonstrations -> one update."""
        with self.timer("data"):
            rows = self.dist.dp_share(self.stream.next_batch())  # each rank draws the global batch, keeps its part
            batch = RolloutBatch.from_demonstrations(
                [self.examples[i][0] for i in rows], [self.examples[i][1] for i in rows], self.tokenizer.pad_token_id
            ).to(self.device)
        with self.timer("update"):
            metrics = run_update(self.policy, self.optimizer_step, batch, self.objective, self.update_plan, None,
                                 self.dist, self.autocast)
        metrics["sft/lr"] = self.optimizer.param_groups[0]["lr"]
        return metrics, step_work(batch)

    def performance_metrics(self, work: StepWork, timings: dict[str, float], step_time: float) -> dict[str, float]:
        """SFT's ``perf/*``: throughput, the update's MFU as ``perf/mfu``, peak memory."""
        tokens = work.prompt_tokens + work.response_tokens
        mfu = self.mfu(work, {"update": timings["timing_s/update"]}, self.device)
        return {"perf/throughput": tokens / step_time, "perf/mfu": mfu["perf/mfu/update"],
                "perf/max_memory_gb": max_memory_gb(self.device)}

    def evaluate(self) -> dict[str, float]:
        self.policy.refresh_generation_copy()  # a pipeline's replica reads the stages' latest weights
        self.policy.eval()
        local = evaluate(self.engine, self.tokenizer, self.val_rows, self.reward, self.cfg.rollout.max_new_tokens,
                         seed=self.cfg.trainer.seed, chat_template=self.cfg.data.chat_template)
        return reduce_metrics(local, self.dist)

    def export(self) -> dict[str, str]:
        self.policy.refresh_generation_copy()
        return super().export()


def train_sft(cfg: Config) -> dict[str, Any]:
    """Run SFT as configured by the ``sft`` section (model/data/trainer sections as for RL); returns the
    last step's metrics and the exported model's directory (``model_dir``)."""
    ctx = start_run(cfg, SFTTrainer.kind)
    checkpoint_root = run_output_dir(cfg, SFTTrainer.kind) / CHECKPOINTS_DIR
    return run_reporting_failures(lambda: SFTTrainer(cfg, ctx).fit(), checkpoint_root)
