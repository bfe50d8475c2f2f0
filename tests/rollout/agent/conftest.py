from tests.trainer.conftest import length_reward, tiny_config  # noqa: F401 - the trainer tests' tiny runs
