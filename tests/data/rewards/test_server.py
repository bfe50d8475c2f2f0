"""Rewards from a reward server (`data.reward=http://...`): the reference server gives the scores the
reward gives in-process; batching, retries with backoff, timeouts and malformed replies, each failed
request counted per sample towards `data.max_reward_failures`; a short training run against a server."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from scalerl.cli import main
from scalerl.core.config import ConfigError, load_config
from scalerl.data.rewards import http as reward_http
from scalerl.data.rewards.computer import RewardComputer, RewardFailureLimit, RewardFunctionError
from scalerl.data.rewards.server import make_server
from tests.data.rewards.test_pool import ALL_STYLES, REWARDS_PY, _samples
from tests.tiny import tiny_overrides


@contextmanager
def serving(server):
    """`server` answering in a thread; yields its URL on 127.0.0.1 (an ephemeral port)."""
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/score"
    finally:
        server.shutdown()
        server.server_close()


def scripted_server(replies):
    """A server answering the n-th request with `replies[n]` (the last one from then on): `(status, body)`,
    or a number of seconds to sleep before answering nothing. Its `.bodies` are the requests it got."""
    bodies = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            reply = replies[min(len(bodies), len(replies)) - 1]
            if isinstance(reply, (int, float)):
                time.sleep(reply)
                return
            status, body = reply
            data = (body if isinstance(body, bytes) else json.dumps(body).encode())
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    server.bodies = bodies
    return server


@pytest.fixture(autouse=True)
def quick_backoff(monkeypatch):
    monkeypatch.setattr(reward_http, "BACKOFF_S", 0.05)


@pytest.fixture
def rewards_file(tmp_path):
    path = tmp_path / "served_rewards.py"
    path.write_text(REWARDS_PY)
    return path


@pytest.mark.parametrize("style", ALL_STYLES.split(","))
def test_the_reference_server_scores_as_the_reward_does_in_process(rewards_file, style):
    spec = style.format(f=rewards_file)
    responses, rows = _samples(20)
    in_process = RewardComputer(spec)
    expected = in_process.compute(responses, rows)
    with serving(make_server(RewardComputer(spec))) as url:
        client = RewardComputer(url, server_batch_size=8, workers=2)  # 3 requests, 2 at a time
        assert client.compute(responses, rows) == expected
        assert client.last_metrics == in_process.last_metrics  # verl's extra metrics travel in "scores"
        assert client._servers[0].requests == 3


def test_a_server_that_fails_the_first_request_is_retried(rewards_file):
    server = scripted_server([(503, {"error": "warming up"}), (200, {"scores": [1.0, {"score": 0.5, "len": 3}]})])
    with serving(server) as url:
        client = RewardComputer(url, server_retries=2)
        assert client.compute(["a", "b"], [{"ground_truth": "a"}, {"ground_truth": "b"}]) == ([1.0, 0.5], 0)
        assert client.last_metrics == {"reward/extra/len": 3.0}
    assert len(server.bodies) == 2 and server.bodies[0] == server.bodies[1]
    assert server.bodies[0]["responses"] == ["a", "b"] and server.bodies[0]["ground_truths"] == ["a", "b"]


def test_a_server_that_does_not_answer_times_out_per_request_and_retries_are_bounded(caplog):
    server = scripted_server([3.0])
    with serving(server) as url:
        client = RewardComputer(url, timeout_s=0.3, server_retries=1)
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="scalerl.data.rewards.computer"):
            assert client.compute(["a", "b", "c"], [{"ground_truth": "a"}] * 3) == ([0.0] * 3, 3)
        elapsed = time.monotonic() - started
    assert len(server.bodies) == 2 and elapsed < 2.0
    message = caplog.records[0].getMessage()
    assert "no answer within data.reward_timeout_s=0.3 s, after 2 attempt(s)" in message


@pytest.mark.parametrize("body, field", [
    ({"score": [1.0]}, "has no 'scores' field"),
    ({"scores": [1.0, 2.0]}, "'scores' is 2 entries for 1 responses"),
    ({"scores": ["1.0"]}, "'scores[0]' is '1.0'"),
    ({"scores": [1.0], "errors": "x"}, "'errors' must be a list"),
    (b"<html>", "not JSON"),
])
def test_a_malformed_reply_fails_its_samples_with_an_error_naming_the_field(body, field):
    server = scripted_server([(200, body)])
    with serving(server) as url:
        client = RewardComputer(url)
        ((score,),) = client.sample_scores(["a"], [{"ground_truth": "a"}])
    assert field in score.problem
    assert len(server.bodies) == 1  # a reply not of the schema is not retried


def test_a_null_score_fails_that_sample_only_with_the_servers_reason():
    server = scripted_server([(200, {"scores": [1.0, None], "errors": [None, "parse error"]})])
    with serving(server) as url:
        client = RewardComputer(url)
        assert client.compute(["a", "b"], [{"ground_truth": "a"}] * 2) == ([1.0, 0.0], 1)
        assert "parse error" in client.sample_scores(["a", "b"], [{"ground_truth": "a"}] * 2)[0][1].problem


def test_failed_requests_count_per_sample_towards_max_reward_failures():
    server = scripted_server([(500, {"error": "down"})])
    with serving(server) as url:
        client = RewardComputer(url, server_retries=1, server_batch_size=2, max_consecutive_failures=4)
        assert client.compute(["a", "b", "c"], [{"ground_truth": "a"}] * 3) == ([0.0] * 3, 3)
        with pytest.raises(RewardFailureLimit, match="HTTP 500"):
            client.compute(["d"], [{"ground_truth": "a"}])
    assert len(server.bodies) == 2 * 2 + 2  # each request tried twice


def test_a_client_error_is_not_retried():
    server = scripted_server([(400, {"error": "'responses' must be a list of strings"})])
    with serving(server) as url:
        ((score,),) = RewardComputer(url, server_retries=3).sample_scores(["a"], [{"ground_truth": "a"}])
    assert "HTTP 400" in score.problem and "not retried" in score.problem and len(server.bodies) == 1


def test_the_reference_server_refuses_a_request_not_of_the_schema(rewards_file):
    with serving(make_server(RewardComputer("gsm8k"))) as url:
        client = reward_http.ServerCalls(url, timeout_s=5, retries=0)
        status, reply = client._post(json.dumps({"responses": ["a"], "ground_truths": ["1", "2"]}).encode())
    assert status == 400 and "'ground_truths' must be a list with one entry per response" in json.loads(reply)["error"]


@pytest.mark.parametrize("url", ["ftp://127.0.0.1/score", "file:///etc/passwd", "http:///score"])
def test_only_http_and_https_urls_with_a_host_are_accepted(url):
    with pytest.raises(RewardFunctionError, match="refused|no host"):
        RewardComputer(url)


def test_the_config_refuses_another_scheme():
    with pytest.raises(ConfigError, match="only http:// and https://"):
        load_config(None, ["data.reward=ftp://127.0.0.1/score"])


def test_the_reference_server_from_the_command_line(tmp_path):
    process = subprocess.Popen([sys.executable, "-m", "scalerl.data.rewards.server", "--reward", "gsm8k", "--port", "0"],
                               stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        line = process.stdout.readline()
        assert "on http://127.0.0.1:" in line  # loopback unless told otherwise
        url = line.split(" on ")[1].split()[0] + "score"
        client = RewardComputer(url)
        assert client.compute(["#### 3", "#### 4"], [{"ground_truth": "3"}] * 2) == ([1.0, 0.0], 0)
    finally:
        process.terminate()
        process.wait(10)


def test_training_with_a_reward_server_logs_rewards(tmp_path):
    run = tmp_path / "run"
    with serving(make_server(RewardComputer("gsm8k"))) as url:
        assert main(["train", *tiny_overrides(), f"trainer.output_dir={run}", "trainer.total_steps=2",
                     f"data.reward={url}"]) == 0
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    scored = [row for row in steps if "critic/score/mean" in row]
    assert len(scored) == 2 and all(row["reward/num_failures"] == 0 for row in scored)
