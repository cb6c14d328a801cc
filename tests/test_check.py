"""`nri-accel check`: findings and exit status before `run`."""

from __future__ import annotations

import socket
from pathlib import Path

from nri_accel.cli import main

DEMO = Path(__file__).resolve().parents[1] / "nri_accel" / "demo" / "inventory.json"


def test_missing_socket_is_a_warning_run_would_retry(tmp_path, capsys) -> None:
    rc = main(["check", "--inventory", str(DEMO), "--socket", str(tmp_path / "nri.sock")])
    out = capsys.readouterr().out
    assert rc == 0
    assert "ok: configuration" in out
    assert "ok: devices: 8 nvidia.com/gpu, 3 nvidia.com/mig" in out
    assert f"warn: NRI socket {tmp_path / 'nri.sock'} does not exist yet" in out


def test_a_listening_socket_is_ok_and_a_regular_file_is_an_error(tmp_path, capsys) -> None:
    path = tmp_path / "nri.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(1)
    try:
        assert main(["check", "--inventory", str(DEMO), "--socket", str(path)]) == 0
        assert f"ok: NRI socket {path} accepts connections" in capsys.readouterr().out
    finally:
        srv.close()
    path.unlink()
    path.write_text("not a socket")
    assert main(["check", "--inventory", str(DEMO), "--socket", str(path)]) == 1
    assert f"error: {path} is not a unix socket" in capsys.readouterr().out


def test_empty_node_warns(tmp_path, capsys) -> None:
    inv = tmp_path / "empty.json"
    inv.write_text('{"schema_version": 1}')
    assert main(["check", "--inventory", str(inv), "--socket", str(tmp_path / "s")]) == 0
    assert "warn: no accelerator devices found on this node" in capsys.readouterr().out
