"""Emulated hosts on one machine: Linux network namespaces joined by a bridge."""

from manygpu.emulate.netns import EmulatedCluster, LinkShape, netns_available

__all__ = ["EmulatedCluster", "LinkShape", "netns_available"]
