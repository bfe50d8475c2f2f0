"""The `rollout` section (and `rollout.agent`): the generation engine, sampling, placement (colocated or
standalone workers), staleness and the off-policy correction, multi-turn agent rollouts."""

from __future__ import annotations

from dataclasses import dataclass, field

from scalerl.core.config.tree import Section, _check, _check_choice, opt

ROLLOUT_ENGINES = ("builtin", "vllm", "auto")
ROLLOUT_PLACEMENTS = ("colocated", "standalone")
ROLLOUT_DTYPES = ("bf16", "fp32")
# A sampling temperature below this decodes greedily (`scalerl.rollout.engines.engine.SamplingParams`): logits / T
# overflows float32 for tiny T (NaN probabilities, an empty completion); vLLM draws its line here too.
GREEDY_BELOW_TEMPERATURE = 1e-5
STALE_LOGPROBS = ("recompute", "behavior")
IS_LEVELS = ("token", "sequence")  # scalerl.algorithms.importance's (core sits below algorithms)
IS_MODES = ("truncate", "mask")


@dataclass
class AgentSection(Section):
    """Multi-turn rollouts (scalerl/rollout/agent/): each sample an episode against an environment, its
    tool results and user turns in the trajectory as context, only the engine's tokens trained."""

    name = "rollout.agent"
    env: str | None = opt(None, "the environment: tools (the built-in tool environment over rollout.agent.tools) | "
                                "chat (scripted user turns, the row's 'turns') | module:Class | path/file.py:Class | "
                                "verl (verl AgentLoopBase subclasses, rollout.agent.verl_loop) | program (your agent "
                                "program on the in-run OpenAI-compatible endpoint, rollout.agent.program) | verifiers (a "
                                "verifiers environment, rollout.agent.verifiers_env); null = single-turn rollouts")
    tools: str | None = opt(None, "with env=tools (or beside a TRL environment's methods): plain Python functions as "
                                  "tools, module:fn1,fn2 or path/file.py:fn1,fn2 (the JSON schema from each "
                                  "signature and docstring; TRL's tools=[...] functions as they are)")
    tool_config: str | None = opt(None, "with env=tools: verl's tool config YAML (tools: - class_name, config, "
                                        "tool_schema; verl's multi_turn.tool_config_path), its BaseTool classes as "
                                        "tools, one instance per trajectory (docs/agents.md)")
    function_tool_path: str | None = opt(None, "with env=tools or env=verl: a Python file of functions decorated "
                                               "with verl's @function_tool (verl's multi_turn.function_tool_path), "
                                               "each a tool; verl need not be installed (docs/agents.md)")
    interaction_config: str | None = opt(None, "with env=tools: verl's interaction YAML (interaction: - name, "
                                               "class_name, config; verl's multi_turn.interaction_config_path): the "
                                               "row's extra_info.interaction_kwargs.name picks the BaseInteraction "
                                               "that answers each turn without a tool call as the user, its score the "
                                               "reward; with env=verl, what a verl <= 0.7.1 loop reads as "
                                               "multi_turn.interaction_config_path (docs/agents.md)")
    tool_parser: str = opt("hermes", "the model's tool-call format (hermes: Qwen2.5/Qwen3 <tool_call>{json}</tool_call>)")
    sandbox: str | None = opt(None, "with env=tools: add a python tool whose code runs in this sandbox: process (the "
                                    "built-in: own process group, rlimits, no network, as an unprivileged uid) | "
                                    "module:Class | path/file.py:Class (anything with exec(code, limits)); null = "
                                    "no python tool")
    system: str | None = opt(None, "with env=tools: a system message before the row's prompt")
    max_turns: int = opt(4, "engine turns per episode at most", at_least=1)
    max_tool_calls_per_turn: int = opt(4, "tool calls run per turn at most (more are answered with an error)",
                                       at_least=1)
    max_total_tokens: int = opt(0, "tokens per trajectory at most (prompt, turns and environment answers); 0 = "
                                   "data.max_prompt_length + max_turns x (rollout.max_new_tokens + 64)", at_least=0)
    env_timeout_s: float = opt(300.0, "seconds one reset or step of the environment (its tools included) may take; "
                                      "past it the episode ends as an environment error, the batch goes on", above=0)
    verl_loop: str | None = opt(None, "with env=verl: verl agent loops run as they are, one class (module:Class | "
                                      "path/file.py:Class | pkg.module.Class) or verl's agent loop config YAML (- name, "
                                      "_target_); each row's agent_name picks one (docs/agents.md)")
    verl_default_loop: str | None = opt(None, "with env=verl: the loop rows without agent_name run (verl's "
                                              "agent.default_agent_loop); null = the one class verl_loop names")
    program: str | None = opt(None, "with env=program: the agent program's command line, run once per episode (no "
                                    "shell; a first word ending in .py runs with this Python); it finds its session in "
                                    "OPENAI_BASE_URL / OPENAI_API_KEY, the row in SCALERL_ROW (JSON), and may POST "
                                    "{\"reward\": x} to SCALERL_REWARD_URL (docs/agent-endpoint.md)")
    verifiers_env: str | None = opt(None, "with env=verifiers: the function that builds the environment, "
                                          "module:load_environment | path/file.py:load_environment; its rollout runs "
                                          "on an AsyncOpenAI client of the in-run endpoint, its rubric scores "
                                          "(docs/agents.md)")
    verifiers_env_args: str | None = opt(None, "with env=verifiers: load_environment's keyword arguments as a JSON "
                                               "object (vf-eval's --env-args); null = none")
    episode_timeout_s: float = opt(600.0, "with env=program|verifiers: seconds one episode (the program's whole run, "
                                          "or the environment's rollout and scoring) may take; past it the step "
                                          "stops with an error naming the program and the row", above=0)
    max_concurrent_episodes: int = opt(0, "with env=program|verifiers: episodes running at once (processes, for "
                                          "env=program); 0 = all of the rank's batch", at_least=0)

    def problems(self) -> list[str]:
        p: list[str] = []
        if self.env == "tools" and not (self.tools or self.sandbox or self.tool_config or self.function_tool_path
                                        or self.interaction_config):
            p.append("rollout.agent.env=tools needs rollout.agent.tools (module:fn1,fn2 or path/file.py:fn1,fn2), "
                     "rollout.agent.tool_config (verl's tool YAML), rollout.agent.function_tool_path (verl's "
                     "@function_tool file), rollout.agent.interaction_config (verl's interactions) or "
                     "rollout.agent.sandbox=process (a python tool)")
        if self.function_tool_path is not None and self.env not in ("tools", "verl"):
            p.append(f"rollout.agent.function_tool_path={self.function_tool_path!r} is read with rollout.agent.env="
                     f"tools or env=verl (got env={self.env}): set rollout.agent.env=tools")
        if self.interaction_config is not None and self.env not in ("tools", "verl"):
            p.append(f"rollout.agent.interaction_config={self.interaction_config!r} is read with rollout.agent.env="
                     f"tools (got env={self.env}): set rollout.agent.env=tools")
        if self.tool_config is not None and self.env not in ("tools", "verl"):
            p.append(f"rollout.agent.tool_config={self.tool_config!r} is read with rollout.agent.env=tools (got env="
                     f"{self.env}): set rollout.agent.env=tools")
        if (self.env == "verl") != (self.verl_loop is not None):
            p.append("rollout.agent.env=verl and rollout.agent.verl_loop go together (got env="
                     f"{self.env}, verl_loop={self.verl_loop}): set both to run verl agent loops")
        if (self.env == "program") != (self.program is not None):
            p.append("rollout.agent.env=program and rollout.agent.program go together (got env="
                     f"{self.env}, program={self.program}): set both to train an agent program")
        if self.verifiers_env_args is not None and self.env != "verifiers":
            p.append(f"rollout.agent.verifiers_env_args is read with rollout.agent.env=verifiers (got env={self.env})")
        if (self.env == "verifiers") != (self.verifiers_env is not None):
            p.append("rollout.agent.env=verifiers and rollout.agent.verifiers_env go together (got env="
                     f"{self.env}, verifiers_env={self.verifiers_env}): set both to train a verifiers environment")
        return p


