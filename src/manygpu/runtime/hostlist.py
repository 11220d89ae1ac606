"""Expand Slurm host lists such as ``gpu[01-03,07],login1``.

Slurm gives the allocation as a compressed list; the first host becomes the
rendezvous master. Written by hand because it is a few lines and the only
library for it is unmaintained.
"""

from __future__ import annotations

import re

_BRACKET = re.compile(r"^(?P<prefix>[^\[]*)\[(?P<ranges>[^\]]+)\](?P<rest>.*)$")


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts: list[str] = []
    depth = 0
    current: list[str] = []
    for char in text:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    if current:
        parts.append("".join(current))
    return [p for p in parts if p]


def _expand_ranges(ranges: str) -> list[str]:
    out: list[str] = []
    for item in ranges.split(","):
        if "-" in item:
            lo, hi = item.split("-", 1)
            width = len(lo)
            out.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
        else:
            out.append(item)
    return out


def _expand_one(pattern: str) -> list[str]:
    match = _BRACKET.match(pattern)
    if match is None:
        return [pattern]
    heads = [match["prefix"] + r for r in _expand_ranges(match["ranges"])]
    tails = _expand_one(match["rest"]) if match["rest"] else [""]
    return [h + t for h in heads for t in tails]


def expand_hostlist(text: str) -> list[str]:
    """All host names of a Slurm host list, in order.

    >>> expand_hostlist("node[1-3],gpu[08-09]")
    ['node1', 'node2', 'node3', 'gpu08', 'gpu09']
    """
    hosts: list[str] = []
    for part in _split_top_level(text.strip()):
        hosts.extend(_expand_one(part))
    return hosts
