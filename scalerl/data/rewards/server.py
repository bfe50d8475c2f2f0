"""A reference reward server: any reward scalerl accepts, served over HTTP in the schema of
`scalerl.data.rewards.http`, so a run can score with `data.reward=http://127.0.0.1:8000/score`.

    python -m scalerl.data.rewards.server --reward file.py:compute_score --port 8000 [--workers 4]

Each POST (any path) is one batch: its rows are rebuilt from the request's fields and scored by a
`RewardComputer` (so every signature, several comma-separated functions with `--weights`, `--workers`
processes and `--timeout-s` apply as in a run). A sample whose reward failed is `null` in "scores", with
the reason in "errors"; a request not of the schema gets HTTP 400 with {"error": "..."} naming the field.
Requests are scored one at a time (a batch's calls run in the pool). It binds to 127.0.0.1 unless told
otherwise: it runs your code on whatever it is sent, with no authentication, so put it behind your own
network's protection before `--host 0.0.0.0`.
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Sequence

from scalerl.data.errors import DataError
from scalerl.data.rewards.computer import RewardComputer

MAX_REQUEST_BYTES = 256 * 2 ** 20
_LIST_FIELDS = ("prompts", "ground_truths", "data_sources", "extra_infos", "columns")

logger = logging.getLogger(__name__)


class BadRequest(ValueError):
    """A request body not of the schema; the message names the field."""


def rows_of_request(document: Any) -> tuple[list[str], list[dict]]:
    """The responses and rows a request asks to score (BadRequest naming the field when it is not of the schema)."""
    if not isinstance(document, dict):
        raise BadRequest(f"the request must be a JSON object, got {type(document).__name__}")
    responses = document.get("responses")
    if not isinstance(responses, list) or not all(isinstance(r, str) for r in responses):
        raise BadRequest("'responses' must be a list of strings")
    for name in _LIST_FIELDS:
        value = document.get(name)
        if value is not None and (not isinstance(value, list) or len(value) != len(responses)):
            raise BadRequest(f"'{name}' must be a list with one entry per response ({len(responses)})")
    rows = []
    for index in range(len(responses)):
        row: dict[str, Any] = {key: document[field][index] for field, key in (
            ("prompts", "prompt"), ("ground_truths", "ground_truth"), ("data_sources", "data_source"),
            ("extra_infos", "extra_info")) if document.get(field) is not None}
        columns = document["columns"][index] if document.get("columns") is not None else None
        if columns is not None and not isinstance(columns, dict):
            raise BadRequest(f"'columns[{index}]' must be an object")
        row["columns"] = columns or {}
        rows.append(row)
    return responses, rows


def score_request(computer: RewardComputer, document: Any) -> dict[str, list]:
    """The response body for a request: {"scores": [...], "errors": [...]}."""
    responses, rows = rows_of_request(document)
    per_function = computer.sample_scores(responses, rows)
    several = len(computer.functions) > 1
    scores: list[Any] = []
    errors: list[str | None] = []
    for index in range(len(responses)):
        column = [function_scores[index] for function_scores in per_function]
        problems = [f"{f.name} {s.problem}" for f, s in zip(computer.functions, column) if s.problem]
        if problems:
            scores.append(None)
            errors.append("; ".join(problems))
            continue
        total = sum(w * s.value for w, s in zip(computer.weights, column) if s.value is not None) + 0.0
        extras = {(f"{f.name}/{key}" if several else key): number
                  for f, s in zip(computer.functions, column) for key, number in s.extras.items()}
        scores.append({"score": total, **extras} if extras else total)
        errors.append(None)
    return {"scores": scores, "errors": errors}


def make_server(computer: RewardComputer, host: str = "127.0.0.1", port: int = 8000) -> ThreadingHTTPServer:
    """A server scoring every POST with `computer` (port 0: a free one, `server.server_address[1]`)."""
    lock = threading.Lock()  # a RewardComputer keeps state between batches: one request at a time

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_REQUEST_BYTES:
                return self._reply(413, {"error": f"the request is over {MAX_REQUEST_BYTES} bytes"})
            try:
                document = json.loads(self.rfile.read(length))
                with lock:
                    body = score_request(computer, document)
            except (BadRequest, DataError, json.JSONDecodeError, UnicodeDecodeError) as error:
                return self._reply(400, {"error": str(error)})
            except Exception as error:  # a data error the reward raised for the batch: the client retries 5xx
                logger.exception("scoring a request failed")
                return self._reply(500, {"error": repr(error)})
            self._reply(200, body)

        def _reply(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            logger.debug(format, *args)

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m scalerl.data.rewards.server", description=__doc__.split("\n\n")[0])
    parser.add_argument("--reward", required=True, help="a data.reward spec: gsm8k, math, auto, file.py:fn, module:fn")
    parser.add_argument("--weights", type=float, nargs="*", default=None, help="one per comma-separated function")
    parser.add_argument("--task", default="arithmetic", help="the task whose built-in 'auto' uses for rows without "
                        "a data_source")
    parser.add_argument("--workers", type=int, default=0, help="score in this many processes (0 = in the server's)")
    parser.add_argument("--timeout-s", type=float, default=30.0, help="limit for one reward call")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    computer = RewardComputer(args.reward, args.timeout_s, weights=args.weights, task=args.task, workers=args.workers)
    server = make_server(computer, args.host, args.port)
    host, port = server.server_address[:2]
    print(f"scalerl reward server: {args.reward} on http://{host}:{port}/ (workers: {args.workers})", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        computer.close()


if __name__ == "__main__":
    main()
