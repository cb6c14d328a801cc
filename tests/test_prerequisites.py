"""What the suite does without its two outside prerequisites (tests/conftest.py): the
NRI wire captures (../shared/nri-wire) and a C compiler (the fake libnvidia-ml.so.1).

Each case runs pytest in a subprocess on a few test files: without the prerequisite,
the tests that need it are skipped with one reason, said once before the run and once
in the summary, and the rest pass; with NRI_ACCEL_REQUIRE_CAPTURES=1 or
NRI_ACCEL_REQUIRE_CC=1 (as CI sets them, .ci/run), they fail instead.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NO_CC = ("a C compiler (cc) is needed to build the fake libnvidia-ml.so.1 for the NVIDIA "
         "tests: apt-get install gcc")
# Test files that need the captures (nri_wire_dir), and one that needs nothing outside.
CAPTURE_TESTS = ["tests/ttrpc/test_ttrpc_captures.py", "tests/protocol/test_nri_convert.py"]
# Tests that compile the fake library through each way in: the fake_nvml_lib fixture
# (test_nvidia), fakes.roots.materialise (test_nvidia_fakes), fakes.nvml.build
# (test_nvml_events); test_static needs no compiler.
CC_TESTS = ["tests/discover/test_nvidia.py", "tests/discover/test_nvidia_fakes.py",
            "tests/discover/test_nvml_events.py", "tests/discover/test_static.py"]


def _env(**changes: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("NRI_ACCEL_REQUIRE_CAPTURES", "NRI_ACCEL_REQUIRE_CC", "PYTEST_ADDOPTS")}
    for key, value in changes.items():
        env.pop(key, None)
        if value is not None:
            env[key] = value
    return env


def _pytest(cwd: Path, files: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
         *files], cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False)


def _clone_without_shared(tmp_path: Path) -> Path:
    """The repository's tests as a plain clone has them: no shared/ beside it."""
    clone = tmp_path / "clone"
    shutil.copytree(REPO / "tests", clone / "tests",
                    ignore=shutil.ignore_patterns("__pycache__"), symlinks=True)
    shutil.copy(REPO / "pyproject.toml", clone)
    assert not (tmp_path / "shared").exists()
    return clone


def _notices(out: str) -> list[str]:
    """The lines said before the run (this checkout may lack the other prerequisite too)."""
    lines = out.splitlines()
    return lines[:next(i for i, line in enumerate(lines)
                       if not line.startswith("prerequisite missing"))]


def _summary(out: str) -> tuple[list[str], str]:
    """The -ra SKIPPED lines and the final counts line."""
    skipped = [line for line in out.splitlines() if line.startswith("SKIPPED")]
    return skipped, out.strip().splitlines()[-1]


def test_a_clone_without_the_captures_skips_their_tests_for_one_reason(tmp_path: Path) -> None:
    clone = _clone_without_shared(tmp_path)
    done = _pytest(clone, CAPTURE_TESTS, _env())
    assert done.returncode == 0, done.stdout + done.stderr
    reason = f"NRI wire captures not found at {tmp_path / 'shared' / 'nri-wire'}:"
    assert any(n.startswith("prerequisite missing, they are skipped: " + reason)
               for n in _notices(done.stdout)), done.stdout
    skipped, counts = _summary(done.stdout)
    assert len(skipped) == 1, skipped
    assert re.match(r"SKIPPED \[\d+\] tests/conftest\.py:\d+: " + re.escape(reason),
                    skipped[0])
    assert re.fullmatch(r"\d+ passed, \d+ skipped in .*", counts), counts
    assert "error" not in counts and "failed" not in counts


def test_ci_fails_without_the_captures(tmp_path: Path) -> None:
    clone = _clone_without_shared(tmp_path)
    done = _pytest(clone, CAPTURE_TESTS, _env(NRI_ACCEL_REQUIRE_CAPTURES="1"))
    assert done.returncode == 1, done.stdout + done.stderr
    assert any(n.startswith("prerequisite missing, they fail (NRI_ACCEL_REQUIRE_CAPTURES "
                            "is set): NRI wire captures") for n in _notices(done.stdout))
    skipped, counts = _summary(done.stdout)
    assert skipped == []
    assert "skipped" not in counts and re.search(r"\d+ error", counts), counts
    assert "(NRI_ACCEL_REQUIRE_CAPTURES is set: a failure, not a skip)" in done.stdout


def test_without_a_compiler_the_nvidia_tests_are_skipped_for_one_reason(
        tmp_path: Path) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    done = _pytest(REPO, CC_TESTS, _env(PATH=str(empty), CC=None))
    assert done.returncode == 0, done.stdout + done.stderr
    assert any(n.startswith(f"prerequisite missing, they are skipped: {NO_CC}")
               for n in _notices(done.stdout)), done.stdout
    skipped, counts = _summary(done.stdout)
    assert len(skipped) == 1, skipped
    assert re.match(r"SKIPPED \[\d+\] tests/conftest\.py:\d+: " + re.escape(NO_CC),
                    skipped[0])
    passed, skips = map(int, re.fullmatch(r"(\d+) passed, (\d+) skipped in .*", counts).groups())
    assert passed > 0 and skips > 30, counts


def test_ci_fails_without_a_compiler(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-cc"
    done = _pytest(REPO, CC_TESTS, _env(CC=str(missing), NRI_ACCEL_REQUIRE_CC="1"))
    assert done.returncode == 1, done.stdout + done.stderr
    assert any(n.startswith("prerequisite missing, they fail (NRI_ACCEL_REQUIRE_CC is set)")
               for n in _notices(done.stdout)), done.stdout
    skipped, counts = _summary(done.stdout)
    assert skipped == [] and "skipped" not in counts, counts
    assert f"{NO_CC} (or set CC); CC={missing} is not found " \
           "(NRI_ACCEL_REQUIRE_CC is set: a failure, not a skip)" in done.stdout


def test_ci_requires_both() -> None:
    ci = (REPO / ".ci" / "run").read_text()
    exported = re.search(r"^export (NRI_ACCEL_REQUIRE_.*)$", ci, re.M)
    assert exported, "the prerequisites must be required before .ci/run runs the tests"
    assert set(exported.group(1).split()) == {"NRI_ACCEL_REQUIRE_CAPTURES=1",
                                              "NRI_ACCEL_REQUIRE_CC=1"}
    assert exported.start() < ci.index("\nmake test")
