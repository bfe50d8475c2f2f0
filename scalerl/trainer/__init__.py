"""The trainers: RL (`rl_trainer`: GRPO, or PPO with a critic) and SFT (`sft_trainer`), built on one
update loop (`update`), the micro-batch losses (`objectives`), forward-only passes (`forward_passes`),
rollout rebalancing across DP ranks, evaluation and the optimizer.

Trainers are imported from their modules (they pull in every lower layer)."""
