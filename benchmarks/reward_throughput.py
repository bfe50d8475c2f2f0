"""Reward throughput with a slow Python reward: in-process (serial) vs a pool of worker processes vs the
reference reward server, side by side in one run.

    python benchmarks/reward_throughput.py [--samples 256] [--repeats 2] [--sleep-ms 15] [--cpu-ms 5]

The reward takes about 20 ms a call: `--sleep-ms` of `time.sleep` (waiting, as on a sandbox or an
external checker) and then `--cpu-ms` of busy Python (a loop until that much CPU time is used, as a
parser or a symbolic check). Each mode scores a batch of `--samples` responses `--repeats` times after one
warm-up batch (which starts the workers); it prints samples/s (the best repeat) and the ratio against
serial. Modes: serial (`data.reward_workers=0`), pool with 2 and 4 workers (`data.reward_workers=N`),
and the reference server (`python -m scalerl.data.rewards.server`, run here in a thread on 127.0.0.1)
scoring in-process and with its own 4 workers, the client sending requests of 64 samples. Sleeps
overlap beyond the machine's cores; the CPU part does not.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import textwrap
import threading
import time
from pathlib import Path

from scalerl.data.rewards.computer import RewardComputer
from scalerl.data.rewards.server import make_server

SLOW_REWARD = textwrap.dedent("""
    import time

    SLEEP_S, CPU_S = {sleep_s}, {cpu_s}

    def slow_score(response, ground_truth):
        time.sleep(SLEEP_S)
        spent = time.process_time() + CPU_S
        while time.process_time() < spent:
            pass
        return float(response.strip().endswith(ground_truth))
""")


def samples(count: int) -> tuple[list[str], list[dict]]:
    return [f"#### {i % 10}" for i in range(count)], [{"ground_truth": str(i % 7)} for i in range(count)]


def throughput(computer: RewardComputer, count: int, repeats: int) -> float:
    """Best samples/s of `repeats` batches of `count`, after a warm-up batch; checks nothing failed."""
    responses, rows = samples(count)
    computer.compute(responses[:8], rows[:8])
    best = 0.0
    for _ in range(repeats):
        started = time.perf_counter()
        _, failures = computer.compute(responses, rows)
        best = max(best, count / (time.perf_counter() - started))
        if failures:
            raise RuntimeError(f"{failures} rewards failed")
    return best


def serve(spec: str, workers: int):
    computer = RewardComputer(spec, timeout_s=30.0, workers=workers)
    server = make_server(computer, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, computer, f"http://127.0.0.1:{server.server_address[1]}/score"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--sleep-ms", type=float, default=15.0)
    parser.add_argument("--cpu-ms", type=float, default=5.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "slow_reward.py"
        path.write_text(SLOW_REWARD.format(sleep_s=args.sleep_ms / 1e3, cpu_s=args.cpu_ms / 1e3))
        spec = f"{path}:slow_score"
        print(f"reward: {args.sleep_ms:g} ms sleep + {args.cpu_ms:g} ms CPU a call; batch of {args.samples}; "
              f"{os.cpu_count()} CPUs")
        print(f"{'mode':<34} {'samples/s':>10} {'vs serial':>10}")
        results: list[tuple[str, float]] = []
        for name, workers in (("serial (reward_workers=0)", 0), ("pool, reward_workers=2", 2),
                              ("pool, reward_workers=4", 4)):
            computer = RewardComputer(spec, timeout_s=30.0, workers=workers)
            try:
                results.append((name, throughput(computer, args.samples, args.repeats)))
            finally:
                computer.close()
            _print(results)
        for name, server_workers in (("server, in-process", 0), ("server, --workers 4", 4)):
            server, server_computer, url = serve(spec, server_workers)
            try:
                client = RewardComputer(url, timeout_s=30.0, server_batch_size=64)
                results.append((name, throughput(client, args.samples, args.repeats)))
            finally:
                server.shutdown()
                server.server_close()
                server_computer.close()
            _print(results)


def _print(results: list[tuple[str, float]]) -> None:
    name, rate = results[-1]
    print(f"{name:<34} {rate:>10.1f} {rate / results[0][1]:>9.2f}x", flush=True)


if __name__ == "__main__":  # the pool's workers are spawned: they import this file without running it
    main()
