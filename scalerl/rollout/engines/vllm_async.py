"""vLLM's asynchronous engine (``AsyncLLM``) behind the continuous-batching interface of
`scalerl.rollout.engines.continuous`: the engine of the fully asynchronous pipeline with ``rollout.engine=vllm``.

Requests stream in and out: `submit` hands a request to vLLM at once (its scheduler batches whatever is in
flight, continuously), `step` returns the requests that finished since the last call. A weight load
(`load_weights`) pauses vLLM's scheduler with the requests in flight kept (``pause_generation(mode="keep")``),
loads through the same checksummed, bucketed worker-extension path as `VLLMEngine`
(`scalerl.rollout.engines.vllm.load_in_checked_buckets`), labels the engine with the new weight version and
resumes: the in-flight requests continue with the new weights (partial rollouts, no restart). The pause
clears the KV cache, so a resumed request's prompt and tokens so far are prefilled again with the new weights
(its later tokens are exactly what the new weights generate after that prefix; the cost is one prefill per
request in flight). vLLM labels every output token with the weight version its engine core held when it
was sampled (``CompletionOutput.weight_versions``); `RequestOutput.weight_versions` is that label per token.

vLLM's ``AsyncLLM`` lives on an asyncio event loop; it runs here on a loop of its own in a background
thread, so the callers (the rollout worker's streaming loop) stay synchronous. Every wait has a limit.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from scalerl.core.device import PRECISION_DTYPES
from scalerl.rollout.engines.continuous import GenerationRequest, RequestOutput
from scalerl.rollout.engines.engine import PromptTooLongError
from scalerl.rollout.engines.vllm import (
    LOAD_BUCKET_BYTES,
    agent_engine_kwargs,
    import_vllm,
    load_in_checked_buckets,
    sequence_budget,
    to_request_output,
    vllm_engine_args,
    vllm_layer_groups,
    vllm_sampling_kwargs,
)

STEP_WAIT_S = 0.05  # the longest `step()` waits for a request to finish when none has
START_TIMEOUT_S = 600.0  # engine start-up: 30-70 s on a quiet 2-core machine, several minutes on a loaded one
CALL_TIMEOUT_S = 300.0  # one call into the engine (an abort, a pause, one weight bucket, a resume)
CLOSE_TIMEOUT_S = 60.0


class VLLMAsyncEngine:
    """``ContinuousEngine``'s interface (``submit``, ``step``, ``has_unfinished``, ``abort``,
    ``weight_version``) on vLLM's ``AsyncLLM``, plus ``load_weights`` between or during generations.

    ``weight_version`` labels the tokens sampled from now on (set it, or let `load_weights` bump it).
    Requests whose ``sampling.seed`` is set draw from vLLM's per-request generator seeded with
    ``seed + row_offset`` (as `VLLMEngine` seeds a batch's rows); pre-drawn ``uniforms`` cannot be honoured
    and are refused. Create it under ``if __name__ == "__main__"`` (vLLM spawns its engine core).
    """

    logprobs_match_training_forward = False  # vLLM's kernels differ from the trainer's: recompute old log-probs
    shares_trainer_weights = False

    def __init__(self, model_path: str, pad_token_id: int, max_num_seqs: int | None, max_prompt_len: int,
                 max_new_tokens: int, dtype: str = "fp32", kv_cache_gib: float = 1.0, seed: int = 0,
                 load_bucket_bytes: int = LOAD_BUCKET_BYTES, step_wait_s: float = STEP_WAIT_S,
                 start_timeout_s: float = START_TIMEOUT_S, call_timeout_s: float = CALL_TIMEOUT_S,
                 **engine_kwargs: Any):
        vllm = import_vllm()
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.async_llm import AsyncLLM

        if max_num_seqs is not None and max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1 (or None: vLLM's default), got {max_num_seqs}")
        self._vllm, self._final_only = vllm, RequestOutputKind.FINAL_ONLY
        self.pad_token_id, self.max_prompt_len, self.max_new_tokens = pad_token_id, max_prompt_len, max_new_tokens
        self.dtype, self.load_bucket_bytes = PRECISION_DTYPES[dtype], load_bucket_bytes
        self.step_wait_s, self.call_timeout_s = step_wait_s, call_timeout_s
        if max_num_seqs is not None:
            engine_kwargs.setdefault("max_num_seqs", max_num_seqs)
        args = AsyncEngineArgs(**vllm_engine_args(model_path, dtype, kv_cache_gib, 1, seed,
                                                  max_model_len=max_prompt_len + max_new_tokens,
                                                  disable_log_stats=True, **engine_kwargs))
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="vllm-async-engine", daemon=True)
        self._thread.start()

        async def start():  # on the loop: AsyncLLM starts its output handler on the running loop
            return AsyncLLM.from_engine_args(args)

        try:
            self.llm = self._call(start(), start_timeout_s, "starting vLLM's AsyncLLM")
        except BaseException:
            self._stop_loop(CLOSE_TIMEOUT_S)
            raise
        self._version = 0
        self._call(self.llm.update_weight_version("0"), call_timeout_s, "labelling the weight version")
        self._finished: queue.Queue[_Finished] = queue.Queue()  # from the loop's tasks
        self._in_flight: dict[int, str] = {}  # caller's request id -> vLLM's (unique over the engine's life)
        self._tasks: dict[str, Any] = {}  # vLLM's id -> the concurrent future of its task on the loop
        self._serial = itertools.count()
        self.paused = False  # by weight loads (or a relabelling) until `step()` or a version is assigned
        self._loaded_in_pause = False
        self.loads = 0
        self.closed = False
        self.prompt_tokens = self.cached_prompt_tokens = 0  # prompt tokens finished, those from vLLM's prefix cache

    # ------------------------------------------------------------------------------- ContinuousEngine's
    def submit(self, request: GenerationRequest) -> None:
        """Hand a request to vLLM now (it joins the running batch at vLLM's next scheduling step)."""
        s, n = request.sampling, len(request.prompt_ids)
        if n == 0:
            raise ValueError(f"request {request.request_id}: empty prompt")
        if n > self.max_prompt_len or s.max_new_tokens > self.max_new_tokens:
            raise PromptTooLongError(
                f"request {request.request_id}: prompt {n} / max_new_tokens {s.max_new_tokens} exceed the engine's "
                f"max_prompt_len {self.max_prompt_len} / max_new_tokens {self.max_new_tokens}")
        if request.uniforms is not None:
            raise ValueError(f"request {request.request_id}: pre-drawn uniforms cannot be given to vLLM (it samples "
                             "with its own per-request generator, seeded from sampling.seed + row_offset); pass "
                             "uniforms=None")
        if request.request_id in self._in_flight:
            raise ValueError(f"request {request.request_id} is already in flight (ids must be unique until it "
                             "finishes or is aborted)")
        self._check_open()
        params = self._vllm.SamplingParams(**vllm_sampling_kwargs(s, 1)[0], output_kind=self._final_only)
        vllm_id = f"{request.request_id}-{next(self._serial)}"
        self._in_flight[request.request_id] = vllm_id
        self._tasks[vllm_id] = asyncio.run_coroutine_threadsafe(self._generate(request, vllm_id, params), self.loop)

    def step(self) -> list[RequestOutput]:
        """The requests finished since the last call (in finishing order); waits up to ``step_wait_s`` for
        one when none has, and not at all when nothing is in flight."""
        if self.paused:  # the weight loads since the last step are one update: generation resumes with it
            self._resume(self._version + 1 if self._loaded_in_pause else self._version)
        outputs = []
        wait = self.step_wait_s if self._in_flight else 0.0
        deadline = time.monotonic() + wait
        while True:
            try:
                item = self._finished.get(timeout=max(0.0, deadline - time.monotonic())) if not outputs and wait \
                    else self._finished.get_nowait()
            except queue.Empty:
                return outputs
            if self._in_flight.get(item.request_id) != item.vllm_id:  # aborted meanwhile
                continue
            del self._in_flight[item.request_id]
            self._tasks.pop(item.vllm_id, None)
            if isinstance(item.output, BaseException):
                raise RuntimeError(f"vLLM's AsyncLLM failed request {item.request_id}") from item.output
            outputs.append(item.output)

    def has_unfinished(self) -> bool:
        return bool(self._in_flight)

    @property
    def num_running(self) -> int:
        """Requests submitted and neither returned by `step` nor aborted (vLLM's own queue and batch)."""
        return len(self._in_flight)

    def abort(self, request_ids: Iterable[int]) -> int:
        """Drop these requests, waiting or in flight (vLLM frees their KV blocks); returns how many."""
        vllm_ids = [self._in_flight.pop(i) for i in set(request_ids) if i in self._in_flight]
        for vllm_id in vllm_ids:  # a task still adding its request stops there; one running aborts in vLLM
            self._tasks.pop(vllm_id).cancel()
        if vllm_ids:
            self._call(self.llm.abort(vllm_ids), self.call_timeout_s, f"aborting {len(vllm_ids)} requests")
        return len(vllm_ids)

    def generate_stream(self, requests: Iterable[GenerationRequest], max_waiting: int = 256) -> Iterator[RequestOutput]:
        """Outputs as requests finish; ``requests`` is read lazily, up to ``max_waiting`` in flight."""
        incoming = iter(requests)
        for request in itertools.islice(incoming, max_waiting):
            self.submit(request)
        while self.has_unfinished():
            yield from self.step()
            for request in itertools.islice(incoming, max(0, max_waiting - self.num_running)):
                self.submit(request)

    @property
    def weight_version(self) -> int:
        return self._version

    @weight_version.setter
    def weight_version(self, version: int) -> None:
        """Label the tokens sampled from now on with ``version``; after weight loads this ends the update and
        resumes generation (otherwise generation pauses for the change, so every token gets the label of the
        weights that sampled it)."""
        version = int(version)
        if self.paused:
            self._resume(version)
        elif version != self._version:
            self._call(self.llm.pause_generation(mode="keep", clear_cache=False), self.call_timeout_s,
                       f"pausing generation to label weight version {version}")
            self.paused = True
            self._resume(version)

    # ------------------------------------------------------------------------------- weight loads
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load whole tensors (trainer names) in checksummed buckets with generation paused (requests in flight
        kept, the KV cache cleared). Returns the bytes loaded. Loads until the next `step()` or
        ``weight_version`` assignment form one update (weight sync calls this once per bucket of a push):
        generation resumes there, the tokens from then on labelled with the version assigned, or the current
        one + 1 at `step()`. A load that fails to verify raises `WeightLoadError`; if no load of the update
        succeeded, generation resumes under the old label (as the built-in engine goes on with what was
        written until the next, full, push)."""
        self._check_open()
        if not self.paused:
            self._call(self.llm.pause_generation(mode="keep", clear_cache=True), self.call_timeout_s,
                       "pausing generation for a weight load")
            self.paused = True
        loaded = load_in_checked_buckets(self._rpc, named_tensors, self.dtype, self.load_bucket_bytes)
        self._loaded_in_pause = True
        self.loads += 1
        return loaded

    def _resume(self, version: int) -> None:
        """Label the weights ``version`` and resume the paused scheduler (the requests in flight go on, those
        whose KV cache was cleared prefilled again with the weights now loaded)."""
        self._call(self.llm.update_weight_version(str(version)), self.call_timeout_s, f"labelling version {version}")
        self._version = version
        self._call(self.llm.resume_generation(), self.call_timeout_s, f"resuming generation at version {version}")
        self.paused = self._loaded_in_pause = False

    def layer_groups(self, names: Iterable[str]) -> list[list[str]]:
        """Trainer names grouped by the vLLM layer they load into (what a delta load must send together)."""
        return vllm_layer_groups(names)

    def named_weights(self) -> None:
        """vLLM exposes no tensors to write in place (weight sync keeps a shadow copy)."""
        return None

    def _rpc(self, method: str, args: tuple = ()) -> list:
        return self._call(self.llm.collective_rpc(method, timeout=self.call_timeout_s, args=args),
                          self.call_timeout_s + 10, f"the weight load's {method}")

    # ------------------------------------------------------------------------------- the loop thread
    async def _generate(self, request: GenerationRequest, vllm_id: str, params) -> None:
        """One request on the loop: await vLLM's final output and queue it for `step`."""
        try:
            final = None
            async for out in self.llm.generate({"prompt_token_ids": list(request.prompt_ids)}, params, vllm_id):
                final = out
            completion = final.outputs[0]
            if completion.finish_reason not in ("stop", "length"):  # aborted: nobody waits for it
                return
            self.prompt_tokens += len(request.prompt_ids)  # on the loop thread only
            self.cached_prompt_tokens += int(getattr(final, "num_cached_tokens", 0) or 0)
            self._finished.put(_Finished(request.request_id, vllm_id, to_request_output(
                request, completion, self._version)))
        except asyncio.CancelledError:
            raise
        except Exception as err:  # noqa: BLE001 - raised in the caller's thread by `step`
            self._finished.put(_Finished(request.request_id, vllm_id, err))

    def _call(self, coroutine, timeout: float, what: str):
        """Run ``coroutine`` on the engine's loop and wait for it at most ``timeout`` seconds."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            return future.result(timeout)
        except TimeoutError as err:
            future.cancel()
            raise TimeoutError(f"vLLM's AsyncLLM: {what} took over {timeout:.0f} s") from err

    def _check_open(self) -> None:
        if self.closed or self.llm is None:
            raise RuntimeError("the vLLM async engine is closed")
        if self.llm.errored:
            raise RuntimeError(f"vLLM's AsyncLLM is dead: {self.llm.dead_error}")

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Abort what is in flight, stop the loop's tasks, shut the engine core down and stop the loop thread,
        each within ``timeout``."""
        if self.closed:
            return
        self.closed = True
        try:
            if self._in_flight and not self.llm.errored:
                self._call(self.llm.abort(list(self._in_flight.values())), timeout, "aborting at close")
            self._in_flight.clear()
        finally:
            try:
                self._cancel_tasks(timeout)  # the output handler first: it would log the engine core's exit
                self.llm.shutdown(timeout=timeout)
            finally:
                self.llm = None  # its __del__ would shut down again at interpreter exit
                self._stop_loop(timeout)

    def _cancel_tasks(self, timeout: float) -> None:
        async def cancel():
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=timeout)

        if self._thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(cancel(), self.loop).result(timeout + 5)
            except Exception:  # noqa: BLE001 - stopping anyway
                pass

    def _stop_loop(self, timeout: float) -> None:
        self._cancel_tasks(timeout)
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()

    def __enter__(self) -> "VLLMAsyncEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Finished:
    __slots__ = ("request_id", "vllm_id", "output")

    def __init__(self, request_id: int, vllm_id: str, output: RequestOutput | Exception):
        self.request_id, self.vllm_id, self.output = request_id, vllm_id, output


def streaming_vllm_engine(cfg: Any, model_dir: str, pad_token_id: int) -> VLLMAsyncEngine:
    """The engine of the asynchronous pipeline with ``rollout.engine=vllm``: vLLM's ``AsyncLLM`` on
    ``model_dir`` (a Hugging Face directory, e.g. the worker's initial weights), sized from the config:
    prompts up to ``data.max_prompt_length``, ``rollout.max_new_tokens``, ``rollout.max_num_seqs`` rows at
    once (0: vLLM's default), ``rollout.dtype``, ``rollout.vllm_kv_cache_gib``, seeded by ``trainer.seed``."""
    agent = bool(getattr(cfg.rollout.agent, "env", None))  # a turn's prompt may hold the whole trajectory so far
    return VLLMAsyncEngine(str(model_dir), pad_token_id, max_num_seqs=cfg.rollout.max_num_seqs or None,
                           max_prompt_len=sequence_budget(cfg) if agent else cfg.data.max_prompt_length,
                           max_new_tokens=cfg.rollout.max_new_tokens, dtype=cfg.rollout.dtype,
                           kv_cache_gib=cfg.rollout.vllm_kv_cache_gib, seed=cfg.trainer.seed, **agent_engine_kwargs(cfg))
