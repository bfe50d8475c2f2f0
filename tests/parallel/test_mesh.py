"""Layout resolution and the errors that name the dimensions."""

import pytest

from scalerl.core.config import ParallelSection
from scalerl.models.config import ModelConfig
from scalerl.parallel.mesh import LayoutError, ParallelDims


def dims(world, **kw):
    return ParallelDims.from_config(ParallelSection(**kw), world)


def test_fill_dimension_takes_the_rest():
    assert dims(8, tp=2) == ParallelDims(pp=1, dp_replicate=4, dp_shard=1, tp=2)
    assert dims(8, dp_replicate=2, dp_shard=-1) == ParallelDims(pp=1, dp_replicate=2, dp_shard=4, tp=1)
    assert dims(4, dp_replicate=1, dp_shard=2, tp=2).dp == 2


def test_product_mismatch_names_dimensions():
    with pytest.raises(LayoutError, match=r"pp=1, dp_replicate=2, dp_shard=2, sp=1, tp=2 multiplies to 8.*world size is 4"):
        dims(4, dp_replicate=2, dp_shard=2, tp=2)
    with pytest.raises(LayoutError, match="not divisible"):
        dims(6, tp=4)


def test_sequence_parallel_sits_inside_data_parallel():
    assert dims(8, sp=2) == ParallelDims(pp=1, dp_replicate=4, dp_shard=1, tp=1, sp=2)
    assert dims(8, sp=2).dp == 4 and dims(8, sp=2).world_size == 8
    assert dims(4, dp_replicate=1, dp_shard=-1, sp=2).dp_shard == 2
    with pytest.raises(LayoutError, match=r"parallel.sp=4 does not divide the world size 6"):
        dims(6, sp=4)
    with pytest.raises(LayoutError, match=r"sp=2, tp=2 multiplies to 4.*world size is 2"):
        dims(2, dp_replicate=1, sp=2, tp=2)
    with pytest.raises(LayoutError, match=r"parallel.sp=2 runs with data parallelism only.*parallel.tp"):
        dims(4, dp_replicate=1, sp=2, tp=2)
    heads = ModelConfig(hidden_size=48, num_attention_heads=6, num_key_value_heads=3, intermediate_size=96)
    with pytest.raises(LayoutError, match=r"parallel.sp=4 does not divide model num_attention_heads=6"):
        ParallelDims(pp=1, dp_replicate=1, dp_shard=1, tp=1, sp=4).check_model(heads)
    with pytest.raises(LayoutError, match=r"parallel.sp=2 and model num_key_value_heads=3"):
        ParallelDims(pp=1, dp_replicate=1, dp_shard=1, tp=1, sp=2).check_model(heads)
    ParallelDims(pp=1, dp_replicate=1, dp_shard=1, tp=1, sp=3).check_model(heads)  # 6 / 3 and 3 / 3


def test_model_divisibility_names_the_field():
    cfg = ModelConfig(hidden_size=48, num_attention_heads=6, num_key_value_heads=3, intermediate_size=96, num_hidden_layers=3)
    with pytest.raises(LayoutError, match=r"num_key_value_heads=3 is not divisible by parallel.tp=2"):
        ParallelDims(pp=1, dp_replicate=1, dp_shard=1, tp=2).check_model(cfg)
    with pytest.raises(LayoutError, match=r"num_hidden_layers=3 is not divisible by parallel.pp=2"):
        ParallelDims(pp=2, dp_replicate=1, dp_shard=1, tp=1).check_model(cfg)


def test_single_process_rejects_a_multi_rank_layout():
    import torch

    from scalerl.parallel.distributed import init_distributed

    with pytest.raises(LayoutError, match=r"world size 1 is not divisible .*tp=2"):
        init_distributed(ParallelSection(tp=2), torch.device("cpu"))
