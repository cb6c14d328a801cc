"""--inventory and --root name what is wrong with the path given (app.App.from_args)."""

from __future__ import annotations

import os

import pytest

from nri_accel.cli import main


@pytest.mark.parametrize(("flag", "make", "said"), [
    ("--inventory", lambda p: p, "no such file"),
    ("--inventory", lambda p: (p.mkdir(), p)[1], "is a directory, not a file"),
    ("--inventory", lambda p: (os.mkfifo(p), p)[1], "is not a regular file"),
    ("--inventory", lambda p: (p.symlink_to(p.parent / "gone"), p)[1], "no such file"),
    ("--root", lambda p: p, "no such directory"),
    ("--root", lambda p: (p.write_text("{}"), p)[1], "is not a directory"),
])
def test_a_source_path_that_is_not_what_the_flag_wants_is_named(
        tmp_path, capsys, flag: str, make, said: str) -> None:
    path = make(tmp_path / "x")
    pod = tmp_path / "pod.yaml"
    pod.write_text("kind: Pod\nmetadata: {name: p}\nspec: {containers: [{name: c}]}\n")
    assert main(["explain", flag, str(path), "--pod", str(pod)]) == 2
    err = capsys.readouterr().err
    assert f"{flag} {path}: {said}" in err
