"""DCP checkpoints load only when every file matches meta.json, and nothing in them is unpickled beyond
what DCP metadata and plain optimizer values need: crafted pickles are refused without running.

Single-process checks use world-1 DCP (no process group); one spawned world-2 gloo group saves and loads
DDP, FSDP2 and TP checkpoints and runs `load_distributed_checkpoint` on good, corrupt and crafted ones."""

import hashlib
import json
import os
import pickle
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from scalerl.checkpoint.dcp_safe_io import (
    ALLOWED_METADATA_GLOBALS,
    CheckpointIntegrityError,
    SafeFileSystemReader,
    dcp_load_safely,
)
from scalerl.checkpoint.layout import CheckpointError, verify_files
from tests.spawned_group import run_in_group


def verify_checkpoint_files(path, manifest, closed_dirs=("dcp",)):
    verify_files(Path(path), manifest, closed_dirs)


class ShellPayload:
    """Unpickling this runs ``touch marker``: what a crafted checkpoint would do with plain pickle."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class EvalPayload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return eval, (f"open({self.marker!r}, 'w').close()",)


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 8))  # weights large enough to dominate shards


def _trained(model: nn.Module) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    return optimizer


def _state(model, optimizer) -> dict:
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state}


def _manifest(root: Path) -> dict:
    """meta.json's "files", as the saver (or an attacker rewriting it) computes it."""
    files = sorted(p for p in root.rglob("*") if p.is_file())
    return {p.relative_to(root).as_posix(): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files}


def _sha256(file: Path) -> str:
    return hashlib.sha256(file.read_bytes()).hexdigest()


def _flip_bytes(file: Path, middle: int | None = None, count: int = 64) -> None:
    data = bytearray(file.read_bytes())
    middle = len(data) // 2 if middle is None else middle
    data[middle : middle + count] = bytes(b ^ 0xFF for b in data[middle : middle + count])
    file.write_bytes(bytes(data))


