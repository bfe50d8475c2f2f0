"""Staleness per token and per row: the lag behind the trainer's version, the histogram, the rows beyond
rollout.staleness dropped and counted."""

import torch

from scalerl.rollout.staleness import check_staleness, row_staleness


def test_lag_histogram_and_drops():
    versions = torch.tensor([[5, 5, -1], [3, 4, 4], [2, -1, -1], [6, 6, 6]])
    mask = (versions >= 0).long()
    assert row_staleness(versions, mask, 6).tolist() == [1, 3, 4, 0]  # a row's oldest token decides
    check = check_staleness(versions, mask, trainer_version=6, max_staleness=3)
    assert check.keep.tolist() == [True, True, False, True]
    lags = [1, 1, 3, 2, 2, 4, 0, 0, 0]  # per valid token
    m = check.metrics
    assert m["rollout/dropped_stale"] == 1.0
    assert m["rollout/staleness/max"] == 4.0 and abs(m["rollout/staleness/mean"] - sum(lags) / 9) < 1e-9
    assert [m[f"rollout/staleness/hist/{k}"] for k in range(4)] == [3 / 9, 2 / 9, 2 / 9, 1 / 9]
    assert "rollout/staleness/hist/4" not in m  # the keys are 0..K every step, whatever the lags
    assert m["rollout/partial_fraction"] == 1 / 4  # row 1 mixes versions 3 and 4 (a partial rollout)


def test_on_policy_rollouts_keep_everything():
    versions = torch.full((2, 3), 4)
    check = check_staleness(versions, torch.ones(2, 3), trainer_version=4, max_staleness=0)
    assert check.keep.all() and check.metrics["rollout/staleness/hist/0"] == 1.0
    assert check.metrics["rollout/dropped_stale"] == 0.0 and check.metrics["rollout/staleness/max"] == 0.0
    assert check.metrics["rollout/partial_fraction"] == 0.0
