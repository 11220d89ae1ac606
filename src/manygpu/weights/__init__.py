"""Weights straight into a model's shards, and out of them, as safetensors.

:func:`load_weights` fills a model that a strategy has already sharded or
wrapped (plain tensors, FSDP2 / HSDP / tensor-parallel DTensors, a pipeline
stage) from a ``.safetensors`` file, a Hugging Face-style directory or a manygpu
checkpoint, on disk or at an object-store URL: each rank reads only the blocks
it owns. :func:`save_weights` writes safetensors (Hugging Face's sharded layout
above a size) by gathering one tensor at a time, so no rank ever holds the
whole model. Nothing read executes code:
pickles are refused.

- :mod:`.sources`: what a path holds, by its structure; reading blocks.
- :mod:`.url_sources`: the same at an fsspec URL (``s3://`` ...).
- :mod:`.st_read`: a safetensors header checked, and byte ranges read (``pread``
  on disk, ranged requests in a store).
- :mod:`.names`: which stored tensor fills which model tensor (tied weights,
  Hugging Face prefixes, missing / unexpected / wrong shape).
- :mod:`.shards`: a DTensor's own block; gathering one tensor.
- :mod:`.st_file`, :mod:`.sharded_files`: the streaming safetensors writer and
  Hugging Face's file layout.
"""

from manygpu.weights.load import LoadReport, load_weights
from manygpu.weights.names import state_names
from manygpu.weights.save import SavedWeights, save_weights

__all__ = ["LoadReport", "SavedWeights", "load_weights", "save_weights", "state_names"]