def _flip_tensor_bytes(dcp_dir: Path) -> None:
    """Flip bytes inside the largest stored tensor, where stock DCP loads them without noticing (the bug)."""
    metadata = SafeFileSystemReader(str(dcp_dir)).read_metadata()
    largest = max(metadata.storage_data.values(), key=lambda info: info.length)
    _flip_bytes(dcp_dir / largest.relative_path, middle=largest.offset + largest.length // 2)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _same_state(a: nn.Module, a_opt, b: nn.Module, b_opt) -> bool:
    """Local shards and optimizer state equal, exactly (same layout, same rank)."""
    params = all(torch.equal(_local(p), _local(q)) for p, q in zip(a.parameters(), b.parameters()))
    sa, sb = a_opt.state_dict(), b_opt.state_dict()
    moments = all(
        torch.equal(_local(sa["state"][i][k]), _local(sb["state"][i][k]))
        for i in sa["state"] for k in ("exp_avg", "exp_avg_sq", "step")
    )
    groups = [{k: v for k, v in g.items() if k != "params"} for g in sa["param_groups"]]
    return params and moments and groups == [{k: v for k, v in g.items() if k != "params"} for g in sb["param_groups"]]


# ----------------------------------------------------------------------------------------------
# one process (DCP without a process group)


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    """A world-1 DCP checkpoint (model and AdamW state) under ``tmp_path/ckpt/dcp``."""
    model = _model(0)
    optimizer = _trained(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: assuming a single process", expected here
        dcp.save(_state(model, optimizer), checkpoint_id=str(tmp_path / "ckpt" / "dcp"))
    return tmp_path / "ckpt"


def _load_fresh(dcp_dir: Path):
    model = _model(1)
    optimizer = _trained(model)
    state = _state(model, optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_load_safely(state, dcp_dir)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return model, optimizer


def test_good_checkpoint_loads_exactly(checkpoint):
    verify_checkpoint_files(checkpoint, _manifest(checkpoint))
    model, optimizer = _load_fresh(checkpoint / "dcp")
    reference = _model(0)
    reference_opt = _trained(reference)
    assert _same_state(reference, reference_opt, model, optimizer)
    assert optimizer.param_groups[0]["betas"] == (0.9, 0.95)  # a non-tensor item came back as a tuple


def test_payload_runs_under_stock_dcp_reader(checkpoint, tmp_path):
    """The control: the crafted .metadata really does run code when DCP's own reader loads it."""
    marker = tmp_path / "pwned"
    (checkpoint / "dcp" / ".metadata").write_bytes(pickle.dumps(ShellPayload(marker)))
    with pytest.raises(AttributeError):  # after the payload ran: os.system returned an int, not Metadata
        FileSystemReader(str(checkpoint / "dcp")).read_metadata()
    assert marker.exists()


def _nested_in_real_metadata(checkpoint: Path, payload) -> bytes:
    """Real metadata with the payload hidden deep inside, so the pickle starts out as a genuine one."""
    metadata = SafeFileSystemReader(str(checkpoint / "dcp")).read_metadata()
    metadata.storage_meta.save_id = payload
    return pickle.dumps(metadata)


@pytest.mark.parametrize("crafted, refused", [
    (lambda ckpt, marker: pickle.dumps(ShellPayload(marker)), "posix.system"),
    (lambda ckpt, marker: pickle.dumps(EvalPayload(marker)), "builtins.eval"),
    (lambda ckpt, marker: _nested_in_real_metadata(ckpt, ShellPayload(marker)), "posix.system"),
], ids=["os.system", "builtins.eval", "nested-in-real-metadata"])
def test_crafted_metadata_is_refused_even_with_a_matching_manifest(checkpoint, tmp_path, crafted, refused):
    marker = tmp_path / "pwned"
    (checkpoint / "dcp" / ".metadata").write_bytes(crafted(checkpoint, marker))
    verify_checkpoint_files(checkpoint, _manifest(checkpoint))  # the attacker rewrote meta.json too: passes
    with pytest.raises(CheckpointIntegrityError, match=rf"\.metadata references the global {refused}"):
        _load_fresh(checkpoint / "dcp")
    assert not marker.exists()


def test_no_fallback_to_rank_local_metadata_after_a_refusal(checkpoint, tmp_path):
    """DCP retries a failed .metadata with __<rank>.metadata; a clean one there must not rescue the load."""
    shutil.copy(checkpoint / "dcp" / ".metadata", checkpoint / "dcp" / "__0.metadata")
    (checkpoint / "dcp" / ".metadata").write_bytes(pickle.dumps(ShellPayload(tmp_path / "pwned")))
    with pytest.raises(CheckpointIntegrityError, match=r"\.metadata references the global posix\.system"):
        _load_fresh(checkpoint / "dcp")


def _pickle_planting_a_class_attribute() -> bytes:
    """Hand-written opcodes: BUILD with slot state on the allowed class itself, i.e. Metadata.planted = 1."""
    def text(s: str) -> bytes:
        return b"\x8c" + bytes([len(s)]) + s.encode()  # SHORT_BINUNICODE
    global_metadata = text("torch.distributed.checkpoint.metadata") + text("Metadata") + b"\x93"  # STACK_GLOBAL
    state = b"N}" + text("planted") + b"K\x01s\x86"  # (None, {"planted": 1})
    return b"\x80\x04" + global_metadata + state + b"b."  # BUILD, STOP


def test_crafted_metadata_cannot_rewrite_an_allowed_class(checkpoint):
    from torch.distributed.checkpoint.metadata import Metadata

    crafted = _pickle_planting_a_class_attribute()
    try:
        pickle.loads(crafted)  # the control: plain pickle rewrites the class for the whole process
        assert Metadata.planted == 1
    finally:
        del Metadata.planted
    (checkpoint / "dcp" / ".metadata").write_bytes(crafted)
    with pytest.raises(CheckpointIntegrityError, match=r"\.metadata sets attributes of type <class .*Metadata'>"):
        _load_fresh(checkpoint / "dcp")
    assert not hasattr(Metadata, "planted")


def test_storage_entry_pointing_outside_the_checkpoint_is_refused(checkpoint):
    metadata = SafeFileSystemReader(str(checkpoint / "dcp")).read_metadata()
    entry = next(iter(metadata.storage_data.values()))
    entry.relative_path = "../../etc/passwd"
    (checkpoint / "dcp" / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointIntegrityError, match="outside the checkpoint"):
        _load_fresh(checkpoint / "dcp")


def test_crafted_non_tensor_item_is_refused(tmp_path):
    """Non-tensor items (optimizer param_groups, any plain leaf) load with weights_only=True, never in full."""
    marker = tmp_path / "pwned"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"extra": {"note": ShellPayload(marker)}}, checkpoint_id=str(tmp_path / "dcp"))
        with pytest.raises(CheckpointIntegrityError, match=r"item 'extra.note' cannot be loaded with .*weights_only"):
            dcp_load_safely({"extra": {"note": 0}}, tmp_path / "dcp")
        with pytest.raises(CheckpointException, match="load with planner=SafeLoadPlanner"):  # DCP's wrapper
            dcp.load({"extra": {"note": 0}}, storage_reader=SafeFileSystemReader(str(tmp_path / "dcp")),
                     planner=DefaultLoadPlanner())
        assert not marker.exists()
        dcp.load({"extra": {"note": 0}}, checkpoint_id=str(tmp_path / "dcp"))  # the control: stock DCP runs it
    assert marker.exists()


@pytest.mark.parametrize("damage, message", [
    (lambda ckpt: _flip_bytes(ckpt / "dcp" / "__0_0.distcp"), r"__0_0\.distcp is corrupt: its sha256 differs"),
    (lambda ckpt: (ckpt / "dcp" / "__0_0.distcp").write_bytes(b"short"), r"__0_0\.distcp is corrupt: 5 bytes"),
    (lambda ckpt: (ckpt / "dcp" / "__0_0.distcp").unlink(), r"is missing dcp/__0_0\.distcp"),
    (lambda ckpt: (ckpt / "dcp" / "__9_0.distcp").write_bytes(b"x"), r"__9_0\.distcp is not listed in"),
], ids=["flipped-bytes", "truncated", "missing", "unlisted"])
def test_damaged_files_are_named(checkpoint, damage, message):
    manifest = _manifest(checkpoint)
    damage(checkpoint)
    with pytest.raises(CheckpointError, match=message):
        verify_checkpoint_files(checkpoint, manifest)


def test_manifest_naming_a_path_outside_the_checkpoint_is_refused(checkpoint):
    with pytest.raises(CheckpointError, match="'../../etc/passwd', a path outside"):
        verify_checkpoint_files(checkpoint, {"../../etc/passwd": {"bytes": 0, "sha256": ""}})


def test_allowed_globals_are_constructors_and_constants_only():
    """Guards against a careless widening: nothing from os, builtins, subprocess, importlib or pickle."""
    modules = {module for module, _ in ALLOWED_METADATA_GLOBALS}
    assert modules <= {"torch", "torch.serialization", "torch.distributed.checkpoint.metadata",
                       "torch.distributed.checkpoint.filesystem", "pathlib"}
    assert [name for module, name in ALLOWED_METADATA_GLOBALS if module == "torch.serialization"] == ["_get_layout"]


# ----------------------------------------------------------------------------------------------
# one spawned world-2 group: DDP, FSDP2, TP round trips; load_distributed_checkpoint on good and bad input


def _wrap(layout: str, model: nn.Module, mesh):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    from torch.nn.parallel import DistributedDataParallel

    if layout == "ddp":
        return DistributedDataParallel(model)
    if layout == "fsdp":
        return fully_shard(model, mesh=mesh)
    return parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def _round_trips(out: Path, mesh) -> dict[str, bool]:
    """Each layout: save a trained model with DCP, load it safely into a differently trained one."""
    same = {}
    for layout in ("ddp", "fsdp", "tp"):
        saved = _wrap(layout, _model(0), mesh)
        saved_opt = _trained(saved)
        dcp.save(_state(saved, saved_opt), checkpoint_id=str(out / layout))
        loaded = _wrap(layout, _model(1), mesh)
        loaded_opt = _trained(loaded)
        state = _state(loaded, loaded_opt)
        dcp_load_safely(state, out / layout)
        set_state_dict(loaded, loaded_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        same[layout] = _same_state(saved, saved_opt, loaded, loaded_opt)
    return same


def _tamper(good: Path, name: str, how) -> Path:
    """Rank 0 copies the good checkpoint and damages the copy; every rank gets its path."""
    bad = good.parent / name
    if torch.distributed.get_rank() == 0:
        shutil.copytree(good, bad)
        how(bad)
    torch.distributed.barrier()
    return bad


def _resign(ckpt: Path) -> None:
    """What an attacker who can write the checkpoint can also do: make meta.json match the new files."""
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["files"] = {k: v for k, v in _manifest(ckpt).items() if k != "meta.json"}
    (ckpt / "meta.json").write_text(json.dumps(meta))


def _distributed_loads(out: Path, rank: int) -> dict[str, str]:
    """`load_distributed_checkpoint` (DDP layout) on a good checkpoint and on damaged or crafted copies."""
    from scalerl.checkpoint.distributed import (
        load_distributed_checkpoint,
        save_distributed_checkpoint,
    )
    from scalerl.parallel.distributed import DistContext
    from scalerl.parallel.mesh import ParallelDims

    ctx = DistContext(ParallelDims(pp=1, dp_replicate=2, dp_shard=1, tp=1), mesh=None, rank=rank)
    scheduler = lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    saved = _model(0)
    saved_opt = _trained(saved)
    good = save_distributed_checkpoint(
        out / "run", 1, model=saved, optimizer=saved_opt, scheduler=scheduler(saved_opt), generators={},
        trainer_state={}, config={"seed": 0}, keep_last=3, ctx=ctx,
    )

    def load(path: Path) -> str:
        model = _model(1)
        optimizer = _trained(model)
        try:
            load_distributed_checkpoint(
                path, model=model, optimizer=optimizer, scheduler=scheduler(optimizer), generators={},
                expected_config={"seed": 0}, strict_config_keys=["seed"], ctx=ctx,
            )
        except (Exception, CheckpointException) as error:  # noqa: BLE001 - recorded: no case hides another
            return f"{type(error).__name__}: {error}"
        return "same" if _same_state(saved, saved_opt, model, optimizer) else "differs"

    def stock_load(dcp_dir: Path) -> str:  # the control: what resuming did before scalerl.checkpoint.dcp_safe_io
        model = _model(1)
        optimizer = _trained(model)
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim_pp0": optim_state}  # the keys save_distributed_checkpoint uses
        dcp.load(state, checkpoint_id=str(dcp_dir))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim_pp0"])
        return "same" if _same_state(saved, saved_opt, model, optimizer) else "differs"

    marker = out / "pwned"

    def crafted(ckpt: Path) -> None:
        (ckpt / "dcp" / ".metadata").write_bytes(pickle.dumps(ShellPayload(marker)))
        _resign(ckpt)

    results = {
        "good": load(good),
        "flipped": load(_tamper(good, "flipped", lambda c: _flip_tensor_bytes(c / "dcp"))),
        "missing": load(_tamper(good, "missing", lambda c: (c / "dcp" / "__1_0.distcp").unlink())),
        "crafted": load(_tamper(good, "crafted", crafted)),
    }
    results["marker_exists"] = str(marker.exists())
    results["stock_dcp_on_flipped"] = stock_load(out / "run" / "flipped" / "dcp")
    return results


def _crafted_item_at_world_2(out: Path) -> str:
    """A refusal inside DCP's collective read comes out as our error on every rank, not DCP's wrapper."""
    dcp.save({"extra": {"note": ShellPayload(out / "pwned-item")}}, checkpoint_id=str(out / "item"))
    try:
        dcp_load_safely({"extra": {"note": 0}}, out / "item")
    except CheckpointIntegrityError as error:
        return f"CheckpointIntegrityError: {error}"
    return "loaded"


def _checks_at_world_2(rank: int, out: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    out = Path(out)
    return {
        "round_trips": _round_trips(out / "layouts", mesh),
        "distributed_loads": _distributed_loads(out, rank),
        "crafted_item": _crafted_item_at_world_2(out),
    }


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    out = tmp_path_factory.mktemp("dcp_safe_io")
    results = run_in_group(_checks_at_world_2, 2, str(out), timeout_s=300)
    return dict(enumerate(results)), out


@pytest.mark.parametrize("layout", ["ddp", "fsdp", "tp"])
def test_world2_checkpoint_loads_exactly(world2, layout):
    results, _ = world2
    assert results[0]["round_trips"][layout] and results[1]["round_trips"][layout]


@pytest.mark.parametrize("case, expected", [
    ("good", "same$"),
    ("flipped", r"CheckpointError: .*flipped/dcp/__\d_0\.distcp is corrupt: its sha256 differs"),
    ("missing", r"CheckpointError: checkpoint .*missing is missing dcp/__1_0\.distcp"),
    ("crafted", r"CheckpointIntegrityError: .*crafted/dcp/\.metadata references the global posix\.system"),
])
def test_load_distributed_checkpoint(world2, case, expected):
    results, _ = world2
    for rank in (0, 1):
        assert re.match(expected, results[rank]["distributed_loads"][case], flags=re.DOTALL), results[rank]


def test_stock_dcp_loads_flipped_bytes_silently(world2):
    """Why the checksums matter: plain dcp.load of the flipped copy raises nothing and loads wrong weights."""
    results, _ = world2
    assert results[0]["distributed_loads"]["stock_dcp_on_flipped"] == "differs"


def test_crafted_metadata_ran_nothing_at_world2(world2):
    results, out = world2
    assert results[0]["distributed_loads"]["marker_exists"] == "False" and not (out / "pwned").exists()


def test_crafted_item_refused_on_every_rank(world2):
    results, out = world2
    for rank in (0, 1):
        assert results[rank]["crafted_item"].startswith("CheckpointIntegrityError: checkpoint item 'extra.note'")
    assert not (out / "pwned-item").exists()
