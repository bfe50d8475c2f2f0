"""The trainers: RL (`rl_trainer`: GRPO, or PPO with a critic) and SFT (`sft_trainer`), each only its step
and what is its own, on one run scaffold (`run`: the entry `start_run`, set-up, resume, the loop, the step's
tail, save and export). Below them: one update loop (`update`), the micro-batch losses (`objectives`),
forward-only passes (`forward_passes`), rollout rebalancing across DP ranks, evaluation and the optimizer;
what a config names and what a trainer needs from the layout are checked before any work (`run_checks`),
a run claims its output directory (`run_directory`) and one that cannot go on ends naming its last good
checkpoint (`run_failures`).

Trainers are imported from their modules (they pull in every lower layer)."""
