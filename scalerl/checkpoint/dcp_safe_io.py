"""Load torch.distributed.checkpoint (DCP) checkpoints without trusting their pickles or their bytes.

What DCP in torch 2.13 unpickles when ``dcp.load`` reads a ``FileSystemReader`` checkpoint, and what this
module does about each:

1. ``.metadata`` (and the rank-local ``__<rank>.metadata`` DCP falls back to): ``FileSystemReader.read_metadata``
   runs plain ``pickle.load`` before any check, so a crafted file runs code on every rank.
   `SafeFileSystemReader.read_metadata` unpickles it with `MetadataUnpickler`, which resolves only the
   globals in `ALLOWED_METADATA_GLOBALS` and refuses any other, naming it, and sets state (BUILD) only on
   instances of DCP's dataclasses; then it checks that the result is a `Metadata` whose storage entries
   name plain files inside the checkpoint directory, untransformed.
2. Tensor items of ``.distcp`` shards: ``FileSystemReader.read_data`` reads them with
   ``torch.load(..., weights_only=True)`` already; nothing to change.
3. Non-tensor ("bytes") items of ``.distcp`` shards (each optimizer ``param_groups`` entry: lr, betas,
   parameter names ...; any non-tensor leaf of the state dict): the reader hands them to
   ``planner.load_bytes``, and ``DefaultLoadPlanner.load_bytes`` runs ``torch.load(value, weights_only=False)``,
   a full unpickle. `SafeLoadPlanner.load_bytes` uses ``weights_only=True``, and `SafeFileSystemReader`
   refuses to hand bytes to any other planner. (The byte items of DDP/FSDP2/TP optimizer states reference
   no globals at all: plain numbers, strings, bools, None, lists and tuples.)

`verify_checkpoint_files` checks, before any of the above reads a byte, every file meta.json lists (size and
sha256) and that ``dcp/`` holds no file it does not list: that catches corruption, such as flipped bytes in
a shard, which DCP would otherwise load silently. Whoever can rewrite a shard can rewrite meta.json too, so
the checksums guard against accidents only; the restricted unpicklers guard against malice.

How `ALLOWED_METADATA_GLOBALS` was derived (torch 2.13): DCP checkpoints with AdamW state of DDP, FSDP2
(DTensor shards) and tensor-parallel models at world 2, HSDP (bf16) and FSDP2 x TP at world 4, and scalerl
trainer checkpoints (ddp, fsdp, tp, pp; PPO with a critic) were unpickled by an unpickler that recorded
every ``find_class`` call. All referenced the same globals: the `torch.distributed.checkpoint.metadata`
dataclasses and enum, ``filesystem._StorageInfo``, ``torch.Size``, dtypes (``torch.float32``,
``torch.bfloat16``), ``torch.serialization._get_layout`` (how a ``torch.layout`` pickles) and
``pathlib.PosixPath`` (``StorageMeta.checkpoint_id``, the path DCP saved to). Dicts, lists, tuples, sets,
strings and numbers are built by pickle opcodes and need no global. Every dtype is allowed (an int64 or
fp8 tensor is as legitimate as an fp32 one); nothing callable beyond these constructors is. Should a torch
upgrade pickle another global, loading fails with an error naming it (tests/test_dcp_safe_io.py saves and
loads real DDP, FSDP2 and TP checkpoints), to be reviewed and added here.
"""

from __future__ import annotations

import io
import os
import pickle
import warnings
from pathlib import Path, PurePath
from typing import Any, BinaryIO, ClassVar

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
)
from torch.futures import Future

from scalerl.checkpoint.layout import CheckpointError


class CheckpointIntegrityError(CheckpointError):
    """A checkpoint file holds something that may not be unpickled."""


# ----------------------------------------------------------------------------------------------
# .metadata: a restricted unpickler


