"""Foundations every layer may use: the run configuration (`config`, `config_tree`, `config_numbers`), the
two error kinds a run ends with (`errors`: UserError, exit 2; RunFailure, exit 1), RNG state and seeding
(`rng_state`), rank-environment detection for every launcher (`rank_env`), the compute device and precision
(`device`), and small network helpers (`net`)."""
