"""Shared pytest fixtures.

`nri_wire_dir`: the byte captures of a real containerd NRI runtime (../shared/nri-wire,
beside the repository, as in CI's clean clone).
"""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NRI_WIRE = REPO.parent / "shared" / "nri-wire"


@pytest.fixture(scope="session")
def nri_wire_dir() -> Path:
    if not NRI_WIRE.is_dir():
        pytest.fail(f"NRI captures not found at {NRI_WIRE} (shared/ must sit beside the repo)")
    return NRI_WIRE
