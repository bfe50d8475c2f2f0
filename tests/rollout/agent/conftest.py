import sys

import pytest
import torch

from scalerl.models.tokenizer import CharTokenizer
from tests.rollout.agent import verl_stand_in
from tests.trainer.conftest import length_reward, tiny_config  # noqa: F401 - the trainer tests' tiny runs


class ScriptedTurns:
    """A logits processor forcing the engine to a script: each episode's first turn (the first ``rows``
    requests) says ``first``, later turns ``then``, in the built-in character tokenizer's ids; each ends with
    the end-of-sequence token."""

    def __init__(self, rows: int, first: str, then: str = "ok"):
        self.rows, self.texts, self.tokenizer = rows, [first, then], CharTokenizer()

    def __call__(self, logits, request_ids, index):
        forced = torch.full_like(logits, -1e9)
        for row, (request, at) in enumerate(zip(request_ids.tolist(), index.tolist())):
            ids = self.tokenizer.encode(self.texts[0 if request < self.rows else 1]) + [self.tokenizer.eos_token_id]
            forced[row, ids[min(at, len(ids) - 1)]] = 0.0
        return forced


def forget_modules(*packages: str) -> None:
    """Every loaded module of ``packages`` (and their submodules) dropped, so the next import finds them anew."""
    for name in [m for m in sys.modules if m.split(".")[0] in packages]:
        del sys.modules[name]


@pytest.fixture
def stand_in_verl(tmp_path, monkeypatch):
    """The verl stand-in (verl_stand_in.py: verl's modules a loop or tool imports) importable as ``verl`` for the
    test, and forgotten after it."""
    forget_modules("verl")
    verl_stand_in.install(tmp_path / "stand_in")
    monkeypatch.syspath_prepend(str(tmp_path / "stand_in"))
    yield tmp_path / "stand_in"
    forget_modules("verl")
