"""scalerl: reinforcement-learning post-training of language models, from one process to a cluster."""

__version__ = "0.1.0"
