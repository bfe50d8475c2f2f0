"""`data.streaming=true`: Parquet and Arrow files read lazily by row group, a share per data-parallel rank,
shuffled within a bounded window, the position resumed exactly; bad rows fail as the whole-file loader fails."""

import pyarrow
import pyarrow.ipc
import pyarrow.parquet
import pytest

from scalerl.core.config import ConfigError, load_config
from scalerl.data.errors import DataError
from scalerl.data.loaders import load_rows
from scalerl.data.sources import rows_from_config
from scalerl.data.streaming import StreamingPromptStream
from scalerl.trainer.rl_trainer import RLTrainer
from tests.data.test_formats import verl_record
from tests.spawned_group import run_in_group
from tests.tiny import record_step_rows, tiny_overrides


def verl_rows(start, count):
    """verl gsm8k-style records whose ground truth is their global index (as text)."""
    return [verl_record(f"What is {i} + 0?", str(i), extra_info={"index": i}) for i in range(start, start + count)]


def write_verl_parquet(path, records, row_group_size=7):
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(records), path, row_group_size=row_group_size)
    return path


@pytest.fixture
def two_files(tmp_path):
    """103 rows in two Parquet files of 7-row groups (60 + 43): ground truths "0".."102" in file order."""
    return [write_verl_parquet(tmp_path / "a.parquet", verl_rows(0, 60)),
            write_verl_parquet(tmp_path / "b.parquet", verl_rows(60, 43))]


def stream(paths, batch_size=4, seed=0, **options):
    return StreamingPromptStream(paths, batch_size, seed, **options)


def truths(rows):
    return [int(row["ground_truth"]) for row in rows]


def test_rank_shares_are_disjoint_equal_and_cover_all_but_the_remainder(two_files):
    ranks = [stream(two_files, batch_size=6, rank=r, ranks=2, gather=lambda share: share, shuffle_buffer=20)
             for r in range(2)]
    assert [s.share_rows for s in ranks] == [51, 51]  # 103 // 2; the last row is the remainder
    epoch = [[i for _ in range(17) for i in truths(s.next_share())] for s in ranks]  # 17 x 3 rows = one epoch
    assert set(epoch[0]) == set(range(51)) and set(epoch[1]) == set(range(51, 102))
    assert len(epoch[0]) == len(set(epoch[0])) == 51  # no row twice within an epoch
    # Each rank converted its own rows only, each once (rank 1 starts in the middle of a.parquet's 8th group).
    assert [s.converted_rows for s in ranks] == [51, 51]
    assert ranks[1].pieces[0].start == 51 - 49 and ranks[1].pieces[0].file == 0
    assert all(s.state_dict() == {"position": 102} for s in ranks)
    second = [truths(s.next_share()) for s in ranks]  # epoch 2 restarts each share in a new order
    assert set(second[0]) <= set(range(51)) and set(second[1]) <= set(range(51, 102))


def test_the_window_bounds_what_is_held_and_epochs_are_permutations(two_files):
    s = stream(two_files, batch_size=4, shuffle_buffer=10)
    drawn = []
    for _ in range(60):  # 240 rows: two epochs of 103 and a part
        drawn.extend(truths(s.next_batch()))
        assert 0 < s.held_rows <= 10
        assert s.converted_rows <= s.position + 10  # never more than one window ahead of what was drawn
    first, second = drawn[:103], drawn[103:206]
    assert sorted(first) == sorted(second) == list(range(103))
    assert first != list(range(103)) and first != second  # shuffled, anew each epoch
    in_order = stream(two_files, batch_size=4, shuffle=False, shuffle_buffer=10)
    assert [i for _ in range(26) for i in truths(in_order.next_batch())][:103] == list(range(103))


def test_order_is_fixed_by_the_seed(two_files):
    def draws(seed):
        s = stream(two_files, seed=seed, shuffle_buffer=16)
        return [truths(s.next_batch()) for _ in range(40)]

    assert draws(3) == draws(3)
    assert draws(3) != draws(4)


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_restored_stream_gives_the_rows_of_an_uninterrupted_one(two_files, ranks):
    def make(rank):
        return stream(two_files, batch_size=6 * ranks, rank=rank, ranks=ranks, gather=lambda share: share,
                      shuffle_buffer=8, seed=5)

    for rank in range(ranks):
        straight = make(rank)
        expected = [truths(straight.next_share()) for _ in range(30)]  # crosses epoch boundaries
        first = make(rank)
        for _ in range(13):
            first.next_share()
        state = first.state_dict()
        assert state == {"position": 13 * 6 * ranks}  # the rows all ranks drew
        resumed = make(rank)
        resumed.load_state_dict(state)
        assert [truths(resumed.next_share()) for _ in range(17)] == expected[13:]
        # Read again: the current window (its rows drawn before the save), not the stream's past.
        assert resumed.converted_rows <= 17 * 6 + 2 * 8


