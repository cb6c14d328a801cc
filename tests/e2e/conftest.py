"""Fixtures shared by the end-to-end modules: `assets`, built once per session (the CRI
client compiled from cri_api.proto, the pause image, the snapshotter probe, nri-accel's
configuration; see containerd_e2e.build_assets). Requested only by tests that run, that
is with NRI_ACCEL_E2E_BIN set. And, for every test, containerd's and nri-accel's logs
printed at teardown (pytest shows them only for a test that failed)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest
from containerd_e2e import Assets, build_assets


@pytest.fixture(scope="session")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Assets:
    if shutil.which("cc") is None:
        pytest.fail("the containerd end-to-end test needs cc to build its pause image")
    return build_assets(tmp_path_factory.mktemp("assets"))


# The fixture each module's tests get their running containerd and nri-accel from.
NODE_FIXTURES = ("node", "launched")


@pytest.fixture(autouse=True)
def _logs_on_failure(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    for name in NODE_FIXTURES:
        if name in request.fixturenames:
            print(request.getfixturevalue(name).diagnose())
