"""The micro-batch losses of the trainers: the policy loss chosen by name (`actor.policy_loss`, dual-clip PPO
by default), clipped value regression for the critic, token-mean cross-entropy for SFT.

Each is called as ``loss(output, target)`` on one micro-batch, by a plain forward or by the last pipeline
stage alike: ``output`` is the model's output whose last positions cover the response (logits, or values
for the critic), ``target`` the per-token tensor `target(batch)` builds from the batch fields the objective
names in ``inputs``; the loss reads them back by name (`named`). They travel as one float tensor
``[rows, response, inputs]`` because the pipeline schedule splits its target into micro-batches as one tensor. Packed (``packed_outputs``, set by
the update loop with ``actor.use_remove_padding``), ``output`` holds only the predictions of the response
tokens the loss mask marks, ``[1, M, ...]``: log-softmax and entropy run on those M tokens, and only their
per-token results go back to the ``[rows, response]`` layout the aggregation reads (`response_layout`).
Losses are normalised by the whole mini-batch's counts over all data-parallel ranks (`start_mini_batch`),
so micro-batch losses add up to the mini-batch loss and DP ranks average to the single-process gradient.
Metrics are recorded the same way, as parts that add up, and `summary` averages them over mini-batches.
"""

from __future__ import annotations

from typing import Any

import torch

from scalerl.algorithms.distillation import topk_forward_kl
from scalerl.algorithms.entropy import entropy_from_logits, logprobs_from_logits
from scalerl.algorithms.kl import kl_penalty
from scalerl.algorithms.loss_registry import POLICY_LOSSES, PolicyLoss, PolicyLossOptions
from scalerl.algorithms.losses import aggregate_loss, value_loss
from scalerl.models.packing import response_layout
from scalerl.parallel.sequence_parallel import SequenceShards
from scalerl.rollout.batch import RolloutBatch


