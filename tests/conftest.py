"""Shared pytest fixtures.

`all_logs`: structlog lets every level through for the test (an earlier test may have
configured a higher level), and the configuration is restored afterwards.
`nri_wire_dir`: the byte captures of a real containerd NRI runtime (../shared/nri-wire,
beside the repository, as in CI's clean clone).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

REPO = Path(__file__).resolve().parents[1]
NRI_WIRE = REPO.parent / "shared" / "nri-wire"


@pytest.fixture(scope="session")
def nri_wire_dir() -> Path:
    if not NRI_WIRE.is_dir():
        pytest.fail(f"NRI captures not found at {NRI_WIRE} (shared/ must sit beside the repo)")
    return NRI_WIRE


@pytest.fixture
def all_logs() -> Iterator[None]:
    saved = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(0))
    try:
        yield
    finally:
        structlog.configure(**saved)
