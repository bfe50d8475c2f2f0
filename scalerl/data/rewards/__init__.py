"""Rewards: scoring a batch of responses (`computer`: `RewardComputer`, one function or several with
weights), the reward specs and built-ins (`specs`), the signatures accepted (`functions`: scalerl's, verl's,
TRL's), verl's default scorers by data source (`verl_scorers`), calls within time limits (`calls`) or in a
process pool (`pool`), reward servers (`http`, the client; `server`, a reference server), a generative judge
(`judge`; in a pool of its own processes that judges while generation goes on, `judge_pool`) and a reward model
(`model`)."""
