import pytest

from scalerl.core.config import load_config
from tests.tiny import tiny_overrides

# The shared tiny run, trained a step longer with a higher learning rate (the trainer tests look for change).
TINY = tiny_overrides("data.num_val=16", "actor.ppo_mini_batch_size=8", "actor.lr=1e-3", "trainer.total_steps=3")


@pytest.fixture
def tiny_config(tmp_path):
    """A config small enough that a few RL steps take about a second on one CPU core."""

    def make(*overrides: str):
        return load_config(None, [*TINY, f"trainer.output_dir={tmp_path / 'run'}", *overrides])

    return make


@pytest.fixture
def length_reward(tmp_path):
    """An override for a reward that varies within a group even for an untrained model (it never answers
    right, so the exact-answer reward would leave every advantage at zero and nothing to learn)."""
    path = tmp_path / "length_reward.py"
    path.write_text("def score(response, ground_truth):\n    return len(response) / 10\n")
    return f"data.reward={path}:score"