def _allowed_metadata_globals() -> dict[tuple[str, str], Any]:
    """(module, name) as pickle writes them -> the object to hand back. Classes are keyed by their own
    ``__module__``/``__qualname__``, so the table follows torch if it moves them."""
    classes = [
        dcp_metadata.Metadata, dcp_metadata.MetadataIndex, dcp_metadata.StorageMeta,
        dcp_metadata.TensorStorageMetadata, dcp_metadata.BytesStorageMetadata, dcp_metadata.ChunkStorageMetadata,
        dcp_metadata.TensorProperties, dcp_metadata._MEM_FORMAT_ENCODING, _StorageInfo,
        torch.Size, type(Path()),  # PosixPath here: StorageMeta.checkpoint_id is the path DCP saved to
    ]
    allowed: dict[tuple[str, str], Any] = {(c.__module__, c.__qualname__): c for c in classes}
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout  # torch.layout's reducer
    for name, value in vars(torch).items():
        if isinstance(value, torch.dtype):  # dtypes pickle as the global torch.<name>
            allowed[("torch", name)] = value
    return allowed


ALLOWED_METADATA_GLOBALS: dict[tuple[str, str], Any] = _allowed_metadata_globals()


# The only objects whose state a pickle may set (BUILD): instances of the DCP dataclasses.
_BUILDABLE_TYPES = frozenset({
    dcp_metadata.Metadata, dcp_metadata.MetadataIndex, dcp_metadata.StorageMeta, dcp_metadata.TensorStorageMetadata,
    dcp_metadata.BytesStorageMetadata, dcp_metadata.ChunkStorageMetadata, dcp_metadata.TensorProperties, _StorageInfo,
})


