"""`nri-accel cdi generate --output`: what is at the path decides what is written.

A symlink is followed and its target replaced (the link stays a link); a regular file is
replaced atomically; a directory gets one spec per kind, each file name again followed if
a symlink. Anything else (a FIFO, a socket, a device node, a directory where a spec file
would go) is refused with exit status 2 naming --output and the path, before any spec is
written. Everything here lives in tmp_path: no test names a real device node, even as a
symlink's target, since a defect would replace it.
"""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest
import yaml

from nri_accel.cli import main

GOLDEN = Path(__file__).resolve().parent / "golden" / "discover"
ONE_KIND = str(GOLDEN / "h100.json")  # nvidia.com/gpu only
TWO_KINDS = str(GOLDEN / "a100-mig.json")  # nvidia.com/gpu and nvidia.com/mig


def generate(inventory: str, output: str) -> int:
    return main(["cdi", "generate", "--inventory", inventory, "--output", output])


def spec_kind(path: Path) -> str:
    return str(yaml.safe_load(path.read_text())["kind"])


def test_a_symlink_is_followed_and_its_target_replaced(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "specs" / "gpu.yaml"
    target.parent.mkdir()
    target.write_text("old\n")
    link = tmp_path / "link.yaml"
    link.symlink_to(target)
    assert generate(ONE_KIND, str(link)) == 0
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert spec_kind(target) == "nvidia.com/gpu"
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    assert f"wrote {target} (nvidia.com/gpu, 4 devices" in capsys.readouterr().out
    assert sorted(p.name for p in target.parent.iterdir()) == ["gpu.yaml"]  # no temp left


def test_a_dangling_symlink_creates_its_target(tmp_path: Path) -> None:
    link = tmp_path / "link.yaml"
    link.symlink_to(tmp_path / "new.yaml")
    assert generate(ONE_KIND, str(link)) == 0
    assert link.is_symlink() and spec_kind(tmp_path / "new.yaml") == "nvidia.com/gpu"


def test_in_a_directory_a_symlinked_spec_file_is_followed(tmp_path: Path) -> None:
    out = tmp_path / "cdi"
    out.mkdir()
    elsewhere = tmp_path / "elsewhere.yaml"
    (out / "nvidia.com-gpu.yaml").symlink_to(elsewhere)
    assert generate(TWO_KINDS, str(out)) == 0
    assert (out / "nvidia.com-gpu.yaml").is_symlink()
    assert spec_kind(elsewhere) == "nvidia.com/gpu"
    assert spec_kind(out / "nvidia.com-mig.yaml") == "nvidia.com/mig"


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _socket(path: Path) -> Path:
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
    return path


@pytest.mark.parametrize(("make", "what"), [(_fifo, "a pipe (FIFO)"), (_socket, "a socket")])
def test_anything_but_a_regular_file_or_directory_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], make, what: str) -> None:  # type: ignore[no-untyped-def]
    special = make(tmp_path / "s")
    assert generate(ONE_KIND, str(special)) == 2
    assert capsys.readouterr().err == (
        f"nri-accel: --output {special}: is {what}, not a regular file or a directory: "
        "not replaced\n")
    assert not stat.S_ISREG(special.lstat().st_mode)

    link = tmp_path / "link.yaml"  # the same behind a symlink: the target is named
    link.symlink_to(special)
    assert generate(ONE_KIND, str(link)) == 2
    assert f"--output {link}: {special} is {what}" in capsys.readouterr().err
    assert link.is_symlink() and not stat.S_ISREG(special.lstat().st_mode)


def test_in_a_directory_nothing_is_written_when_one_spec_file_is_not_regular(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cdi"
    out.mkdir()
    _fifo(out / "nvidia.com-mig.yaml")
    (out / "nvidia.com-gpu.yaml").mkdir()
    assert generate(TWO_KINDS, str(out)) == 2
    err = capsys.readouterr().err
    assert f"--output {out}: {out / 'nvidia.com-gpu.yaml'} is a directory, not a regular " \
           "file: not replaced" in err
    assert sorted(p.name for p in out.iterdir()) == ["nvidia.com-gpu.yaml",
                                                     "nvidia.com-mig.yaml"]
    assert stat.S_ISFIFO((out / "nvidia.com-mig.yaml").lstat().st_mode)


def test_an_empty_output_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        generate(ONE_KIND, "")
    assert e.value.code == 2
    assert "argument --output: an empty path" in capsys.readouterr().err


def test_a_file_that_cannot_be_written_is_named(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "absent" / "gpu.yaml"
    assert generate(ONE_KIND, str(path)) == 1
    assert capsys.readouterr().err == (
        f"nri-accel: {path}: cannot write: No such file or directory\n")
