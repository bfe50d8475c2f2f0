"""Multi-turn tool episodes: scalerl's per-trajectory agent loop against a turn-synchronous loop, on the same
engine, weights, prompts and tool latencies, side by side in one run.

    python benchmarks/agent_rollout.py [--episodes 32] [--turns 4] [--repeats 3] [--median-s 0.05] [--sigma 1.2]

Every episode makes ``--turns`` tool calls; each call sleeps a latency drawn once per (episode, turn) from a
lognormal distribution (median ``--median-s``, shape ``--sigma``: a long tail, as real tools have), the same
draws for both loops. The per-trajectory loop (`scalerl.rollout.agent.loop.AgentLoop`) lets every episode
go on as soon as its own tool answers; the turn-synchronous loop generates turn k for every episode as one
batch, runs their tools concurrently and waits for the slowest before turn k + 1 (what the simplest loops
do). Printed: trajectories/s of each, their ratio (target >= 2x), the slowest tool per turn, the tool-time bound
(the ratio if decoding took no time: the sum of every turn's slowest tool over the longest episode's own tool
time, which no loop can beat on those draws), and the
prefill tokens per episode: the per-trajectory loop's as its engine counted them (each turn reuses the last
turn's keys and values, so only the last sampled token and the tool's answer are prefilled), what
re-encoding the conversation at every turn would prefill for the same trajectories, and the turn-synchronous
loop's (which re-encodes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scalerl.models.tokenizer import CharTokenizer  # noqa: E402
from scalerl.rollout.agent.environment import EnvStep  # noqa: E402
from scalerl.rollout.agent.loop import AgentLimits, AgentLoop  # noqa: E402
from scalerl.rollout.engines.builtin import BuiltinEngine  # noqa: E402
from scalerl.rollout.engines.engine import SamplingParams  # noqa: E402
from scalerl.rollout.trajectory import Trajectory, TrajectorySegment  # noqa: E402
from tests.tiny import tiny_model  # noqa: E402

TOK = CharTokenizer()


class LatencyEnv:
    """Answers every assistant turn with a tool result after that (episode, turn)'s latency; done after the
    last turn."""

    def __init__(self, latencies: dict[int, list[float]]):
        self.latencies, self.turn, self.episode = latencies, 0, -1

    async def reset(self, row):
        self.episode = row["episode"]
        return [{"role": "user", "content": row["prompt"]}]

    async def step(self, message):
        delays = self.latencies[self.episode]
        if self.turn >= len(delays):
            return EnvStep(done=True)
        await asyncio.sleep(delays[self.turn])
        self.turn += 1
        return EnvStep([{"role": "tool", "content": f"r{self.turn}"}])


def turn_synchronous(engine, rows, latencies, sampling: SamplingParams, turns: int) -> tuple[float, int]:
    """Every episode's turn k as one batch, then all tools at once, the slowest awaited; returns the seconds
    and the prompt tokens prefilled."""
    contexts = [TOK.encode(r["prompt"]) for r in rows]
    prefilled = 0
    began = time.perf_counter()
    for turn in range(turns + 1):
        prefilled += sum(len(c) for c in contexts)
        out = engine.generate(contexts, sampling)
        for i in range(len(rows)):
            contexts[i] += out.response_ids[i, : int(out.response_mask[i].sum())].tolist()
        if turn == turns:
            break

        async def tools():
            await asyncio.gather(*(asyncio.sleep(latencies[i][turn]) for i in range(len(rows))))

        asyncio.run(tools())
        for i in range(len(rows)):
            contexts[i] += TOK.encode(f"r{turn + 1}")
    return time.perf_counter() - began, prefilled


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--median-s", type=float, default=0.05)
    parser.add_argument("--sigma", type=float, default=1.2)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = tiny_model(vocab_size=128).eval()
    rows = [{"prompt": f"{i}+{i}=", "episode": i} for i in range(args.episodes)]
    sampling = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, seed=0, stop_token_ids=())
    limits = AgentLimits(max_turns=args.turns + 1, max_total_tokens=512)
    results = []
    for repeat in range(args.repeats):
        draw = random.Random(repeat)
        latencies = {i: [args.median_s * math.exp(draw.gauss(0, args.sigma)) for _ in range(args.turns)]
                     for i in range(args.episodes)}
        engine = BuiltinEngine(model, TOK.pad_token_id)
        sync_s, sync_prefill = turn_synchronous(engine, rows, latencies, sampling, args.turns)
        continuous = engine.continuous_engine(limits.max_total_tokens, args.new_tokens, args.episodes)
        loop = AgentLoop(continuous, TOK, lambda: LatencyEnv(latencies), limits)
        began = time.perf_counter()
        trajectories, _ = loop.run(rows, sampling)
        ours_s = time.perf_counter() - began
        ours_prefill = continuous.prefill_tokens  # counted by the engine: prefix reuse skips the kept tokens
        reencoded = sum(_prefilled(t) for t in trajectories)
        slowest = [max(latencies[i][k] for i in latencies) for k in range(args.turns)]
        # With free decoding the turn-synchronous loop takes the sum of each turn's slowest tool and ours the
        # longest episode's own tool time: their ratio is the most any loop can gain on these draws.
        tool_bound = sum(slowest) / max(sum(v) for v in latencies.values())
        results.append({"ours_s": ours_s, "sync_s": sync_s, "ours_prefill": ours_prefill, "reencoded": reencoded,
                        "sync_prefill": sync_prefill, "slowest_tool_per_turn_s": slowest, "tool_bound": tool_bound,
                        "tool_s_per_episode": statistics.median(sum(v) for v in latencies.values())})
        print(f"repeat {repeat}: per-trajectory {args.episodes / ours_s:.1f} traj/s, turn-synchronous "
              f"{args.episodes / sync_s:.1f} traj/s, ratio {sync_s / ours_s:.2f}x (tool-time bound {tool_bound:.2f}x); "
              "slowest tool per turn "
              + ", ".join(f"{s:.2f}" for s in slowest) + " s", flush=True)
    ratio = statistics.median(r["sync_s"] / r["ours_s"] for r in results)
    bound = statistics.median(r["tool_bound"] for r in results)
    print(f"median ratio (per-trajectory / turn-synchronous trajectories/s): {ratio:.2f}x (target >= 2x); the "
          f"tool-time bound on the same draws (decoding free): {bound:.2f}x")
    per_episode = {k: statistics.median(r[k] for r in results) / args.episodes
                   for k in ("ours_prefill", "reencoded", "sync_prefill")}
    print(f"prefill tokens per episode: per-trajectory with prefix reuse {per_episode['ours_prefill']:.0f}, the same "
          f"trajectories re-encoded {per_episode['reencoded']:.0f} "
          f"({per_episode['reencoded'] / max(per_episode['ours_prefill'], 1):.1f}x), turn-synchronous "
          f"{per_episode['sync_prefill']:.0f}")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "results": results,
                                         "median_ratio": ratio}, indent=2))
    return 0


def _prefilled(t: Trajectory) -> int:
    """Prompt tokens the engine prefilled over the episode: the whole context before each engine turn."""
    total, context = 0, len(t.prompt_ids)
    for segment in t.segments:
        if segment.generated:
            total += context
        context += len(segment.token_ids)
    return total


if __name__ == "__main__":
    raise SystemExit(main())
