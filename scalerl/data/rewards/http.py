"""Scores from a reward server over HTTP (`data.reward=http://host:port/path`): the schema, batching,
per-request timeout and bounded retries. `python -m scalerl.data.rewards.server` is a server of this schema.

A batch is sent in requests of at most `batch_size` samples (`data.reward_batch_size`), up to `concurrency`
of them in flight at once (`data.reward_workers`, at least 1). Each is a POST of UTF-8 JSON:

    request   {"responses":     [str, ...],                  the generated texts, one per sample
               "prompts":       [str | [{role, content}], ...],
               "ground_truths": [any | null, ...],           null where the row has none
               "data_sources":  [str | null, ...],
               "extra_infos":   [object | null, ...],
               "columns":       [object, ...]}               the row's other columns (TRL's keyword arguments)
    response  {"scores": [number | null | {"score": number, "<metric>": number, ...}, ...],
               "errors": [str | null, ...]}                  optional: why a score is null

`scores` has one entry per response, in order: a number, or verl's dict with extra metrics (logged as
`reward/extra/<metric>`); null is a failure of that sample (its `errors` entry says why). A request that
gets no answer within `timeout_s` (a socket timeout: per connect and per read, `data.reward_timeout_s`),
cannot connect, or gets HTTP 429 or 5xx is retried up to `retries` times (`data.reward_retries`) after
0.5 s, 1 s, 2 s... (at most 8 s); any other HTTP status, or a response not of the schema, is not retried.
A request that fails in the end fails each of its samples, as a raising reward does (counted, and
`data.max_reward_failures` applies). Only http and https are accepted; redirects are not followed and no
proxy is used. A non-loopback host is allowed (a reward cluster), and then the prompts, responses and
ground truths of every batch travel to it (use https beyond a trusted network).
"""

from __future__ import annotations

import http.client
import json
import math
import socket
import ssl
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

from scalerl.data.rewards.calls import CallFailure, CallOutcome
from scalerl.data.rewards.functions import RewardFunctionError, reward_inputs

SCHEMES = ("http", "https")
BACKOFF_S, MAX_BACKOFF_S = 0.5, 8.0
_RETRIED_STATUSES = {429, 500, 502, 503, 504}


class RewardRequestFailed(CallFailure):
    """A request to the reward server failed (after its retries); its samples fail with this message."""


class ServerReward:
    """A reward server named by its URL: what `RewardComputer` needs of a reward function, with the
    request body of a batch (the schema above)."""

    style, per_sample, passes_row = "http", False, False

    def __init__(self, url: str):
        self.url, self.spec = url, url
        self.fn = url  # nothing to call in this process; `RewardComputer` posts to it
        self.name = check_server_url(url)

    @staticmethod
    def request_body(responses: Sequence[str], rows: Sequence[dict]) -> dict[str, list]:
        inputs = [reward_inputs(row) for row in rows]
        return {"responses": list(responses), "prompts": [i.prompt for i in inputs],
                "ground_truths": [i.ground_truth for i in inputs], "data_sources": [i.data_source for i in inputs],
                "extra_infos": [i.extra_info for i in inputs], "columns": [i.columns for i in inputs]}


