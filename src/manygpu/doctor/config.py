"""What ``manygpu doctor`` asks of every rank it launches (plain data, cheap to import)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from manygpu.errors import UsageError

DEFAULT_NBYTES = 4 << 20
"""Bytes each way per rank pair in the timed exchange."""
DEFAULT_OP_TIMEOUT_S = 20.0
"""Seconds each live operation may take before it is reported as broken."""
FORMATS = ("text", "json", "none")
"""How rank 0 prints the report: tables, JSON, or not at all (the caller reads ``out``)."""


@dataclass(frozen=True, kw_only=True)
class LiveConfig:
    """The doctor's per-rank program: what to test and how rank 0 reports it."""

    format: str = "text"
    """One of :data:`FORMATS`."""
    out: str = ""
    """Rank 0 also writes the report here as JSON (empty: nowhere)."""
    nbytes: int = DEFAULT_NBYTES
    """Bytes each way per rank pair."""
    op_timeout_s: float = DEFAULT_OP_TIMEOUT_S
    """Seconds each live operation may take, so a broken link is named, not waited on."""
    live: bool = True
    """Run the timed tests; ``False``: facts and checks only."""

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise UsageError(f"report format {self.format!r}: choose one of {', '.join(FORMATS)}")
        if not isinstance(self.nbytes, int) or self.nbytes < 4:
            raise UsageError(f"need at least 4 bytes per rank pair, got {self.nbytes!r}")
        if not 0 < self.op_timeout_s < math.inf:
            raise UsageError(
                f"--op-timeout must be a number of seconds > 0, got {self.op_timeout_s}"
            )
