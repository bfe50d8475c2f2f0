"""The config's table of algorithm names (torch-free, layer 0) equals the registries in `scalerl.algorithms`,
name for name, line for line, and `scalerl config --keys` lists every name without importing torch."""

import subprocess
import sys

from scalerl.algorithms import ADVANTAGE_ESTIMATORS, POLICY_LOSS_ALIASES, POLICY_LOSSES
from scalerl.core import algorithm_names as names
from scalerl.core.config import describe_keys


def test_estimator_names_descriptions_and_needs_match_the_registry():
    assert list(names.ADVANTAGE_ESTIMATOR_NAMES) == list(ADVANTAGE_ESTIMATORS)
    for name, entry in ADVANTAGE_ESTIMATORS.items():
        assert names.ADVANTAGE_ESTIMATOR_NAMES[name].description == entry.description, name
        assert names.ADVANTAGE_ESTIMATOR_NAMES[name].needs == entry.needs, name
    assert [n for n in ADVANTAGE_ESTIMATORS if names.needs_critic(n)] == ["gae"]
    assert [n for n in ADVANTAGE_ESTIMATORS if names.needs_greedy_baseline(n)] == ["remax"]
    assert {n for n in ADVANTAGE_ESTIMATORS if not names.needs_groups(n)} == {"gae", "remax", "reinforce_plus_plus"}


def test_policy_loss_names_and_aliases_match_the_registry():
    assert names.POLICY_LOSS_NAMES == {name: entry.description for name, entry in POLICY_LOSSES.items()}
    assert names.POLICY_LOSS_ALIASES == POLICY_LOSS_ALIASES


def test_keys_list_every_name_with_its_line():
    keys = describe_keys()
    for name, entry in names.ADVANTAGE_ESTIMATOR_NAMES.items():
        assert f"{name} " in keys and entry.description in keys, name
    for name, line in names.POLICY_LOSS_NAMES.items():
        assert line in keys, name
    for key in ("actor.tau_pos", "actor.tau_neg", "actor.clip_cov_ratio", "actor.clip_cov_lb", "actor.clip_cov_ub",
                "actor.kl_cov_ratio", "actor.ppo_kl_coef", "algorithm.gamma"):
        assert f"  {key} (" in keys, key


def test_config_keys_do_not_import_torch():
    code = ("import sys; from scalerl.cli import main; main(['config', '--keys']); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "reinforce_plus_plus_baseline" in result.stdout and "dppo_kl" in result.stdout
