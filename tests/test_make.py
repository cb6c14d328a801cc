"""The Makefile's targets fail when what they depend on fails (never a silent skip)."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_make_e2e_fails_when_containerd_cannot_be_fetched(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # the cache directory would have to be created inside a file
    done = subprocess.run(
        ["make", "-s", "-C", str(REPO), "-o", ".venv/.installed-stamp", "e2e",
         f"E2E_CACHE={blocker}/cache"],
        capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode != 0, done.stdout
    assert "skipped" not in done.stdout
