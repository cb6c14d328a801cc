"""`nri-accel run` refuses at start what it could never work with: exit status 2, the
reason on stderr and, where the runtime launched it (stderr on /dev/null), in its log
file. The real daemon as a subprocess (daemon.py); nothing here waits for a runtime.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest
from daemon import log_events, run_args

from nri_accel.state import CHECKPOINT_FILE

START_TIMEOUT = 60  # a bound on a broken test, not a timing assertion


def run(files: dict[str, str], *extra: str, env: dict[str, str] | None = None,
        pass_fds: tuple[int, ...] = ()) -> subprocess.CompletedProcess[str]:
    return subprocess.run(run_args(files, "--socket", files["socket"], *extra),
                          capture_output=True, text=True, timeout=START_TIMEOUT, check=False,
                          stdin=subprocess.DEVNULL, env=env, pass_fds=pass_fds)


def fatal_errors(files: dict[str, str]) -> list[str]:
    return [e["error"] for e in log_events(files) if e["event"] == "fatal_error"]


@pytest.mark.parametrize(("value", "why"), [
    ("abc", "not a file descriptor number: 'abc'"),
    ("0", "fd 0 is a character device, not a socket"),  # stdin on /dev/null
    ("1000", "fd 1000 is not open (Bad file descriptor)"),
])
def test_a_preregistered_launch_without_a_connection_says_why_in_its_log(
        daemon_files: dict[str, str], value: str, why: str) -> None:
    # Once a traceback (StubConfigError, "Socket operation on non-socket", "Bad file
    # descriptor") on a stderr the runtime sends to /dev/null, and a log saying only
    # plugin_stopped.
    done = run(daemon_files, env={"NRI_PLUGIN_SOCKET": value, "PATH": os.environ["PATH"]})
    assert done.returncode == 2, done.stderr
    assert f"nri-accel: NRI_PLUGIN_SOCKET: {why}" in done.stderr
    assert "Traceback" not in done.stderr
    (logged,) = fatal_errors(daemon_files)
    assert logged.startswith(f"NRI_PLUGIN_SOCKET: {why}")


def test_a_preregistered_launch_on_a_socket_that_is_not_a_connection(
        daemon_files: dict[str, str], short_dir: Path) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listening:
        listening.bind(str(short_dir / "l.sock"))
        listening.listen()
        fd = listening.fileno()
        done = run(daemon_files, env={"NRI_PLUGIN_SOCKET": str(fd), "PATH": os.environ["PATH"]},
                   pass_fds=(fd,))
    assert done.returncode == 2
    (logged,) = fatal_errors(daemon_files)
    assert logged.startswith(f"NRI_PLUGIN_SOCKET: fd {fd} is a listening socket")


@pytest.mark.parametrize("where", ["file", "under-a-file"])
def test_a_state_dir_that_cannot_be_a_directory_stops_run_at_start(
        daemon_files: dict[str, str], short_dir: Path, where: str) -> None:
    # Once: `run` served on, logging checkpoint_write_failed "File exists" after each change.
    blocker = short_dir / "blocker"
    blocker.write_text("")
    state_dir = blocker if where == "file" else blocker / "state"
    done = run(daemon_files, "--state-dir", str(state_dir))
    assert done.returncode == 2
    why = (f"{state_dir} is not a directory" if where == "file"
           else f"cannot create the state directory {state_dir}: Not a directory")
    assert f"nri-accel: --state-dir: {why}" in done.stderr
    assert fatal_errors(daemon_files) == [f"--state-dir: {why}" + (
        " (the state directory holds the grant checkpoint and the record `run` keeps for "
        "`device-plugin`)" if where == "file" else "")]
    assert "plugin_starting" not in [e["event"] for e in log_events(daemon_files)]


def test_the_config_key_is_named_when_it_chose_the_state_dir(
        daemon_files: dict[str, str], short_dir: Path) -> None:
    blocker = short_dir / "blocker"
    blocker.write_text("")
    config = Path(daemon_files["config"])
    config.write_text(f'state_dir = "{blocker}"\n' + config.read_text())
    args = run_args(daemon_files, "--socket", daemon_files["socket"])
    args.remove("--state-dir")
    args.remove(daemon_files["state"])
    done = subprocess.run(args, capture_output=True, text=True, timeout=START_TIMEOUT,
                          check=False, stdin=subprocess.DEVNULL)
    assert done.returncode == 2
    assert f"nri-accel: {config}: state_dir: {blocker} is not a directory" in done.stderr


def test_a_checkpoint_that_cannot_be_written_stops_run_at_start(
        daemon_files: dict[str, str]) -> None:
    # grants.json a directory: the state dir is fine, the checkpoint cannot be replaced.
    state = Path(daemon_files["state"])
    (state / CHECKPOINT_FILE).mkdir(parents=True)
    (state / CHECKPOINT_FILE / "x").write_text("")  # not empty: it cannot be set aside over
    (state / (CHECKPOINT_FILE + ".unreadable")).write_text("older")
    done = run(daemon_files)
    assert done.returncode == 2
    assert (f"nri-accel: --state-dir: cannot write the grant checkpoint "
            f"{state / CHECKPOINT_FILE}: ") in done.stderr


def test_a_second_run_on_one_state_dir_stops_at_start_naming_the_first(
        daemon_files: dict[str, str]) -> None:
    # Two `run`s on one state directory would restore the same grants, write theirs
    # over each other's, and both answer every create that grants. The first holds the
    # directory (flock) from start to exit: the second is refused, the first unharmed.
    first = subprocess.Popen(run_args(daemon_files, "--socket", daemon_files["socket"]),
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        state = Path(daemon_files["state"])
        for _ in range(1200):  # it has locked the directory once it wrote a checkpoint
            if (state / CHECKPOINT_FILE).exists() or first.poll() is not None:
                break
            time.sleep(0.05)
        assert first.poll() is None
        done = run(daemon_files)
        assert done.returncode == 2, done.stderr
        assert ("nri-accel: --state-dir: another `nri-accel run` (pid " in done.stderr
                and f"serves with the state directory {state}: one `run` per node"
                in done.stderr), done.stderr
        assert first.poll() is None
    finally:
        first.terminate()
        first.wait(START_TIMEOUT)
