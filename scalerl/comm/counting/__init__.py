"""Bytes each rank sends and time it waits, by kind of traffic and mesh dimension.

- `collective_bytes`: `wire_bytes()`, the one formula for the bytes a rank sends in one collective (pure
  arithmetic: the counters, the doctor's rules and the cost model use it);
- `accounting`: `CommCounter` (one per process, `process_counter()`), read once per step;
- `counted_collectives`: `CountedCollectives`, the collectives scalerl issues itself for gradient reduction
  (flat, hierarchical, compressed), each counted through `wire_bytes`;
- `framework_collectives`: how DDP's all-reduce, FSDP2's collectives and DTensor's (tensor parallelism)
  record themselves into a counter.

The trainer's own collectives go through `scalerl.parallel.distributed.DistContext`'s counted facade.
"""
