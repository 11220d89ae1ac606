"""The safetensors file format, written one tensor at a time.

A safetensors file is an 8-byte little-endian header length, a JSON header
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``)
and the tensors' raw bytes back to back. Every tensor's shape and dtype is known
before any value is (a DTensor knows its global shape), so the header is
written first and each tensor is appended as it is gathered: the writer never
holds more than the one tensor it is writing. ``safetensors.torch.save_file``
needs every tensor of the file in memory at once, and refuses tensors that share
storage (tied weights), which is why it is not used here.

Reading, by byte ranges, from disk or a store: :mod:`.st_read`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "C64": torch.complex64,
}
"""safetensors' dtype names (as its header spells them) and torch's dtypes."""
NAMES = {dtype: name for name, dtype in DTYPES.items()}

METADATA = {"format": "pt"}
"""``transformers``' ``from_pretrained`` refuses a file whose metadata lacks ``format``."""


@dataclass(frozen=True)
class Spec:
    """What the header says of one tensor, before its values exist."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        count = 1
        for n in self.shape:
            count *= n
        return count * self.dtype.itemsize


def header(specs: Mapping[str, Spec], metadata: Mapping[str, str]) -> bytes:
    """The length prefix and JSON header for ``specs``, in their order, padded to 8 bytes
    (the data then starts aligned, as safetensors' own writer does)."""
    table: dict[str, object] = {"__metadata__": dict(metadata)}
    offset = 0
    for name, spec in specs.items():
        if spec.dtype not in NAMES:
            raise TypeError(f"{name}: safetensors has no dtype for {spec.dtype}")
        end = offset + spec.nbytes
        table[name] = {
            "dtype": NAMES[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    text = json.dumps(table, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


class StreamingFile:
    """One safetensors file, written tensor by tensor in the order of ``specs``.

    The caller checks each tensor against its spec (:meth:`add` refuses a
    mismatch) and calls :meth:`close` to fsync; an unfinished file is left for the
    caller's temporary directory to remove.
    """

    def __init__(self, path: Path, specs: Mapping[str, Spec], metadata: Mapping[str, str]) -> None:
        self.path = path
        self.order = list(specs)
        self.specs = dict(specs)
        self.next = 0
        self.fh: BinaryIO = open(path, "wb")  # noqa: SIM115 - closed in close()
        self.fh.write(header(specs, {**METADATA, **metadata}))

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Append ``name``'s values (on CPU, of the spec's shape and dtype)."""
        want = self.specs[self.order[self.next]]
        if name != self.order[self.next] or tuple(tensor.shape) != want.shape:
            raise ValueError(f"{self.path}: got {name} {tuple(tensor.shape)}, expected "
                             f"{self.order[self.next]} {want.shape}")  # fmt: skip
        if tensor.dtype != want.dtype:
            raise ValueError(f"{self.path}: {name} is {tensor.dtype}, expected {want.dtype}")
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        if flat.numel():
            # Native byte order is little-endian on every platform torch ships for.
            self.fh.write(flat.view(torch.uint8).numpy().data)
        self.next += 1

    def close(self) -> None:
        """Flush and fsync; every tensor must have been added."""
        try:
            if self.next != len(self.order):
                raise ValueError(f"{self.path}: {len(self.order) - self.next} tensors not written")
            self.fh.flush()
            os.fsync(self.fh.fileno())
        finally:
            self.fh.close()

    def abort(self) -> None:
        self.fh.close()