class MetadataUnpickler(pickle._Unpickler):
    """Unpickles DCP metadata; any global outside `ALLOWED_METADATA_GLOBALS` is refused before it is looked
    up, so nothing is imported or called that DCP metadata does not legitimately contain.

    The pure-Python unpickler, because the C one cannot be told which objects BUILD may touch: a BUILD
    aimed at an allowed class, function or enum member would rewrite its attributes process-wide. It takes
    about 2.3x the C one's time (2.9 s instead of 1.2 s of CPU for 11.6 MB of metadata: 65k shards)."""

    dispatch: ClassVar[dict] = dict(pickle._Unpickler.dispatch)  # pickle's opcode table; BUILD replaced below

    def __init__(self, file: BinaryIO, *, source: str) -> None:
        super().__init__(file)
        self.source = source

    def load_build(self) -> None:
        target = self.stack[-2]  # BUILD pops the state, then sets it on the object below
        if type(target) not in _BUILDABLE_TYPES:
            raise CheckpointIntegrityError(
                f"{self.source} sets attributes of {type(target).__name__} {target!r:.80}, which DCP metadata "
                "never does: refusing to unpickle it"
            )
        super().load_build()

    dispatch[pickle.BUILD[0]] = load_build

    def find_class(self, module: str, name: str) -> Any:
        try:
            return ALLOWED_METADATA_GLOBALS[(module, name)]
        except KeyError:
            raise CheckpointIntegrityError(
                f"{self.source} references the global {module}.{name}, which DCP metadata never contains: "
                "refusing to unpickle it"
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointIntegrityError(f"{self.source} holds a persistent id, which DCP metadata never contains")


def load_dcp_metadata(file: BinaryIO, *, source: str) -> Metadata:
    """Unpickle a DCP ``.metadata`` stream with `MetadataUnpickler` and check what came out."""
    try:
        metadata = MetadataUnpickler(file, source=source).load()
    except CheckpointIntegrityError:
        raise
    except Exception as error:  # malformed input of any kind: do not trust it
        raise CheckpointIntegrityError(f"{source} is not valid DCP metadata: {error!r}") from error
    _check_metadata(metadata, source)
    return metadata


def _check_metadata(metadata: Any, source: str) -> None:
    """Allowed classes can still be arranged badly: storage entries must name plain files in the checkpoint
    directory (no path out of it) and carry no stream transforms (scalerl writes none)."""
    if not isinstance(metadata, Metadata):
        raise CheckpointIntegrityError(f"{source} holds a {type(metadata).__name__}, not DCP Metadata")
    if not isinstance(metadata.storage_data, dict):
        kind = type(metadata.storage_data).__name__
        raise CheckpointIntegrityError(f"{source}: storage_data is a {kind}, not a dict")
    for index, info in metadata.storage_data.items():
        if not isinstance(info, _StorageInfo):
            raise CheckpointIntegrityError(f"{source}: storage entry {index} is a {type(info).__name__}")
        name = info.relative_path
        if not isinstance(name, str) or PurePath(name).name != name or name in ("", ".", ".."):
            raise CheckpointIntegrityError(
                f"{source}: storage entry {index} points at {name!r}, outside the checkpoint"
            )
        if info.transform_descriptors:
            raise CheckpointIntegrityError(
                f"{source}: storage entry {index} asks for stream transforms {info.transform_descriptors}"
            )


# ----------------------------------------------------------------------------------------------
# DCP reader and planner


class SafeLoadPlanner(DefaultLoadPlanner):
    """`DefaultLoadPlanner` whose non-tensor items are loaded with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except Exception as error:  # whatever the failure, not plain data
            raise CheckpointIntegrityError(
                f"checkpoint item {fqn!r} cannot be loaded with torch.load(weights_only=True): {error}"
            ) from error
        # The rest mirrors DefaultLoadPlanner.load_bytes (torch 2.13).
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


class SafeFileSystemReader(FileSystemReader):
    """`FileSystemReader` that unpickles ``.metadata`` with `MetadataUnpickler` and feeds non-tensor items
    only to a `SafeLoadPlanner`. Tensor items keep torch's own ``weights_only=True`` load."""

    refusal: CheckpointIntegrityError | None = None  # kept: dcp.load reports it only as text

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.refusal is not None:  # no falling back to rank-local metadata once a pickle was refused
            raise self.refusal
        rank = kwargs.get("rank")
        file = Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata")  # DCP's two names
        try:
            with open(file, "rb") as stream:
                metadata = load_dcp_metadata(stream, source=str(file))
        except CheckpointIntegrityError as error:
            self.refusal = self.refusal or error
            raise
        # As FileSystemReader.read_metadata does: DCP expects storage_meta with this load's id.
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if not isinstance(planner, SafeLoadPlanner) and any(i.type == LoadItemType.BYTE_IO for i in plan.items):
            raise CheckpointIntegrityError(
                f"{type(planner).__name__} may unpickle non-tensor items of {self.path} without restriction: "
                "load with planner=SafeLoadPlanner()"
            )
        return super().read_data(plan, planner)


def dcp_load_safely(state_dict: dict[str, Any], checkpoint_dir: str | os.PathLike, process_group=None) -> None:
    """``dcp.load`` into ``state_dict`` (in place) with `SafeFileSystemReader` and `SafeLoadPlanner`.

    Collective when a process group is initialized (every rank calls it); works without one (world 1).
    Raises `CheckpointIntegrityError` itself rather than DCP's wrappers around it.
    """
    reader = SafeFileSystemReader(checkpoint_dir)
    try:
        with warnings.catch_warnings():  # one process reading (scalerl export) is intended, not a slip
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
            dcp.load(state_dict, storage_reader=reader, planner=SafeLoadPlanner(), process_group=process_group)
    except (Exception, CheckpointException) as error:  # CheckpointException is a BaseException
        ours = _integrity_errors(error)
        if reader.refusal is not None or ours:
            raise (reader.refusal or ours[0]) from error
        raise


def _integrity_errors(error: BaseException) -> list[CheckpointIntegrityError]:
    """Our errors inside DCP's wrapper, which holds each failed rank's exception."""
    if not isinstance(error, CheckpointException):
        return []
    return [exc for exc, _ in error.failures.values() if isinstance(exc, CheckpointIntegrityError)]
