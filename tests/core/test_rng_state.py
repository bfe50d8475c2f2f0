"""`reseed_after_reshard`: the streams a resharded resume starts are a function of (seed, step) alone, the same
on every rank (the TP peers of a data-parallel rank must draw the same shuffle), and new at each step."""

import random

import numpy as np
import torch

from scalerl.core.rng_state import reseed_after_reshard


def _draws(seed: int, step: int) -> tuple:
    generators = {"update": torch.Generator(), "other": torch.Generator()}
    reseed_after_reshard(seed, step, generators)
    return (random.random(), float(np.random.rand()), float(torch.rand(())),
            torch.randperm(16, generator=generators["update"]).tolist(),
            torch.randperm(16, generator=generators["other"]).tolist())


def test_reseed_depends_on_seed_and_step_only():
    first = _draws(7, 3)
    random.seed(99), np.random.seed(99), torch.manual_seed(99)  # another rank's history before the resume
    assert _draws(7, 3) == first
    later, other_seed = _draws(7, 4), _draws(8, 3)
    for a, b, c in zip(first, later, other_seed):
        assert a != b and a != c
    assert first[3] != first[4]  # each named generator its own stream