def check_server_url(url: str) -> str:
    """The URL's `host:port/path` (the reward's name in metrics); RewardFunctionError for another scheme
    or a URL without a host."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in SCHEMES:
        raise RewardFunctionError(f"reward server {url!r}: the scheme {parsed.scheme!r} is refused; use "
                                  f"{' or '.join(s + '://' for s in SCHEMES)}")
    if not parsed.hostname:
        raise RewardFunctionError(f"reward server {url!r} has no host; write e.g. http://127.0.0.1:8000/score")
    return parsed.netloc + (parsed.path or "/")


class ServerCalls:
    """Posts a batch to one reward server (see the module's docstring); never raises for what the server does."""

    def __init__(self, url: str, timeout_s: float, retries: int = 2, batch_size: int = 64, concurrency: int = 1):
        check_server_url(url)
        if batch_size < 1 or retries < 0 or concurrency < 1:
            raise ValueError(f"batch_size and concurrency must be >= 1 and retries >= 0, got {batch_size}, "
                             f"{concurrency}, {retries}")
        parsed = urllib.parse.urlsplit(url)
        self.url, self.timeout_s, self.retries = url, timeout_s, retries
        self.batch_size, self.concurrency = batch_size, concurrency
        self._https, self._host, self._port = parsed.scheme == "https", parsed.hostname, parsed.port
        self._target = (parsed.path or "/") + (f"?{parsed.query}" if parsed.query else "")
        self.requests = self.retried = 0  # over this object's life
        self._count_lock = threading.Lock()

    def run(self, reward: ServerReward, responses: Sequence[str], rows: Sequence[dict]) -> list[tuple[int, int, CallOutcome]]:
        """`(start, stop, outcome)` per request: the outcome's value one entry per sample (a score, or the
        CallFailure of a null one), or the error that failed the whole request."""
        bounds = [(start, min(start + self.batch_size, len(responses)))
                  for start in range(0, len(responses), self.batch_size)]

        def post(bound: tuple[int, int]) -> tuple[int, int, CallOutcome]:
            start, stop = bound
            try:
                body = json.dumps(reward.request_body(responses[start:stop], rows[start:stop]), default=_jsonable,
                                  allow_nan=False).encode()
            except (TypeError, ValueError) as error:
                return start, stop, CallOutcome(error=RewardRequestFailed(f"the batch cannot be sent as JSON: {error}"))
            try:
                return start, stop, CallOutcome(self._post_with_retries(body, stop - start))
            except RewardRequestFailed as error:
                return start, stop, CallOutcome(error=error)

        if len(bounds) <= 1 or self.concurrency == 1:
            return [post(bound) for bound in bounds]
        with ThreadPoolExecutor(min(self.concurrency, len(bounds)), thread_name_prefix="scalerl-reward-http") as pool:
            return list(pool.map(post, bounds))

    def _post_with_retries(self, body: bytes, count: int) -> list[Any]:
        for attempt in range(self.retries + 1):
            with self._count_lock:
                self.requests += 1
            try:
                status, reply = self._post(body)
            except (TimeoutError, socket.timeout):
                why = f"no answer within data.reward_timeout_s={self.timeout_s:g} s"
            except (OSError, http.client.HTTPException) as error:
                why = f"the request failed: {error!r}"
            else:
                if status == 200:
                    return read_response(reply, count)
                why = f"HTTP {status}: {reply[:200].decode('utf-8', 'replace')!r}"
                if status not in _RETRIED_STATUSES:
                    raise RewardRequestFailed(f"reward server {self.url}: {why} (not retried)")
            if attempt == self.retries:
                raise RewardRequestFailed(f"reward server {self.url}: {why}, after {attempt + 1} attempt(s) "
                                          f"(data.reward_retries={self.retries})")
            with self._count_lock:
                self.retried += 1
            time.sleep(min(MAX_BACKOFF_S, BACKOFF_S * 2 ** attempt))
        raise AssertionError("unreachable")

    def _post(self, body: bytes) -> tuple[int, bytes]:
        if self._https:
            connection: http.client.HTTPConnection = http.client.HTTPSConnection(
                self._host, self._port, timeout=self.timeout_s, context=ssl.create_default_context())
        else:
            connection = http.client.HTTPConnection(self._host, self._port, timeout=self.timeout_s)
        try:
            connection.request("POST", self._target, body, {"Content-Type": "application/json",
                                                            "Accept": "application/json"})
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()


def read_response(reply: bytes, count: int) -> list[Any]:
    """The scores of a 200 reply for `count` samples (a null one as its CallFailure); RewardRequestFailed
    naming the field when the reply is not of the schema."""
    try:
        document = json.loads(reply)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise RewardRequestFailed(f"the reward server's reply is not JSON ({error}): {reply[:120]!r}") from None
    if not isinstance(document, dict) or "scores" not in document:
        keys = sorted(document)[:8] if isinstance(document, dict) else type(document).__name__
        raise RewardRequestFailed(f"the reward server's reply has no 'scores' field (got {keys}); expected "
                                  '{"scores": [number | null | {"score": number, ...}, ...]}')
    scores, errors = document["scores"], document.get("errors")
    if not isinstance(scores, list) or len(scores) != count:
        what = f"{len(scores)} entries" if isinstance(scores, list) else f"a {type(scores).__name__}"
        raise RewardRequestFailed(f"the reward server's 'scores' is {what} for {count} responses; give one per response")
    if errors is not None and (not isinstance(errors, list) or len(errors) != count):
        raise RewardRequestFailed(f"the reward server's 'errors' must be a list of {count} entries (str or null)")
    values: list[Any] = []
    for index, score in enumerate(scores):
        if score is None:
            why = errors[index] if errors and errors[index] else "no reason given"
            values.append(RewardRequestFailed(f"the reward server gave no score for this sample: {why}"))
        elif not isinstance(score, (int, float, dict)):
            raise RewardRequestFailed(f"the reward server's 'scores[{index}]' is {score!r:.60}; each entry is a number, "
                                      'null or {"score": number, ...}')
        else:
            values.append(score)
    return values


def _jsonable(value: Any) -> Any:
    """NumPy arrays and numbers (Parquet rows) as JSON; anything else is a TypeError naming its type."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    raise TypeError(f"a {type(value).__name__} in the rows is not JSON")
