"""Fixtures shared by unit tests of one area that sits in several files."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture
def one() -> Iterator[None]:
    """A one-process Horovod job (no launcher variables: tests/conftest.py removes them)."""
    import manygpu.horovod as hvd

    hvd.init()
    try:
        yield
    finally:
        hvd.shutdown()