def test_rows_match_the_whole_file_loader_and_arrow_files_stream(tmp_path, two_files):
    whole = load_rows(two_files)
    s = stream(two_files, batch_size=1, shuffle=False, shuffle_buffer=5)
    assert [s.next_batch()[0] for _ in range(103)] == whole  # the same conversion, row for row
    table = pyarrow.Table.from_pylist(verl_rows(0, 30))
    with pyarrow.ipc.new_stream(tmp_path / "s.arrow", table.schema) as writer:  # what `datasets` writes
        for batch in table.to_batches(max_chunksize=4):
            writer.write_batch(batch)
    with pyarrow.ipc.new_file(tmp_path / "f.arrow", table.schema) as writer:
        for batch in table.to_batches(max_chunksize=6):
            writer.write_batch(batch)
    for name in ("s.arrow", "f.arrow"):
        arrow = stream([tmp_path / name], batch_size=3, shuffle_buffer=7, seed=1)
        got = [i for _ in range(10) for i in truths(arrow.next_batch())]
        assert sorted(got) == list(range(30)) and got != list(range(30))


def test_saved_dataset_directory_streams_through_the_config(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(verl_rows(0, 12)).save_to_disk(str(tmp_path / "ds"))
    from scalerl.data.sources import prompt_stream_from_config
    from scalerl.parallel.distributed import single_process_context

    cfg = load_config(None, [f"data.train_files=[{tmp_path / 'ds'}]", "data.streaming=true", "data.shuffle_buffer=5"])
    s = prompt_stream_from_config(cfg.data, 4, 0, single_process_context())
    assert isinstance(s, StreamingPromptStream)
    assert sorted(i for _ in range(3) for i in truths(s.next_batch())) == list(range(12))


def _bad_rows_file(path, bad):
    """20 good rows, then `bad` (row 21, in the third 8-row group), then 3 good ones."""
    return write_verl_parquet(path, [*verl_rows(0, 20), bad, *verl_rows(21, 3)], row_group_size=8)


@pytest.mark.parametrize("bad, message", [
    (verl_record(ground_truth=None), "row 21: missing field 'reward_model.ground_truth'"),
    (verl_record(prompt=[{"role": "robot", "content": "hi"}]), r"row 21: field 'prompt\[0\].role' is 'robot'"),
])
def test_a_bad_row_is_the_whole_file_loaders_error(tmp_path, bad, message):
    path = _bad_rows_file(tmp_path / "bad.parquet", bad)
    with pytest.raises(DataError, match=message) as whole:
        load_rows(path)
    s = stream([path], batch_size=4, shuffle_buffer=6)
    with pytest.raises(DataError) as streamed:
        for _ in range(6):
            s.next_batch()
    assert str(streamed.value) == str(whole.value)


def test_non_utf8_text_names_the_files_row_and_field(tmp_path):
    good = pyarrow.array([f"row {i}".encode() for i in range(10)] + [b"caf\xe9"] + [b"ok"] * 5, pyarrow.binary())
    prompts = pyarrow.Array.from_buffers(pyarrow.string(), 16, good.buffers())  # invalid UTF-8, unchecked
    table = pyarrow.table({"prompt": prompts, "ground_truth": [str(i) for i in range(16)]})
    pyarrow.parquet.write_table(table, tmp_path / "latin1.parquet", row_group_size=4)
    with pytest.raises(DataError) as whole:
        load_rows(tmp_path / "latin1.parquet")
    s = stream([tmp_path / "latin1.parquet"], batch_size=2, shuffle=False, shuffle_buffer=3)
    with pytest.raises(DataError, match=r"latin1\.parquet, row 11, field 'prompt': text is not UTF-8") as streamed:
        for _ in range(8):
            s.next_batch()
    assert str(streamed.value) == str(whole.value)


def test_unsupported_inputs_and_settings_are_errors_naming_the_fix(tmp_path, two_files):
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text('{"prompt": "1+1?", "ground_truth": "2"}\n')
    with pytest.raises(DataError, match=r"train\.jsonl: data.streaming=true reads Parquet.*pyarrow.parquet.write_"
                                        r"table.*train\.parquet.*or set data.streaming=false"):
        stream([jsonl])
    (tmp_path / "train.csv").write_text("prompt,ground_truth\n")
    with pytest.raises(DataError, match=r"train\.csv: data.streaming=true streams Parquet.*not '\.csv'"):
        stream([tmp_path / "train.csv"])
    with pytest.raises(DataError, match=r"trainer.batch_size=120 exceeds the 102 training rows"):
        stream(two_files, batch_size=120, rank=0, ranks=2, gather=lambda share: share)
    with pytest.raises(ConfigError, match=r"data.shuffle_buffer must be >= 1, got 0"):
        load_config(None, [f"data.train_files=[{two_files[0]}]", "data.streaming=true", "data.shuffle_buffer=0"])
    with pytest.raises(ConfigError, match=r"data.streaming=true streams data.train_files, and there are none"):
        load_config(None, ["data.streaming=true"])
    sft = load_config(None, [f"data.train_files=[{two_files[0]}]", "data.streaming=true"])
    with pytest.raises(DataError, match=r"data.streaming=true is for RL runs.*SFT reads data.train_files whole"):
        rows_from_config(sft.data, "train", 0)  # what the SFT trainer reads its rows with


def test_files_without_a_row_are_named(tmp_path, two_files):
    empty = tmp_path / "empty.parquet"
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(verl_rows(0, 1)).slice(0, 0), empty)
    with pytest.raises(DataError, match=r"the training set is empty: no rows in data.train_files \(\S*empty\.parquet, "
                                        r"\S*empty\.parquet\); put rows in them"):
        stream([empty, empty])
    assert stream([empty, two_files[0]]).next_batch()  # an empty file among others is no error


