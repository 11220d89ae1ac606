"""Model transforms: what ``prepare`` changes in a user's module before the strategy wraps it.

One package for what is not a strategy but changes the model: its blocks
(:mod:`.blocks`, the one answer to "which are the repeated layers", shared by
FSDP2's units, activation checkpointing and the planner), activation
checkpointing (:mod:`.checkpointing`, with BatchNorm's running statistics
kept out of the recomputation, :mod:`.running_stats`), channels_last
(:mod:`.channels_last`) and fp8 (:mod:`.fp8`, with the ability a strategy
declares to train in float8). :mod:`.pipeline` writes down the order in
which ``prepare`` applies them around the strategy's own split and shard.
"""
