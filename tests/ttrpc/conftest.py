"""Fixtures of the ttrpc tests."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def sock_path() -> Iterator[Path]:
    """A unix socket path in a fresh short directory (AF_UNIX paths are limited to 107 bytes)."""
    directory = tempfile.mkdtemp(prefix="ttrpc-")
    try:
        yield Path(directory) / "t.sock"
    finally:
        shutil.rmtree(directory)
