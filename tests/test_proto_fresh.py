"""The committed *_pb2 code is what `make proto` produces from api/*.proto today."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _generator():
    spec = importlib.util.spec_from_file_location("api_generate", REPO / "api" / "generate.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_committed_generated_code_is_fresh(tmp_path: Path) -> None:
    gen = _generator()
    gen.generate(tmp_path)
    stale = []
    for fresh in gen.generated_files(tmp_path):
        committed = REPO / fresh.relative_to(tmp_path)
        if not committed.exists() or committed.read_bytes() != fresh.read_bytes():
            stale.append(str(committed.relative_to(REPO)))
    assert not stale, f"generated code is stale, run `make proto`: {stale}"
