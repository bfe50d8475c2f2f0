"""The trainers: RL (`rl_trainer`: GRPO, or PPO with a critic) and SFT (`sft_trainer`), built on one
update loop (`update`), the micro-batch losses (`objectives`), forward-only passes (`forward_passes`),
rollout rebalancing across DP ranks, evaluation and the optimizer; what a config names is checked before
any work (`run_checks`) and a run that cannot go on ends naming its last good checkpoint (`run_failures`).

Trainers are imported from their modules (they pull in every lower layer)."""