@dataclass
class RolloutSection(Section):
    name = "rollout"
    engine: str = opt("builtin", "generation engine: " + " | ".join(ROLLOUT_ENGINES))
    n: int = opt(8, "samples per prompt (the GRPO group size)")
    temperature: float = opt(1.0, "sampling temperature for training rollouts (GRPO needs > 0)", at_least=0)
    top_p: float = opt(1.0, "nucleus sampling mass, 0 < top_p <= 1", above=0, at_most=1)
    top_k: int = opt(0, "keep the k most likely tokens; 0 = off")
    max_new_tokens: int = opt(16, "response length limit in tokens")
    max_num_seqs: int = opt(0, "rows decoding at once. Built-in engine: a larger batch is continuously batched (a "
                               "finished row's slot refilled from the rest at once); 0 = one fixed batch per "
                               "generate call (finished rows compacted out). vLLM: its max_num_seqs with "
                               "rollout.partial (its asynchronous engine; 0 = vLLM's default); without "
                               "rollout.partial vLLM keeps its default", at_least=0)
    val_temperature: float = opt(0.0, "sampling temperature for evaluation; 0 = greedy", at_least=0)
    placement: str = opt("colocated", "colocated (the trainer's ranks generate with the trained weights) | "
                                      "standalone (rollout.workers extra ranks with their own copy)")
    workers: int = opt(1, "standalone: rollout worker ranks, the last ranks of the world")
    dtype: str = opt("fp32", "standalone: the workers' weight dtype, and what weight sync sends; with "
                             "rollout.engine=vllm also the colocated engine's: " + " | ".join(ROLLOUT_DTYPES))
    vllm_kv_cache_gib: float = opt(1.0, "rollout.engine=vllm: the KV cache vLLM reserves, in GiB (its own default "
                                        "takes most of the free memory)", above=0)
    vllm_tensor_parallel_size: int = opt(1, "rollout.engine=vllm: devices each vLLM engine spans (vLLM's tensor "
                                            "parallelism; GPUs only, at most the GPUs visible to it; refused on "
                                            "CPU)", at_least=1)
    staleness: int = opt(0, "standalone: K >= 0, the most policy versions a trained sample may lag: the prompts "
                            "of steps k+1..k+K go to the workers while step k trains (0 = synchronous, 1 = one-step "
                            "asynchronous); older samples are dropped from the loss and counted")
    partial: bool = opt(False, "standalone, rollout.staleness >= 1: workers stream (continuous batching over every "
                               "request in flight) and a weight sync lands between two engine steps without waiting "
                               "for the rows in flight, which go on with the new weights (one response may mix "
                               "versions, recorded per token); timing-dependent, so not bitwise reproducible")
    stream_groups: bool = opt(False, "standalone, rollout.workers >= 2, parallel.pp=1: the trainer takes each "
                                     "worker's part of a step (whole prompt groups) as it arrives and scores it and "
                                     "runs its old/reference log-prob passes while the other workers still "
                                     "generate, and, where nothing later reads the weights it changes (see "
                                     "docs: actor.shuffle=false, no critic, a group-wise estimator), "
                                     "takes the update's first mini-batches whose groups are in; the step's "
                                     "result is the same as without (timing_s/stream_overlap: the trainer's "
                                     "seconds of such work before the last part came)")
    is_level: str = opt("token", "off-policy correction of rollouts sampled by other weights or numerics: one "
                                 "importance weight per token | per sequence (" + " | ".join(IS_LEVELS) + ")")
    is_mode: str = opt("truncate", "what the cap does to a weight above it: truncate (min(w, cap), verl's TIS) | "
                                   "mask (0: TRL's *_mask, AReaL's decoupled PPO at is_level=token)")
    is_cap: float = opt(2.0, "importance weight cap, w = exp(old - rollout log-prob) per token or sequence; "
                             "0 = no correction", at_least=0)
    tis_cap: float | None = opt(None, "alias of rollout.is_cap kept for existing configs; when set it is the cap")
    stale_logprobs: str = opt("recompute", "rollout.staleness >= 1: PPO's old log-probs are recomputed with the "
                                           "current weights (recompute: the proximal policy of decoupled PPO; the "
                                           "rollout's own weigh the loss per rollout.is_*) or are the rollout's own, "
                                           "the behaviour policy's (behavior: standard PPO, no extra forward; fp32 "
                                           "workers only, whose log-probs equal the trainer's forward)")

    agent: AgentSection = field(default_factory=AgentSection)

    @property
    def correction_cap(self) -> float:
        """The importance weight cap in force: rollout.tis_cap where a config sets it, else rollout.is_cap."""
        return self.is_cap if self.tis_cap is None else self.tis_cap

    def problems(self) -> list[str]:
        p: list[str] = []
        _check_choice(p, "rollout.engine", self.engine, ROLLOUT_ENGINES)
        _check(p, self.n >= 1, "rollout.n", ">= 1", self.n)
        _check(p, self.top_k >= 0, "rollout.top_k", ">= 0 (0 = off)", self.top_k)
        _check(p, self.max_new_tokens >= 1, "rollout.max_new_tokens", ">= 1", self.max_new_tokens)
        if 0 < self.temperature < GREEDY_BELOW_TEMPERATURE:
            # the engines decode greedily there (log-probs at temperature 1), the update's log-probs would not
            p.append(f"rollout.temperature={self.temperature:g} is below {GREEDY_BELOW_TEMPERATURE:g}, where rollouts "
                     "decode greedily while the update would divide the logits by it; set rollout.temperature=0 "
                     f"for greedy decoding, or >= {GREEDY_BELOW_TEMPERATURE:g}")
        _check_choice(p, "rollout.placement", self.placement, ROLLOUT_PLACEMENTS)
        _check(p, self.workers >= 1, "rollout.workers", ">= 1", self.workers)
        _check_choice(p, "rollout.dtype", self.dtype, ROLLOUT_DTYPES)
        if self.vllm_tensor_parallel_size > 1 and self.engine == "builtin":
            p.append(f"rollout.vllm_tensor_parallel_size={self.vllm_tensor_parallel_size} applies to vLLM only "
                     "(rollout.engine=vllm or auto); the built-in engine's tensor parallelism is parallel.tp")
        _check(p, self.staleness >= 0, "rollout.staleness", ">= 0", self.staleness)
        _check_choice(p, "rollout.is_level", self.is_level, IS_LEVELS)
        _check_choice(p, "rollout.is_mode", self.is_mode, IS_MODES)
        _check(p, self.tis_cap is None or self.tis_cap >= 0, "rollout.tis_cap", ">= 0 or null", self.tis_cap)
        _check_choice(p, "rollout.stale_logprobs", self.stale_logprobs, STALE_LOGPROBS)
        if self.stale_logprobs == "behavior" and not (self.staleness and self.dtype == "fp32"):
            p.append("rollout.stale_logprobs=behavior needs rollout.staleness >= 1 and rollout.dtype=fp32 (got "
                     f"staleness={self.staleness}, dtype={self.dtype}): without staleness the rollouts are on-policy "
                     "already, and bf16 workers' log-probs differ from the trainer's forward, so they are recomputed")
        if self.partial and (self.placement != "standalone" or not self.staleness):
            p.append(f"rollout.partial=true needs rollout.placement=standalone and rollout.staleness >= 1 (got "
                     f"placement={self.placement}, staleness={self.staleness}): a partial rollout is one a weight push "
                     "to standalone workers lands in, and at staleness 0 no rollout is in flight during a push; "
                     "set rollout.partial=false or raise rollout.staleness")
        if self.stream_groups and (self.placement != "standalone" or self.workers < 2):
            p.append(f"rollout.stream_groups=true needs rollout.placement=standalone and rollout.workers >= 2 (got "
                     f"placement={self.placement}, workers={self.workers}): it overlaps the trainer's work on one "
                     "worker's finished groups with the others' generation, and colocated or with one worker the "
                     "whole batch arrives at once; set rollout.stream_groups=false or add rollout workers")
        p += self.agent.all_problems()
        if self.agent.env in ("program", "verifiers") and (self.placement != "colocated" or self.engine == "vllm"):
            p.append(f"rollout.agent.env={self.agent.env} serves its endpoint on the trainer's ranks, from the built-in "
                     f"engine for now (got placement={self.placement}, engine={self.engine}); set "
                     "rollout.placement=colocated and rollout.engine=builtin")
        if self.placement == "colocated" and (self.staleness or (self.dtype != "fp32" and self.engine == "builtin")):
            p.append("rollout.staleness and rollout.dtype apply to rollout.placement=standalone only (dtype also "
                     "to rollout.engine=vllm) "
                     f"(got staleness={self.staleness}, dtype={self.dtype} with placement=colocated)")
        return p
