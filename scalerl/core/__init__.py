"""Foundations every layer may use: the run configuration (the `config` package: a module per section,
its tree machinery and number checks), the two error kinds a run ends with (`errors`: UserError, exit 2; RunFailure, exit 1), RNG state and seeding
(`rng_state`), rank-environment detection for every launcher (`rank_env`), the compute device and precision
(`device`), and small network helpers (`net`)."""
