"""Resume a checkpoint under another layout or world size: weights and optimizer state identical (bitwise)
to what was saved, for FSDP world 4 -> world 2, DP2xTP2 -> DP4, distributed -> one process and one process
-> DP2xTP2 or TP2; the resumed run trains on and records the reshard in meta.json; the ranks of one
data-parallel rank (its TP peers) resume with the same RNG streams, so a TP2 resume trains on; pipeline
layouts are refused.

One spawned world-4 group and one world-2 group do the distributed parts; the test process the single ones.
Each run dumps its full (gathered) model and optimizer state, which the tests compare."""

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from scalerl.checkpoint import CheckpointError
from scalerl.core.net import free_port
from tests.spawned_group import start_processes

STEPS = 1
LAYOUTS = {
    "fsdp4": ["parallel.dp_replicate=1", "parallel.dp_shard=4"],
    "dp2tp2": ["parallel.dp_replicate=2", "parallel.tp=2"],
    "dp4": ["parallel.dp_replicate=4"],
    "fsdp2": ["parallel.dp_replicate=1", "parallel.dp_shard=2"],
    "pp2": ["parallel.dp_replicate=1", "parallel.pp=2"],
    "tp2": ["parallel.dp_replicate=1", "parallel.tp=2"],
    "single": [],
}


def _config(out: Path, name: str, layout: str, *extra: str):
    from scalerl.core.config import load_config
    from scalerl.verify import verification_overrides

    return load_config(None, [*verification_overrides(STEPS), *LAYOUTS[layout], f"trainer.output_dir={out / name}",
                              "trainer.save_every=1", *extra])


def _dump(trainer, file: Path) -> None:
    """Full model and optimizer state of ``trainer`` (collective), written by rank 0 as safetensors."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_state, optim_state = get_state_dict(trainer.state_module(), trainer.optimizer,
                                              options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if trainer.dist.is_main:
        flat = {f"model/{k}": v.detach().clone().contiguous() for k, v in model_state.items()}
        for fqn, values in optim_state["state"].items():
            flat.update({f"optim/{fqn}/{k}": torch.as_tensor(v).clone().contiguous() for k, v in values.items()})
        groups = [{k: v for k, v in g.items()} for g in optim_state["param_groups"]]
        save_file(flat, str(file), metadata={"param_groups": json.dumps(groups, sort_keys=True, default=str),
                                             "scheduler": json.dumps(trainer.scheduler.state_dict(), default=str),
                                             "step": str(trainer.step)})


def _train_and_dump(out: Path, name: str, layout: str) -> None:
    from scalerl.trainer.rl_trainer import RLTrainer

    trainer = RLTrainer.from_config(_config(out, name, layout))
    trainer.fit()  # the last step is saved: the dump is what the checkpoint holds
    _dump(trainer, out / f"{name}.safetensors")


def _resume_and_dump(out: Path, name: str, layout: str, source: str, *extra: str):
    from scalerl.trainer.rl_trainer import RLTrainer

    checkpoint = out / source / "checkpoints" / f"step_{STEPS:08d}"
    trainer = RLTrainer.from_config(_config(out, name, layout, f"trainer.resume={checkpoint}", *extra))
    _dump(trainer, out / f"{name}.safetensors")
    return trainer


def _record_rng(trainer, out: Path, name: str) -> bool:
    """This rank's RNG streams (a digest of Python's, NumPy's, torch's and the update shuffler's) and its DP
    rank, in ``rng-<name>-<rank>.json``; True when every rank's TP peers (same DP rank) hold the same ones."""
    import hashlib

    from scalerl.core.rng_state import capture_rng_state

    state = capture_rng_state(trainer.generators)
    digest = hashlib.sha256(repr(state["python"]).encode())
    for tensor in (state["numpy"]["keys"], state["torch_cpu"], *state["generators"].values()):
        digest.update(tensor.numpy().tobytes())
    mine = {"dp_rank": trainer.dist.dp_rank, "rng": digest.hexdigest()}
    (out / f"rng-{name}-{trainer.dist.rank}.json").write_text(json.dumps(mine))
    everyone: list = [None] * trainer.dist.world_size
    torch.distributed.all_gather_object(everyone, mine)
    return all(other["rng"] == mine["rng"] for other in everyone if other["dp_rank"] == mine["dp_rank"])


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")
    out = Path(out)
    try:
        if world == 4:
            _train_and_dump(out, "fsdp4", "fsdp4")
            _train_and_dump(out, "dp2tp2", "dp2tp2")
            _resume_and_dump(out, "dp2tp2-as-dp4", "dp4", "dp2tp2")
            _record_rng(_resume_and_dump(out, "single-as-dp2tp2", "dp2tp2", "single"), out, "single-as-dp2tp2")
        else:
            trainer = _resume_and_dump(out, "fsdp4-as-fsdp2", "fsdp2", "fsdp4", f"trainer.total_steps={STEPS + 1}")
            trainer.fit()  # trains on from the resharded state and saves step STEPS + 1
            try:
                _resume_and_dump(out, "fsdp4-as-pp2", "pp2", "fsdp4")
            except CheckpointError as error:  # the refusal is the result
                (out / f"pp2-refusal-{rank}.txt").write_text(str(error))
            trainer = _resume_and_dump(out, "single-as-tp2", "tp2", "single", f"trainer.total_steps={STEPS + 1}")
            if _record_rng(trainer, out, "single-as-tp2"):  # peers that disagree would mismatch a collective
                trainer.fit()
    finally:
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("reshard")
    from scalerl.trainer.rl_trainer import RLTrainer

    single = RLTrainer.from_config(_config(out, "single", "single"))
    single.fit()
    _dump(single, out / "single.safetensors")
    for world in (4, 2):
        start_processes(_worker, (world, free_port(), str(out)), world)
    for source in ("fsdp4", "dp2tp2"):
        _resume_and_dump(out, f"{source}-as-single", "single", source)
    return out


