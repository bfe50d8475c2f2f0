"""Weight sync from the trainer to rollout engines: buckets (`plan`), lossless verified deltas (`delta`,
`varints`), transports (`channel`: in-process, broadcast over a process group), `sender.WeightSender`
and `receiver.WeightReceiver` (applies them to a `WeightStore`).
"""
