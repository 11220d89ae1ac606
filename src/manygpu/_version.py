"""The package version (one place: the CLI, checkpoints and the package read it)."""

__version__ = "0.1.0"
