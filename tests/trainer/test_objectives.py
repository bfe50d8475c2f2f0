"""The micro-batch losses read their inputs by name: `target` stacks the batch fields an objective names, `named`
gives them back, and a field the batch lacks is its default or a clear error."""

from __future__ import annotations

import pytest
import torch

from scalerl.core.config import load_config
from scalerl.rollout.batch import RolloutBatch
from scalerl.trainer.objectives import PolicyObjective, SFTObjective, ValueObjective


def _batch(**fields) -> RolloutBatch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (2, 3), generator=g)
    base = dict(input_ids=torch.cat([ids, ids], 1), attention_mask=torch.ones(2, 6), response_ids=ids,
                response_mask=torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]), rollout_logprobs=None,
                group_ids=torch.zeros(2, dtype=torch.long), scores=torch.zeros(2))
    return RolloutBatch(**{**base, **fields})


def test_each_input_comes_back_under_its_name():
    old, adv, ref = torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 3)
    batch = _batch(old_logprobs=old, advantages=adv, ref_logprobs=ref)
    objective = PolicyObjective(load_config(None, []).actor, temperature=1.0)
    x = objective.named(objective.target(batch))
    assert set(x) == set(PolicyObjective.inputs)
    assert torch.equal(x["response_ids"], batch.response_ids) and x["response_ids"].dtype == torch.long
    assert torch.equal(x["old_logprobs"], old) and torch.equal(x["advantages"], adv)
    assert torch.equal(x["ref_logprobs"], ref) and torch.equal(x["response_mask"], batch.response_mask)
    assert torch.equal(x["is_weights"], torch.ones(2, 3))  # no correction: weight one
    # without a reference the KL term reads zeros, not another channel's values
    assert torch.equal(objective.named(objective.target(_batch(old_logprobs=old, advantages=adv)))["ref_logprobs"],
                       torch.zeros(2, 3))
    # the packed path finds the mask by name, wherever an objective keeps it
    values = ValueObjective(load_config(None, []).critic, "token-mean")
    target = values.target(_batch(returns=torch.randn(2, 3), values=torch.randn(2, 3)))
    assert torch.equal(values.response_tokens(target), batch.response_mask > 0)


def test_a_field_the_batch_lacks_without_a_default_is_named():
    with pytest.raises(ValueError, match="ValueObjective reads RolloutBatch.returns"):
        ValueObjective(load_config(None, []).critic, "token-mean").target(_batch(values=torch.zeros(2, 3)))
    sft = SFTObjective()
    assert sft.target(_batch()).shape == (2, 3, 2)