def _assert_same_state(out: Path, saved: str, resumed: str) -> None:
    a, b = load_file(str(out / f"{saved}.safetensors")), load_file(str(out / f"{resumed}.safetensors"))
    assert sorted(a) == sorted(b)
    assert any(k.startswith("optim/") and k.endswith("/exp_avg_sq") for k in a)  # the optimizer moved
    for key in a:
        assert torch.equal(a[key], b[key]), key
    from safetensors import safe_open

    metas = []
    for name in (saved, resumed):
        with safe_open(str(out / f"{name}.safetensors"), framework="pt") as handle:
            metas.append(handle.metadata())
    for field in ("param_groups", "scheduler", "step"):
        assert metas[0][field] == metas[1][field], field


@pytest.mark.parametrize("saved, resumed", [
    ("fsdp4", "fsdp4-as-fsdp2"), ("dp2tp2", "dp2tp2-as-dp4"), ("fsdp4", "fsdp4-as-single"),
    ("dp2tp2", "dp2tp2-as-single"), ("single", "single-as-dp2tp2"), ("single", "single-as-tp2"),
])
def test_resharded_resume_restores_weights_and_optimizer_exactly(runs, saved, resumed):
    _assert_same_state(runs, saved, resumed)


def test_resharded_run_trains_on_and_records_the_reshard(runs):
    meta = json.loads((runs / "fsdp4-as-fsdp2" / "checkpoints" / f"step_{STEPS + 1:08d}" / "meta.json").read_text())
    [record] = meta["reshard_history"]
    assert record["step"] == STEPS
    assert record["from"] == {"world_size": 4, "layout": {"pp": 1, "dp_replicate": 1, "dp_shard": 4, "tp": 1}}
    assert record["to"] == {"world_size": 2, "layout": {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "tp": 1}}
    assert "optimizer state" in record["exact"] and "RNG" in record["re_derived"][0]
    rows = [json.loads(x) for x in (runs / "fsdp4-as-fsdp2" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [STEPS + 1] and rows[0]["actor/grad_norm"] > 0


@pytest.mark.parametrize("resumed, world", [("single-as-dp2tp2", 4), ("single-as-tp2", 2)])
def test_tp_peers_resume_with_the_same_rng_streams(runs, resumed, world):
    """A resharded resume re-derives the RNG streams; the TP peers of a DP rank hold the same rows and must
    draw the same shuffle (they once drew per global rank: a TP2 resume then mismatched gloo sizes)."""
    by_dp_rank: dict[int, set[str]] = {}
    for rank in range(world):
        record = json.loads((runs / f"rng-{resumed}-{rank}.json").read_text())
        by_dp_rank.setdefault(record["dp_rank"], set()).add(record["rng"])
    assert len(by_dp_rank) == world // 2  # two TP peers per DP rank
    assert all(len(streams) == 1 for streams in by_dp_rank.values()), by_dp_rank


def test_single_checkpoint_trains_on_under_tp(runs):
    rows = [json.loads(x) for x in (runs / "single-as-tp2" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [STEPS + 1] and rows[0]["actor/grad_norm"] > 0
    meta = json.loads((runs / "single-as-tp2" / "checkpoints" / f"step_{STEPS + 1:08d}" / "meta.json").read_text())
    assert [r["to"]["layout"]["tp"] for r in meta["reshard_history"]] == [2]


def test_pipeline_layouts_are_refused_naming_both(runs):
    for rank in (0, 1):
        message = (runs / f"pp2-refusal-{rank}.txt").read_text()
        assert "'dp_shard': 4" in message and "'pp': 2" in message and "not resharded" in message


@pytest.mark.parametrize("layout", ["fsdp4", "dp2tp2"])
def test_distributed_checkpoint_exports_to_transformers(runs, layout, tmp_path):
    pytest.importorskip("transformers")
    from scalerl.cli import main
    from tests.checkpoint.hf_compare import assert_loads_in_transformers

    assert main(["export", str(runs / layout / "checkpoints" / f"step_{STEPS:08d}"), str(tmp_path / "hf")]) == 0
    assert_loads_in_transformers(tmp_path / "hf", runs / layout / "final")


def test_distributed_checkpoint_files_follow_the_umask(runs):
    """Every rank's shards and rank 0's files: 0644 under the umask 022 the tests run with (docs/reliability.md)."""
    import stat

    from scalerl.core.file_modes import dir_mode, file_mode

    step = runs / "fsdp4" / "checkpoints" / f"step_{STEPS:08d}"
    paths = [step, *step.rglob("*"), *(runs / "fsdp4" / "final").rglob("*")]
    assert any(p.suffix == ".distcp" for p in paths)
    for path in paths:
        assert stat.S_IMODE(path.stat().st_mode) == (dir_mode() if path.is_dir() else file_mode()), path
