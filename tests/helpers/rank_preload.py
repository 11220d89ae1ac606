"""Imported once by the server that forks test ranks (see dist_harness.py).

It imports what the ranks will need, so each forked rank starts with torch
and the rest already loaded. A module that fails to import here is skipped:
the rank imports it again itself, and its error then shows in that rank's
traceback, where the test reports it.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import sys

from dist_harness import PRELOAD_ENV, SYS_PATH_ENV

sys.path[:] = json.loads(os.environ[SYS_PATH_ENV])
for _name in os.environ[PRELOAD_ENV].split(","):
    with contextlib.suppress(Exception):
        importlib.import_module(_name)
# What the server holds now lives in every rank until it exits: out of the
# collector's walks (the launched workers do the same, runtime/heap.py). 3-8% of
# the CPU of test_real_models, test_token_weights_ranks and test_tensor_and_hybrid.
gc.collect()
gc.freeze()