class MicroBatchObjective:
    """Bookkeeping shared by the losses: the mini-batch's aggregation counts, metric parts per call."""

    metric_names: tuple[str, ...] = ()
    # The `RolloutBatch` fields the loss reads, in the order `target` stacks them; always with the response
    # mask (the tokens a packed output predicts). ``defaults``: the value of a field the batch may lack.
    inputs: tuple[str, ...] = ("response_mask",)
    defaults: dict[str, float] = {}
    # Whether the update's forwards route by the batch's recorded experts (actor.router_replay: the policy's)
    replays_routes = False

    def __init__(self) -> None:
        # Outputs in the packed layout of the masked response tokens (`scalerl.models.packing`); set by the
        # update loop for each mini-batch's micro-batches.
        self.packed_outputs = False
        self.agg: dict[str, Any] = {}
        self._calls: list[dict[str, torch.Tensor]] = []
        self._totals: dict[str, torch.Tensor] = {}
        self._mini_batches = 0

    def start_mini_batch(self, agg: dict[str, Any]) -> None:
        """``agg``: `aggregate_loss`'s counts for this mini-batch (global tokens/sequences, dp size, horizon)."""
        self.agg, self._calls = agg, []

    def end_mini_batch(self, num_calls: int) -> None:
        """Add up the metric parts of the mini-batch's last ``num_calls`` calls (a pipeline schedule may call
        the loss once more while it infers shapes on its first step; the real micro-batches come last)."""
        for parts in self._calls[len(self._calls) - num_calls :]:
            for key, value in parts.items():
                self._totals[key] = self._totals.get(key, 0.0) + value
        self._mini_batches += 1

    def summary(self) -> dict[str, torch.Tensor]:
        """Per-mini-batch metric values averaged over the mini-batches since the last summary."""
        out = {k: v / max(self._mini_batches, 1) for k, v in self._totals.items()}
        self._totals, self._mini_batches = {}, 0
        return out

    def _record(self, parts: dict[str, torch.Tensor]) -> None:
        self._calls.append({k: v.detach() for k, v in parts.items()})

    def _token_weight(self, mask: torch.Tensor) -> torch.Tensor:
        """This call's share of the mini-batch's tokens, times the DP size (ranks are averaged later)."""
        return mask.sum() / torch.as_tensor(self.agg["global_num_tokens"]).clamp(min=1) * self.agg["dp_size"]

    def target(self, batch: RolloutBatch) -> torch.Tensor:
        """``[rows, response, len(inputs)]`` float: the batch's ``inputs`` fields, stacked."""
        columns = []
        for name in self.inputs:
            value = getattr(batch, name)
            if value is None:
                if name not in self.defaults:
                    raise ValueError(f"{type(self).__name__} reads RolloutBatch.{name}, which this batch lacks")
                value = torch.full(batch.response_mask.shape, self.defaults[name], dtype=torch.float32,
                                   device=batch.response_mask.device)
            columns.append(value.float())
        return torch.stack(columns, dim=-1)

    def named(self, target: torch.Tensor) -> dict[str, torch.Tensor]:
        """The loss inputs of ``target`` by field name (views; the ids as integers)."""
        values = dict(zip(self.inputs, target.unbind(-1)))
        if "response_ids" in values:
            values["response_ids"] = values["response_ids"].long()
        return values

    @staticmethod
    def keep(batch: RolloutBatch) -> int:
        """Output positions the loss reads: the one before each response token, plus the last."""
        return batch.response_ids.shape[1] + 1

    def response_outputs(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The outputs that predict the response tokens (float32): at positions ``P - 1 + t`` ``[B, R, ...]``,
        or, packed, those of the masked tokens ``[M, ...]``."""
        if self.packed_outputs:
            if output.shape[0] != 1:
                raise ValueError(f"packed outputs are one row [1, M, ...]; got {tuple(output.shape)}")
            return output[0].float()
        response_len = target.shape[1]
        return output[:, -response_len - 1 : -1].float()

    def response_tokens(self, target: torch.Tensor) -> torch.Tensor:
        """``[B, R]`` bool: the response tokens a packed output predicts (the loss mask's)."""
        return target[..., self.inputs.index("response_mask")] > 0

    def per_token(self, values: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Per-token results computed on `response_outputs` in the ``[B, R]`` layout (packed: put in place)."""
        return response_layout(values, self.response_tokens(target)) if self.packed_outputs else values

    def response_labels(self, ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Response ids ``[B, R]`` aligned with `response_outputs` (packed: the masked ones, ``[M]``)."""
        return ids[self.response_tokens(target)] if self.packed_outputs else ids

    def response_token_outputs(self, output, ids: torch.Tensor, target: torch.Tensor, per_token) -> torch.Tensor:
        """``per_token(logits, ids)`` on the float32 outputs predicting the response tokens -> ``[B, R, ...]``.
        Packed, those are the masked tokens' ``[M, ...]``, put back in place. Under sequence parallelism
        ``output`` is this rank's shard of the logits (`SequenceShards`): ``per_token`` runs there and only its
        results are gathered."""
        if isinstance(output, SequenceShards):  # the last kept position predicts nothing: label 0, cut off
            return output.per_token(per_token, torch.nn.functional.pad(ids, (0, 1)))[:, :-1]
        return self.per_token(per_token(self.response_outputs(output, target), self.response_labels(ids, target)),
                              target)


def policy_loss_options(actor_cfg: Any) -> PolicyLossOptions:
    """The `actor` keys the policy losses read, under verl's names (each loss reads its own)."""
    return PolicyLossOptions(
        clip_ratio_low=actor_cfg.clip_ratio_low, clip_ratio_high=actor_cfg.clip_ratio_high,
        clip_ratio_c=actor_cfg.clip_ratio_c, tau_pos=actor_cfg.tau_pos, tau_neg=actor_cfg.tau_neg,
        clip_cov_ratio=actor_cfg.clip_cov_ratio, clip_cov_lb=actor_cfg.clip_cov_lb, clip_cov_ub=actor_cfg.clip_cov_ub,
        kl_cov_ratio=actor_cfg.kl_cov_ratio, ppo_kl_coef=actor_cfg.ppo_kl_coef,
    )


class PolicyObjective(MicroBatchObjective):
    """A policy loss from `POLICY_LOSSES` (default dual-clip PPO) with an optional entropy bonus and KL penalty
    to a reference policy, aggregated by ``actor.loss_agg_mode`` over the whole mini-batch's counts.
    Reads the response ids and mask, old log-probs, advantages, reference log-probs (zero without a reference)
    and importance weights (one without a correction).

    ``options`` default to the dual clip's keys of ``actor_cfg``. ``generator`` draws the random token picks of
    clip_cov; the trainer reseeds it every step from (seed, step, DP rank), so a resumed run repeats them."""

    inputs = ("response_ids", "response_mask", "old_logprobs", "advantages", "ref_logprobs", "is_weights")
    defaults = {"ref_logprobs": 0.0, "is_weights": 1.0}

    def __init__(self, actor_cfg: Any, temperature: float, loss: PolicyLoss = POLICY_LOSSES["vanilla"],
                 options: PolicyLossOptions | None = None, distill: Any = None):
        super().__init__()
        # algorithm.distill.top_k > 0 with a teacher: + coef x the teacher's top-k forward KL, read from the
        # batch's teacher_topk columns appended to the target (`topk_forward_kl`)
        on = distill is not None and distill.top_k > 0 and bool(distill.teacher or distill.teachers)
        self.distill = distill if on else None
        self.cfg, self.temperature = actor_cfg, temperature or 1.0
        self.loss = loss
        self.options = options or PolicyLossOptions(clip_ratio_low=actor_cfg.clip_ratio_low,
                                                    clip_ratio_high=actor_cfg.clip_ratio_high,
                                                    clip_ratio_c=actor_cfg.clip_ratio_c)
        self.generator: torch.Generator | None = None
        self.replays_routes = bool(getattr(actor_cfg, "router_replay", False))
        # verl's metric names: each loss logs its own (gpg none, kl_cov only ppo_kl)
        self.metric_names = ("actor/pg_loss", "actor/entropy", "actor/kl_loss",
                             *(f"actor/{name}" for name in loss.metric_names),
                             *(("actor/distill_topk_kl",) if self.distill is not None else ()))

    def target(self, batch: RolloutBatch) -> torch.Tensor:
        """The named inputs, then with top-k distillation the teacher's ``[.., 2k]`` top-k ids and log-probs."""
        target = super().target(batch)
        if self.distill is None:
            return target
        if batch.teacher_topk is None:
            raise ValueError("algorithm.distill.top_k > 0 reads RolloutBatch.teacher_topk, which this batch lacks")
        return torch.cat([target, batch.teacher_topk.float()], dim=-1)

    def token_logprobs_and_entropy(self, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``[..., 2]``: the log-prob of each id and the entropy (a metric only, without gradient, unless
        ``actor.entropy_coeff`` makes it a loss term), at the sampling temperature."""
        if self.temperature != 1.0:
            logits = logits / self.temperature  # log-probs of what the sampler drew at this temperature
        logp = logprobs_from_logits(logits, ids)
        with torch.enable_grad() if self.cfg.entropy_coeff else torch.no_grad():
            entropy = entropy_from_logits(logits)
        return torch.stack([logp, entropy], dim=-1)

    def distill_topk_kl(self, logits, target: torch.Tensor) -> torch.Tensor:
        """``[B, R]``: the student's per-token top-k forward KL to the teacher's top-k in ``target``'s last ``2k``
        columns (`topk_forward_kl`), at the sampling temperature. Under sequence parallelism each rank computes
        it at its own positions, from its shard of the logits and the teacher's top-k there, and the per-token
        values are gathered (as the log-probs are)."""
        clamp, temperature = self.distill.max_clamp, self.temperature

        def kl(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
            return topk_forward_kl(student / temperature if temperature != 1.0 else student, teacher, clamp)

        teacher = target[..., len(self.inputs) :]
        if isinstance(logits, SequenceShards):  # the last kept position predicts nothing: cut off, as for ids
            return logits.per_token(kl, torch.nn.functional.pad(teacher, (0, 0, 0, 1)))[:, :-1]
        return self.per_token(kl(self.response_outputs(logits, target), self.response_labels(teacher, target)),
                              target)

    def __call__(self, logits, target: torch.Tensor) -> torch.Tensor:
        cfg, x = self.cfg, self.named(target)
        mask = x["response_mask"]
        logp, entropy = self.response_token_outputs(logits, x["response_ids"], target,
                                                    self.token_logprobs_and_entropy).unbind(-1)
        pg_loss, pg_metrics = self.loss(x["old_logprobs"], logp, x["advantages"], mask, cfg.loss_agg_mode,
                                        self.options, **self.agg, token_weights=x["is_weights"],
                                        generator=self.generator)
        loss = pg_loss
        if cfg.entropy_coeff:
            loss = loss - cfg.entropy_coeff * aggregate_loss(entropy, mask, cfg.loss_agg_mode, **self.agg)
        weight = self._token_weight(mask)
        parts = {"actor/pg_loss": pg_loss,
                 "actor/entropy": (entropy * mask).sum() / mask.sum().clamp(min=1) * weight}
        if cfg.use_kl_loss:
            kl_loss = aggregate_loss(kl_penalty(logp, x["ref_logprobs"], cfg.kl_loss_type), mask, cfg.loss_agg_mode,
                                     **self.agg)
            loss = loss + cfg.kl_loss_coef * kl_loss
            parts["actor/kl_loss"] = kl_loss
        if self.distill is not None:
            kl = self.distill_topk_kl(logits, target)
            topk_loss = aggregate_loss(kl, mask, cfg.loss_agg_mode, **self.agg)
            loss = loss + self.distill.coef * topk_loss
            parts["actor/distill_topk_kl"] = topk_loss
        parts.update({f"actor/{k}": v * weight for k, v in pg_metrics.items()})
        self._record(parts)
        return loss


class ValueObjective(MicroBatchObjective):
    """Clipped value regression onto the returns (reads the returns, the old values and the response mask)."""

    metric_names = ("critic/vf_loss", "critic/vf_clipfrac")
    inputs = ("returns", "values", "response_mask")

    def __init__(self, critic_cfg: Any, loss_agg_mode: str):
        super().__init__()
        self.cfg, self.loss_agg_mode = critic_cfg, loss_agg_mode

    def __call__(self, values: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        x = self.named(target)
        mask = x["response_mask"]
        vpreds = self.per_token(self.response_outputs(values, target), target)
        loss, metrics = value_loss(vpreds, x["returns"], x["values"], mask, self.cfg.cliprange_value,
                                   agg=self.loss_agg_mode, **self.agg)
        self._record({"critic/vf_loss": loss, "critic/vf_clipfrac": metrics["vf_clipfrac"] * self._token_weight(mask)})
        return self.cfg.value_loss_coef * loss


class SFTObjective(MicroBatchObjective):
    """Token-mean cross-entropy of the response tokens (reads the response ids and mask)."""

    metric_names = ("sft/loss",)
    inputs = ("response_ids", "response_mask")

    def __call__(self, logits, target: torch.Tensor) -> torch.Tensor:
        x = self.named(target)
        logp = self.response_token_outputs(logits, x["response_ids"], target, logprobs_from_logits)
        loss = aggregate_loss(-logp, x["response_mask"], "token-mean", **self.agg)
        self._record({"sft/loss": loss})
        return loss
