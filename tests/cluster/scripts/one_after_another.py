"""Run several Horovod-style scripts one after the other in this one process.

Usage: SCRIPT [ARG ...] [-- SCRIPT [ARG ...]] ... Each script runs as the launcher
runs a script (``runpy.run_path`` as ``__main__``, ``sys.argv`` its own), and
``hvd.shutdown()`` after it, so the next one's ``hvd.init()`` starts a session of
its own: one start of every rank (each costs seconds of CPU) for several scripts.
"""

import runpy
import sys

import manygpu.horovod as hvd

scripts: list[list[str]] = [[]]
for arg in sys.argv[1:]:
    if arg == "--":
        scripts.append([])
    else:
        scripts[-1].append(arg)
for argv in scripts:
    sys.argv = argv
    runpy.run_path(argv[0], run_name="__main__")
    hvd.shutdown()
