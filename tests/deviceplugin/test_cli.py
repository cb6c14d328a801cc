"""`nri-accel device-plugin` as a process: registration with the fake kubelet, refresh
from a watched host root, SIGTERM, and a bad kubelet directory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from fakes.roots import materialise

from nri_accel.deviceplugin import deviceplugin_pb2 as pb2

from .conftest import GPU0, GPU2, node_inventory
from .fake_kubelet import WAIT, FakeKubelet

REPO = Path(__file__).resolve().parents[2]


class _DevicePlugin:
    """`nri-accel device-plugin ARGS` in a subprocess. As a context manager: on leaving,
    SIGTERM and wait; if the block failed, the process's stderr joins the error."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "nri_accel.cli", "device-plugin", *args],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        self.returncode: int | None = None
        self.stderr = ""

    def __enter__(self) -> _DevicePlugin:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            _, self.stderr = self.proc.communicate(timeout=WAIT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, self.stderr = self.proc.communicate()
            raise AssertionError(f"device-plugin ignored SIGTERM; stderr:\n{self.stderr}") from exc
        self.returncode = self.proc.returncode
        if exc is not None:
            raise AssertionError(f"{exc}\ndevice-plugin stderr:\n{self.stderr}") from exc


@pytest.mark.slow
def test_serves_a_saved_inventory_and_stops_cleanly_on_sigterm(
        kubelet: FakeKubelet, tmp_path: Path) -> None:
    inventory = tmp_path / "node.json"
    inventory.write_text(node_inventory().to_json())
    config = tmp_path / "config.toml"
    config.write_text('[log]\nformat = "json"\n')
    with _DevicePlugin("--kubelet-dir", kubelet.directory, "--inventory", str(inventory),
                       "--config", str(config)) as dp:
        conn = kubelet.wait_registered("nvidia.com/gpu")
        assert [d.ID for d in kubelet.wait_list(conn).devices] == [GPU0, GPU2]
        channel, stub = kubelet.client(conn.request.endpoint)
        with channel:
            response = stub.Allocate(pb2.AllocateRequest(container_requests=[
                pb2.ContainerAllocateRequest(devices_ids=[GPU0])]), timeout=WAIT)
        assert dict(response.container_responses[0].annotations) == {
            "devices.nri-accel.io/resource.nvidia.com_gpu": f"nvidia.com/gpu={GPU0}"}
    assert dp.returncode == 0, dp.stderr
    kubelet.wait_for(lambda: conn.ended, "the ListAndWatch stream ends")
    assert sorted(os.listdir(kubelet.directory)) == ["kubelet.sock"]
    assert '"event": "registered"' in dp.stderr and '"event": "stopped"' in dp.stderr


@pytest.mark.slow
def test_watches_the_host_root_and_serves_what_changes(kubelet: FakeKubelet,
                                                       tmp_path: Path) -> None:
    root = materialise("cdi-only", tmp_path / "node")
    config = tmp_path / "config.toml"
    config.write_text('[discovery]\nrefresh_interval = 0.1\n[log]\nformat = "json"\n')
    with _DevicePlugin("--kubelet-dir", kubelet.directory, "--root", root.root,
                       "--config", str(config)) as dp:
        amd = kubelet.wait_registered("amd.com/gpu")
        gaudi = kubelet.wait_registered("habana.ai/gaudi")
        assert [d.ID for d in kubelet.wait_list(amd).devices] == ["0", "1"]
        assert [d.ID for d in kubelet.wait_list(gaudi).devices] == ["0", "1"]
        os.unlink(root.local("/var/run/cdi/habana.ai-gaudi.yaml"))  # the vendor's spec goes
        kubelet.wait_for(lambda: gaudi.ended, "the removed resource's stream ends")
        assert list(gaudi.lists[-1].devices) == []
        assert not amd.ended
    assert dp.returncode == 0, dp.stderr
    assert '"event": "resource_removed"' in dp.stderr


def test_a_missing_kubelet_directory_is_a_configuration_error(tmp_path: Path) -> None:
    inventory = tmp_path / "node.json"
    inventory.write_text(node_inventory().to_json())
    config = tmp_path / "config.toml"
    config.write_text("")
    dp = _DevicePlugin("--kubelet-dir", str(tmp_path / "nope"), "--inventory", str(inventory),
                       "--config", str(config))
    _, err = dp.proc.communicate(timeout=WAIT)
    assert dp.proc.returncode == 2
    assert f"--kubelet-dir: {tmp_path / 'nope'} is not a directory" in err
