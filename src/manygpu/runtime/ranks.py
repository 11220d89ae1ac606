"""Ranks in words: the one way a message names several ranks.

The launcher's failure summary, the hang verdict, the collective checks (ours and
Horovod's) and ``manygpu doctor`` all name groups of ranks; written one way, a
reader (or a grep) finds the same rank the same way in each. Plain text, no
torch: the launcher's driver and ``manygpu --help`` import it.
"""

from __future__ import annotations

from collections.abc import Iterable

RUN = 3
"""Consecutive ranks written as a range from this many on: ``0-3`` reads faster than
``0, 1, 2, 3``, but ``0-1`` hides that there are only two (``0, 1``)."""


def ranks_text(ranks: Iterable[int]) -> str:
    """``[3]`` -> ``rank 3``; ``[1, 0]`` -> ``ranks 0, 1``; ``[0, 1, 2, 3, 5]`` -> ``ranks 0-3, 5``.

    Sorted, each rank once, runs of :data:`RUN` or more as a range; the word agrees
    with the count, so callers write ``f"{ranks_text(odd)} wait in ..."``.
    """
    runs: list[list[int]] = []
    for r in sorted(set(ranks)):
        if runs and runs[-1][-1] == r - 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    if not runs:
        return "no rank"
    parts = [f"{run[0]}-{run[-1]}" if len(run) >= RUN else ", ".join(map(str, run)) for run in runs]
    word = "rank" if len(runs) == 1 and len(runs[0]) == 1 else "ranks"
    return f"{word} {', '.join(parts)}"
