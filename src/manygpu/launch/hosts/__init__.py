"""The driver of a launch over several hosts (``-H`` / ``--hostfile``): this machine starts
``manygpu launch --driven`` on every host over ssh and reports the job as one.

hostfile (parse ``-H`` and host files) -> plan (each host's command, pure) ->
probe (the preflight each host runs: reachable, same torch, port free) -> run (ssh,
prefixed output, the first failure over every host first, stop all). The hosts'
own launchers are :mod:`manygpu.launch.agent`; their tie to this driver is
:mod:`manygpu.launch.driven`.
"""
