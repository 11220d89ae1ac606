"""``python -m manygpu.launch.worker``: the launched worker (see :mod:`.main`)."""

from manygpu.launch.worker.main import main

main()