# --------------------------------------------------------------------------------------- through the trainer
def _streaming_run(data_file, out, *changes):
    return load_config(None, tiny_overrides(
        f"data.train_files=[{data_file}]", "data.streaming=true", "data.shuffle_buffer=6", "data.reward=gsm8k",
        "data.max_prompt_length=96", "trainer.batch_size=4", "actor.ppo_mini_batch_size=8", "rollout.n=2",
        "rollout.max_new_tokens=4", f"trainer.output_dir={out}", *changes))


def _rows_per_step(cfg):
    """The trainer of ``cfg`` and, per step, this rank's rows (filled as it runs)."""
    rows: list[list[dict]] = []
    trainer = RLTrainer.from_config(cfg)
    record_step_rows(trainer, rows)
    return trainer, rows


def _straight_and_resumed(data_file, out, *changes):
    straight, expected = _rows_per_step(_streaming_run(data_file, f"{out}/a", "trainer.total_steps=5", *changes))
    straight.fit()
    _rows_per_step(_streaming_run(data_file, f"{out}/b", "trainer.total_steps=2", "trainer.save_every=2",
                                  *changes))[0].fit()
    resumed, after = _rows_per_step(_streaming_run(data_file, f"{out}/b", "trainer.total_steps=5",
                                                   "trainer.resume=auto", *changes))
    assert resumed.step == 2
    resumed.fit()
    return {"expected": [truths(r) for r in expected], "after": [truths(r) for r in after],
            "position": resumed.stream.state_dict()["position"]}


def test_trainer_resumes_the_stream_at_world_one(tmp_path):
    data = write_verl_parquet(tmp_path / "train.parquet", verl_rows(0, 10), row_group_size=3)
    result = _straight_and_resumed(data, tmp_path)
    assert len(result["expected"]) == 5 and result["after"] == result["expected"][2:]
    assert sorted(i for step in result["expected"][:2] for i in step) != list(range(8))  # shuffled, not file order
    assert result["position"] == 5 * 4


def _two_rank_runs(rank, data_file, out):
    return _straight_and_resumed(data_file, out, "parallel.dp_replicate=2")


def test_trainer_resumes_the_stream_with_two_data_parallel_ranks(tmp_path):
    data = write_verl_parquet(tmp_path / "train.parquet", verl_rows(0, 11), row_group_size=3)
    ranks = run_in_group(_two_rank_runs, 2, str(data), str(tmp_path), timeout_s=900)
    for rank, result in enumerate(ranks):
        assert len(result["expected"]) == 5 and result["after"] == result["expected"][2:]
        assert all(len(step) == 2 for step in result["expected"])
        share = range(5) if rank == 0 else range(5, 10)  # 11 // 2 rows each; row 10 is the remainder
        assert {i for step in result["expected"] for i in step} <= set(share)
        assert result["position"] == 5 * 4
