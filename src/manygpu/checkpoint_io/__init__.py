"""How a checkpoint's state reaches disk and is verified: below the strategies, which name
their format.

formats (a strategy's state as files: one full copy, or DCP shards), layout (step
directories, atomic commit, meta.json), writer (durable files, in the background),
staging (copies for an asynchronous save), integrity (checksums), safe_dcp (DCP read
without pickles), rng. The :class:`~manygpu.checkpoint.Checkpointer` that uses them
lives above the core, in :mod:`manygpu.checkpoint`.
"""
