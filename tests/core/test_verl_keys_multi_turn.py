"""`--from-verl` for verl's multi-turn runs: ``actor_rollout_ref.rollout.multi_turn.*`` and ``agent.*`` set
scalerl's ``rollout.agent.*`` (verl's tool loop over a tool config: the tool environment; verl's agent loop YAML:
its loops, as they are), with verl's turn limits and budget; what has no counterpart is an error naming it."""

from __future__ import annotations

import pytest

from scalerl.core.config.tree import ConfigError, _all_keys
from scalerl.core.verl_keys import VERL_KEYS
from scalerl.core.verl_overrides import load_verl_config, translate

M, AG = "actor_rollout_ref.rollout.multi_turn.", "actor_rollout_ref.rollout.agent."


def _agent_values(*args: str) -> dict:
    return {k: v for k, v in translate(list(args)).values.items() if k.startswith("rollout.agent.")}


def test_a_tool_config_runs_the_tool_environment_with_verls_limits_and_budget():
    values = _agent_values(f"{M}enable=true", f"{M}tool_config_path=tools.yaml", f"{M}max_assistant_turns=5",
                           f"{M}max_user_turns=2", f"{M}max_parallel_calls=3", "data.max_prompt_length=100",
                           "data.max_response_length=300")
    assert values == {"rollout.agent.env": "tools", "rollout.agent.tool_config": "tools.yaml",
                      "rollout.agent.max_turns": 3,  # two tool answers: a third turn after them, no more
                      "rollout.agent.max_tool_calls_per_turn": 3, "rollout.agent.tool_parser": "hermes",
                      "rollout.agent.max_total_tokens": 400}  # verl's prompt_length + response_length


def test_without_turn_limits_the_response_budget_ends_an_episode_as_in_verl():
    values = _agent_values(f"{M}tool_config_path=tools.yaml", "actor_rollout_ref.rollout.response_length=64")
    assert values["rollout.agent.max_turns"] == 64 and values["rollout.agent.max_total_tokens"] == 512 + 64
    assert values["rollout.agent.env"] == "tools"  # multi_turn.enable is not needed: verl's loops read the tools


def test_verls_agent_loop_config_runs_its_loops_by_agent_name(tmp_path):
    loops = tmp_path / "agent_loops.yaml"
    loops.write_text("- name: my_agent\n  _target_: my_loops.MyLoop\n")
    cfg, translation = load_verl_config([f"{AG}agent_loop_config_path={loops}", f"{AG}default_agent_loop=my_agent",
                                         f"{M}tool_config_path=tools.yaml", f"{AG}num_workers=4",
                                         "data.max_prompt_length=64", "data.max_response_length=64"])
    a = cfg.rollout.agent
    assert (a.env, a.verl_loop, a.verl_default_loop, a.tool_config) == ("verl", str(loops), "my_agent", "tools.yaml")
    rows = {k: t for k, _, t in translation.rows}
    assert rows[f"{AG}num_workers"].startswith("no effect here: agent loop workers")
    assert rows[f"{M}enable (verl default)"].startswith("rollout.agent.env=verl, rollout.agent.max_total_tokens=")


def test_a_single_turn_verl_run_sets_no_agent_key():
    assert _agent_values("data.max_response_length=32") == {}


@pytest.mark.parametrize("override, named", [
    (f"{M}max_tool_response_length=512", "scalerl's tool environment keeps 2048 characters"),
    (f"{M}tool_response_truncate_side=left", "scalerl cuts a long tool answer in the middle"),
    (f"{AG}custom_async_server.path=server.py", "scalerl's engine serves the loops"),
])
def test_multi_turn_settings_with_no_counterpart_are_errors_naming_them(override, named):
    with pytest.raises(ConfigError, match="changes the run and scalerl has no equivalent") as caught:
        translate([f"{M}tool_config_path=tools.yaml", override])
    assert override.split("=")[0] in str(caught.value) and named in str(caught.value)


def test_function_tool_files_and_interactions_run_the_tool_environment():
    """verl's @function_tool file and its interaction YAML (verl <= 0.7.1) set scalerl's keys of the same job; each
    alone is something to run (verl's tool loop over them), beside a tool config or verl's own loops too."""
    values = _agent_values(f"{M}enable=true", f"{M}function_tool_path=fns.py")
    assert values["rollout.agent.env"] == "tools" and values["rollout.agent.function_tool_path"] == "fns.py"
    values = _agent_values(f"{M}interaction_config_path=interaction.yaml", f"{M}max_assistant_turns=3")
    assert values["rollout.agent.env"] == "tools" and values["rollout.agent.max_turns"] == 3
    assert values["rollout.agent.interaction_config"] == "interaction.yaml"
    cfg, translation = load_verl_config([f"{M}tool_config_path=tools.yaml", f"{M}function_tool_path=fns.py",
                                         f"{M}interaction_config_path=interaction.yaml", "data.max_prompt_length=64",
                                         "data.max_response_length=64"])
    a = cfg.rollout.agent
    assert (a.env, a.tool_config, a.function_tool_path, a.interaction_config) == (
        "tools", "tools.yaml", "fns.py", "interaction.yaml")
    rows = {k: t for k, _, t in translation.rows}
    assert rows[f"{M}function_tool_path"].startswith("rollout.agent.function_tool_path")
    assert rows[f"{M}interaction_config_path"].startswith("rollout.agent.interaction_config")
    assert _agent_values("data.max_response_length=32") == {}  # neither given: nothing set


def test_multi_turn_enabled_with_nothing_to_run_is_an_error():
    with pytest.raises(ConfigError, match="multi_turn.enable=true with neither .*tool_config_path nor .*"
                                          "agent_loop_config_path"):
        translate([f"{M}enable=true"])


def test_an_unknown_multi_turn_key_is_named_not_passed_over():
    with pytest.raises(ConfigError, match=f"unknown verl key '{M}max_turns'"):
        translate([f"{M}max_turns=3"])


def test_every_further_target_is_a_scalerl_key():
    from scalerl.core.config import Config

    keys = set(_all_keys(Config))
    also = [target for entry in VERL_KEYS for target, _ in entry.also]
    assert also and not [t for t in also if t not in keys]
