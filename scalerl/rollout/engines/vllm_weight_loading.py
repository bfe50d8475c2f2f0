"""Loading trainer weights into a running vLLM engine, bucket by bucket, through vLLM's own entry points.

`VLLMWeightLoader` is the worker extension (``LLM(worker_extension_cls=...)``): vLLM mixes it into its
worker class, in the engine's own process, and the trainer calls its methods with ``collective_rpc``. A
load is a session of vLLM's layerwise reload (`vllm.model_executor.model_loader.reload`): at its start
every layer is put back in checkpoint layout, each bucket goes through the model's ``load_weights`` (which
fuses q/k/v and gate/up itself), and a layer is re-processed (on CPU: its GEMM weights re-packed for
oneDNN) as soon as all of its tensors arrived, so the extra memory is about one bucket plus one layer.

Two consequences shape the callers:
- a layer must receive all of its tensors in a load, or vLLM re-processes it from partly empty buffers:
  `layer_groups` names the tensors that land in one vLLM layer (q/k/v with their biases, gate/up), and a
  delta load widens its changed tensors to whole groups;
- on CPU the processed weights live in packed kernel handles that cannot be read back, so what is verified
  is what reached the loader: each bucket's checksum (`scalerl.comm.weights.delta.bucket_checksum`,
  the standalone sync's) is recomputed in the engine's process and compared, and a load that left any vLLM
  parameter of a touched layer unloaded is refused.

How a bucket travels: `collective_rpc` carries its arguments msgpack-encoded over ZMQ to the engine core
and on to the worker process, copying them at every hop. Where the engine's workers share this host's
``/dev/shm`` (vLLM's CPU build always; one node's GPUs), a bucket is staged instead (`stage_tensors`):
written once into a file there, the worker maps that file (`open_staged`) and only its path and layout
cross the RPC. On the 0.5B shape (one layer), with the faster checksum, a load into vLLM became 3.4-5.8x
faster (docs/performance.md); ``stage_dir=None`` keeps the bytes-through-RPC path (`pack_tensors`), e.g.
for workers on other hosts.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from collections.abc import Iterable, Sequence

import torch

from scalerl.comm.weights.delta import bucket_checksum, combine_checksums, int_view_dtype

# HF module names that vLLM fuses into one layer, by the fused layer's name (vLLM's
# ``packed_modules_mapping`` of the Qwen2 / Qwen3 / Llama / Mistral / Gemma classes).
PACKED_MODULES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_MEMBER_TO_PACKED = {member: packed for packed, members in PACKED_MODULES.items() for member in members}


def vllm_layer_of(hf_name: str) -> str:
    """The vLLM module a Hugging Face tensor name loads into (``...self_attn.k_proj.bias`` ->
    ``...self_attn.qkv_proj``)."""
    module = hf_name.rpartition(".")[0]
    parent, _, leaf = module.rpartition(".")
    packed = _MEMBER_TO_PACKED.get(leaf)
    return f"{parent}.{packed}" if packed else module


def layer_groups(hf_names: Iterable[str]) -> dict[str, list[str]]:
    """HF tensor names grouped by the vLLM layer they load into, in first-seen order."""
    groups: dict[str, list[str]] = {}
    for name in hf_names:
        groups.setdefault(vllm_layer_of(name), []).append(name)
    return groups


def tensors_checksum(tensors: Sequence[torch.Tensor]) -> int:
    """The weight-sync checksum of ``tensors`` laid end to end (their bits, as one bucket)."""
    parts, offset = [], 0
    for t in tensors:
        bits = t.detach().contiguous().reshape(-1).view(int_view_dtype(t.dtype))
        parts.append(bucket_checksum(bits, offset))
        offset += bits.numel()
    return combine_checksums(parts)


def pack_tensors(tensors: Sequence[torch.Tensor]) -> list[tuple[str, list[int], bytes]]:
    """Tensors as ``(dtype, shape, raw bytes)``: what ``collective_rpc`` carries intact (its encoder turns an
    untyped tensor argument into a list)."""
    return [(str(t.dtype).removeprefix("torch."), list(t.shape),
             t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()) for t in tensors]


def unpack_tensors(packed: Sequence[tuple[str, list[int], bytes]]) -> list[torch.Tensor]:
    """The tensors of `pack_tensors`, viewing the received bytes (no copy)."""
    out = []
    for dtype, shape, data in packed:
        with warnings.catch_warnings():  # the bytes are read-only; nothing writes to these views
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(data, dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
        out.append(raw.view(getattr(torch, dtype)).reshape(shape))
    return out


# Where buckets are staged for the engine's workers: shared memory of this host, if it has one.
STAGE_DIR = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def stage_tensors(tensors: Sequence[torch.Tensor], directory: str) -> tuple[str, list[tuple[str, list[int], int]]]:
    """``tensors`` laid end to end in a new file under ``directory`` (shared memory); its path and each
    tensor's ``(dtype, shape, nbytes)``. The caller removes the file once the worker has loaded it."""
    layout = [(str(t.dtype).removeprefix("torch."), list(t.shape), t.numel() * t.element_size()) for t in tensors]
    fd, path = tempfile.mkstemp(dir=directory, prefix="scalerl_weights_")
    os.close(fd)
    try:
        total = sum(nbytes for _, _, nbytes in layout)
        if total:
            staged = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)  # sizes the file
            offset = 0
            for t, (_, _, nbytes) in zip(tensors, layout):
                staged[offset : offset + nbytes].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
                offset += nbytes
            del staged  # unmapped: the bytes stay in the file
    except BaseException:
        os.unlink(path)
        raise
    return path, layout


