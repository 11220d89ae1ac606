"""What runs inside each launched worker process, before and around the user's script.

``python -m manygpu.launch.worker [-m] ENTRY ARGS...`` (:mod:`.main`): the script
runs as ``python script.py`` would, with the worker's notes for the blame, its
evidence for hang verdicts and an exit that cannot hang; an expendable rank keeps
its script in a child (:mod:`.keeper`). Nothing here imports the agent.
"""
