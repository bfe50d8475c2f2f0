"""The standalone rollout worker: a rank outside the trainer's mesh serving generation (`worker`), the
requests and outputs it exchanges with the trainer (`protocol`: op codes and their encodings), and the
tensor messages they travel in (`messages`: no pickle)."""
