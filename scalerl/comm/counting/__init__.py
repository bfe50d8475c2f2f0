"""Bytes each rank sends and time it waits, by kind of traffic and mesh dimension.

- `accounting`: `wire_bytes()`, the one formula for the bytes a rank sends in one collective, and
  `CommCounter` (one per process, `process_counter()`), read once per step;
- `counted_collectives`: `CountedCollectives`, the collectives scalerl issues itself (gradient reduction),
  each counted through `wire_bytes`;
- `ddp`, `fsdp`, `tp`: how DDP's all-reduce, FSDP2's collectives and DTensor's collectives record
  themselves into a counter.
"""
