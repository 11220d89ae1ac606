"""Re-sign a checkpoint directory after a test changed its files on purpose.

A hostile checkpoint that passes the checksums is the case the loaders' own
safety (``weights_only``, verified structure) must stop: the test rewrites a
file, then makes meta.json agree with it, as an attacker with write access could.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from manygpu.checkpoint_io import layout


def resign(step: Path, **meta_changes: Any) -> None:
    """meta.json of ``step`` rewritten: ``meta_changes`` applied, every file's entry fresh."""
    meta = layout.read_meta(step) | meta_changes
    meta["files"] = {
        str(path.relative_to(step)): layout.file_entry(path) for path in layout.data_files(step)
    }
    (step / layout.META).write_text(json.dumps(meta))
