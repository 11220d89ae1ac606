"""``manygpu launch``: CLI options -> :class:`LaunchSpec` -> torch's elastic agent."""

from manygpu.launch.agent import launch
from manygpu.launch.resolve import LaunchRequest, resolve
from manygpu.launch.spec import LaunchSpec

__all__ = ["LaunchRequest", "LaunchSpec", "launch", "resolve"]