def open_staged(path: str, layout: Sequence[tuple[str, list[int], int]]) -> list[torch.Tensor]:
    """The tensors of a `stage_tensors` file, as views of its (private, copy-on-write) mapping."""
    total = sum(nbytes for _, _, nbytes in layout)
    if os.path.getsize(path) != total:
        raise ValueError(f"staged weights {path} hold {os.path.getsize(path)} bytes, the layout says {total}")
    mapped = torch.from_file(path, shared=False, size=total, dtype=torch.uint8) if total else None
    out, offset = [], 0
    for dtype, shape, nbytes in layout:
        raw = mapped[offset : offset + nbytes] if nbytes else torch.zeros(0, dtype=torch.uint8)
        out.append(raw.view(getattr(torch, dtype)).reshape(shape))
        offset += nbytes
    return out


def weight_buckets(named: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive runs of whole tensors of about ``bucket_bytes`` each (a larger tensor is a bucket alone);
    tensors of one vLLM layer stay together, so each layer is re-processed within one bucket."""
    buckets: list[list[tuple[str, torch.Tensor]]] = []
    size = 0
    previous_layer = None
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        layer = vllm_layer_of(name)
        if not buckets or (size + nbytes > bucket_bytes and size > 0 and layer != previous_layer):
            buckets.append([])
            size = 0
        buckets[-1].append((name, t))
        size += nbytes
        previous_layer = layer
    return buckets


class VLLMWeightLoader:
    """Mixed into vLLM's worker (``worker_extension_cls``); its methods run in the engine's process. They
    are named ``scalerl_*`` so that they never shadow a worker method."""

    def scalerl_start_load(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(self.model_runner.get_model())
        self._scalerl_loaded: set[str] = set()

    def scalerl_load_bucket(self, names: list[str], packed: list[tuple[str, list[int], bytes]]) -> int:
        """Load one bucket (HF names, `pack_tensors` in the model's dtype); returns the checksum of what
        arrived."""
        return self._scalerl_load(names, unpack_tensors(packed))

    def scalerl_load_staged(self, names: list[str], path: str, layout: list[tuple[str, list[int], int]]) -> int:
        """Load one bucket staged by `stage_tensors` (HF names, the file's path and layout); returns the checksum
        of what the file held."""
        if not os.path.exists(path):
            raise FileNotFoundError(f"staged weights {path} are not visible to this vLLM worker (another host?): "
                                    "load with stage_dir=None (bytes through collective_rpc)")
        return self._scalerl_load(names, open_staged(path, layout))

    def _scalerl_load(self, names: list[str], tensors: list[torch.Tensor]) -> int:
        from vllm.config import set_current_vllm_config

        checksum = tensors_checksum(tensors)
        model = self.model_runner.get_model()
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            loaded = model.load_weights(list(zip(names, tensors)))
        self._scalerl_loaded.update(loaded or ())
        return checksum

    def scalerl_finish_load(self) -> list[str]:
        """Re-process what is left and end the session; returns the layers loaded in part and the parameters
        of touched layers not loaded at all (empty when the load was whole)."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        model = self.model_runner.get_model()
        touched = {name.rpartition(".")[0] for name in self._scalerl_loaded}
        partial = []
        for name, layer in model.named_modules():
            info = get_layerwise_info(layer)  # a layer still waiting for tensors was loaded in part
            if info.can_load() and info.load_numel_total and 0 < info.load_numel < info.load_numel_total:
                partial.append(name)
        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(model, self.vllm_config.model_config)
            _reprocess_tied_layers(model, touched)
        params = [name for name, _ in model.named_parameters()]
        unloaded = [n for n in params if n.rpartition(".")[0] in touched and n not in self._scalerl_loaded]
        return sorted(set(unloaded) | set(partial))



def _reprocess_tied_layers(model: torch.nn.Module, touched: set[str]) -> None:
    """Re-process layers that share a reloaded layer's weight but load nothing themselves (a tied
    ``lm_head``): on CPU each keeps its own packed copy for its kernel, which the reload does not refresh."""
    modules = dict(model.named_modules())
    reloaded = {modules[name].weight.data_ptr() for name in touched
                if name in modules and getattr(modules[name], "weight", None) is not None
                and modules[name].weight.numel()}
    for name, module in modules.items():
        weight, method = getattr(module, "weight", None), getattr(module, "quant_method", None)
        if name in touched or weight is None or method is None or not weight.numel():
            continue
        if weight.data_ptr() in reloaded:
            method.process_weights_after_loading(module)
