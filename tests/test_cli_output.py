"""Output that cannot be written, for every verb that prints: a reader that left the pipe
ends the command quietly with exit status 1 (Python's recipe for SIGPIPE, which Python
ignores), any other error in writing stdout with one line `nri-accel: cannot write
output: <reason>` and exit status 1; never a traceback. An OSError of the verb's own is
not taken for one: it stays a bug's traceback.

The commands run in processes of their own (`python -m nri_accel`), as from a shell:
stdout is a pipe whose read end is closed before they start, or a regular file under a
file-size limit of 0 bytes (RLIMIT_FSIZE: EFBIG, as a full disk gives ENOSPC; Python
ignores SIGXFSZ), or /dev/full where this machine has it.
"""

from __future__ import annotations

import errno
import io
import os
import resource
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from fakes.roots import materialise

import nri_accel.discover.report
from nri_accel.cli import main

TESTS = Path(__file__).resolve().parent
INVENTORY = str(TESTS / "golden" / "discover" / "a100-mig.json")

VERBS = {
    "version": ["version"],
    "help": ["explain", "--help"],
    "discover": ["discover", "--json", "--root", "{root}"],
    "explain": ["explain", "--inventory", INVENTORY, "--pod", "{root}/pod.yaml", "--json"],
    "cdi generate": ["cdi", "generate", "--inventory", INVENTORY],
    "check": ["check", "--inventory", INVENTORY, "--socket", "{root}/nri.sock"],
    "demo": ["demo"],
}


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("node") / "trn1"
    materialise("trn1", root)
    (root / "pod.yaml").write_text("kind: Pod\nmetadata: {name: p}\n"
                                   "spec: {containers: [{name: c}]}\n")
    yield str(root)


def run(argv: list[str], root: str, stdout: int, **kwargs: object
        ) -> subprocess.CompletedProcess[str]:
    argv = [a.replace("{root}", root) for a in argv]
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([sys.executable, "-m", "nri_accel", *argv], stdout=stdout,
                          stderr=subprocess.PIPE, text=True, env=env, timeout=60,
                          **kwargs)  # type: ignore[call-overload]


@pytest.mark.parametrize("verb", VERBS)
def test_a_reader_that_left_ends_the_command_quietly(node: str, verb: str) -> None:
    read, write = os.pipe()
    os.close(read)  # `nri-accel ... | head -c0`, the reader gone before the first byte
    try:
        result = run(VERBS[verb], node, write)
    finally:
        os.close(write)
    assert (result.returncode, result.stderr) == (1, "")


def _no_bigger_than_zero() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))


# not demo: its daemon writes files of its own, which the limit would refuse too
@pytest.mark.parametrize("verb", [v for v in VERBS if v != "demo"])
def test_output_a_file_cannot_take_is_one_line_and_exit_1(
        node: str, tmp_path: Path, verb: str) -> None:
    with open(tmp_path / "out", "w") as out:
        result = run(VERBS[verb], node, out.fileno(), preexec_fn=_no_bigger_than_zero)
    assert result.stderr == "nri-accel: cannot write output: File too large\n"
    assert result.returncode == 1


@pytest.mark.parametrize("verb", VERBS)
def test_a_full_device_is_one_line_and_exit_1(node: str, verb: str) -> None:
    if not (os.path.exists("/dev/full") and stat.S_ISCHR(os.stat("/dev/full").st_mode)):
        pytest.skip("no /dev/full character device on this machine")
    with open("/dev/full", "w") as full:  # writes fail with ENOSPC, change nothing
        result = run(VERBS[verb], node, full.fileno())
    assert (result.returncode, result.stderr) == (
        1, "nri-accel: cannot write output: No space left on device\n")


class _FullStream(io.StringIO):
    """A stdout on a full disk: every write fails with ENOSPC."""

    def write(self, text: str) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_in_process_the_error_is_reported_and_stdout_put_back(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    full = _FullStream()
    monkeypatch.setattr(sys, "stdout", full)
    assert main(["version"]) == 1
    assert sys.stdout is full
    assert capsys.readouterr().err == "nri-accel: cannot write output: No space left on device\n"


def test_an_oserror_of_the_verb_itself_is_not_taken_for_output(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(args: object) -> int:
        raise OSError(errno.EIO, "a bug's own I/O error")

    monkeypatch.setattr(nri_accel.discover.report, "main_discover", broken)
    with pytest.raises(OSError, match="a bug's own I/O error"):
        main(["discover"])
