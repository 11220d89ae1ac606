"""Start a job: a request becomes a :class:`LaunchSpec`, run by torch's elastic agent.

Imported on use: a worker (``python -m manygpu.launch.worker``) needs none of the agent."""

from typing import TYPE_CHECKING

from manygpu import _lazy

if TYPE_CHECKING:
    from manygpu.launch.agent import launch
    from manygpu.launch.resolve import LaunchRequest, resolve
    from manygpu.launch.spec import LaunchSpec

__getattr__, __dir__ = _lazy.exports(
    __name__,
    {
        "launch": "manygpu.launch.agent",
        "LaunchRequest": "manygpu.launch.resolve",
        "resolve": "manygpu.launch.resolve",
        "LaunchSpec": "manygpu.launch.spec",
    },
)

__all__ = [
    "LaunchRequest",
    "LaunchSpec",
    "launch",
    "resolve",
]
