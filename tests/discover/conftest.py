"""Fixtures for discovery tests: fake host roots and the fake libnvidia-ml.

`fake_nvml_lib`: the fake NVML library (tests/fakes/nvml/fake_nvml.c, standing for
NVIDIA's libnvidia-ml.so.1), compiled once per test session.
`fake_root(name)`: materialises tests/fakes/roots/<name> (each with a README saying
which real node it mimics) under the test's tmp_path and returns its HostRoot.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from fakes.nvml import build
from fakes.roots import materialise

from nri_accel.discover.hostroot import HostRoot


@pytest.fixture(scope="session")
def fake_nvml_lib() -> Path:
    # Without a C compiler, NoCompilerError: tests/conftest.py skips (or, in CI, fails).
    try:
        return build.library()
    except build.NoCompilerError:
        raise
    except build.BuildError as e:
        pytest.fail(f"cannot build the fake NVML library: {e}")


@pytest.fixture
def fake_root(tmp_path: Path, fake_nvml_lib: Path) -> Callable[[str], HostRoot]:
    def make(name: str) -> HostRoot:
        return materialise(name, tmp_path / name)

    return make
