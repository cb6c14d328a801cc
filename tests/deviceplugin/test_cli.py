"""`nri-accel device-plugin` as a process: registration with the fake kubelet, refresh
from a watched host root, SIGTERM, a bad kubelet directory, and its /metrics. The NRI
side is the FakeNriSide of conftest (its state directory as --state-dir)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from fakes.roots import materialise
from metrics_scrape import scrape, wait_for

from nri_accel.deviceplugin import deviceplugin_pb2 as pb2

from .conftest import GPU0, GPU2, FakeNriSide, node_inventory
from .fake_kubelet import WAIT, FakeKubelet

REPO = Path(__file__).resolve().parents[2]


class _DevicePlugin:
    """`nri-accel device-plugin ARGS` in a subprocess. As a context manager: on leaving,
    SIGTERM and wait; if the block failed, the process's stderr joins the error."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "nri_accel", "device-plugin", *args],
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
        kubelet: FakeKubelet, nri_side: FakeNriSide, tmp_path: Path) -> None:
    inventory = tmp_path / "node.json"
    inventory.write_text(node_inventory().to_json())
    config = tmp_path / "config.toml"
    config.write_text('[log]\nformat = "json"\n')
    with _DevicePlugin("--kubelet-dir", kubelet.directory, "--inventory", str(inventory),
                       "--config", str(config), "--state-dir", nri_side.state_dir) as dp:
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
    assert '"event":"registered"' in dp.stderr and '"event":"stopped"' in dp.stderr


@pytest.mark.slow
def test_watches_the_host_root_and_serves_what_changes(kubelet: FakeKubelet,
                                                       nri_side: FakeNriSide,
                                                       tmp_path: Path) -> None:
    root = materialise("cdi-only", tmp_path / "node")
    config = tmp_path / "config.toml"
    config.write_text('[discovery]\nrefresh_interval = 0.1\n[log]\nformat = "json"\n')
    address = f"127.0.0.1:{_free_port()}"
    with _DevicePlugin("--kubelet-dir", kubelet.directory, "--root", root.root,
                       "--config", str(config), "--state-dir", nri_side.state_dir,
                       "--metrics-address", address) as dp:
        amd = kubelet.wait_registered("amd.com/gpu")
        gaudi = kubelet.wait_registered("habana.ai/gaudi")
        assert [d.ID for d in kubelet.wait_list(amd).devices] == ["0", "1"]
        assert [d.ID for d in kubelet.wait_list(gaudi).devices] == ["0", "1"]
        assert scrape(address).value("nri_accel_inventory_refreshes_total") == 0
        os.unlink(root.local("/var/run/cdi/habana.ai-gaudi.yaml"))  # the vendor's spec goes
        kubelet.wait_for(lambda: gaudi.ended, "the removed resource's stream ends")
        assert list(gaudi.lists[-1].devices) == []
        assert not amd.ended
        assert scrape(address).value("nri_accel_inventory_refreshes_total") == 1
    assert dp.returncode == 0, dp.stderr
    assert '"event":"resource_removed"' in dp.stderr


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


def test_a_state_dir_that_is_a_file_is_a_configuration_error(tmp_path: Path) -> None:
    # Absent is fine (`run` creates it); a file there would fail closed forever, each
    # poll reading "no `nri-accel run` has recorded its state".
    inventory = tmp_path / "node.json"
    inventory.write_text(node_inventory().to_json())
    config = tmp_path / "config.toml"
    config.write_text("")
    blocker = tmp_path / "state"
    blocker.write_text("")
    dp = _DevicePlugin("--kubelet-dir", str(tmp_path), "--inventory", str(inventory),
                       "--config", str(config), "--state-dir", str(blocker))
    _, err = dp.proc.communicate(timeout=WAIT)
    assert dp.proc.returncode == 2
    assert f"nri-accel: --state-dir: {blocker} is not a directory" in err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(address: str) -> None:
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + WAIT
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            return
        except OSError:
            assert time.monotonic() < deadline, f"nothing listens on {address}"
            time.sleep(0.05)


@pytest.mark.slow
def test_metrics_and_probes_of_the_device_plugin(kubelet: FakeKubelet, nri_side: FakeNriSide,
                                                 tmp_path: Path) -> None:
    inventory = tmp_path / "node.json"
    inventory.write_text(node_inventory().to_json())
    config = tmp_path / "config.toml"
    config.write_text('[log]\nformat = "json"\n')
    address = f"127.0.0.1:{_free_port()}"
    with _DevicePlugin("--kubelet-dir", kubelet.directory, "--inventory", str(inventory),
                       "--config", str(config), "--state-dir", nri_side.state_dir,
                       "--metrics-address", address):
        _wait_listening(address)
        assert wait_for(address, "/healthz", 200).text == "ok\n"
        assert wait_for(address, "/readyz", 200).text == "ready\n"  # registered with kubelet
        gpu = kubelet.wait_registered("nvidia.com/gpu")
        channel, stub = kubelet.client(gpu.request.endpoint)
        preference = pb2.PreferredAllocationRequest(container_requests=[
            pb2.ContainerPreferredAllocationRequest(available_deviceIDs=[GPU0],
                                                    allocation_size=1)])
        with channel:
            stub.GetPreferredAllocation(preference, timeout=WAIT)
            stub.Allocate(pb2.AllocateRequest(container_requests=[
                pb2.ContainerAllocateRequest(devices_ids=[GPU0])]), timeout=WAIT)
            nri_side.remove()  # `run` gone: the next Allocate is refused, and its preference
            with pytest.raises(grpc.RpcError):
                stub.Allocate(pb2.AllocateRequest(container_requests=[
                    pb2.ContainerAllocateRequest(devices_ids=[GPU0])]), timeout=WAIT)
            with pytest.raises(grpc.RpcError):
                stub.GetPreferredAllocation(preference, timeout=WAIT)
        deadline = time.monotonic() + WAIT  # the gauges follow at the next sample
        while (samples := scrape(address)).value("nri_accel_nri_plugin_registered") != 0:
            assert time.monotonic() < deadline, "nri_accel_nri_plugin_registered stays 1"
            time.sleep(0.1)

        def requests(event: str, outcome: str) -> float:
            return samples.value("nri_accel_requests_total", event=event, outcome=outcome)

        assert (requests("allocate", "ok"), requests("allocate", "refused"),
                requests("allocate", "error")) == (1, 1, 0)
        assert (requests("get_preferred_allocation", "ok"),
                requests("get_preferred_allocation", "refused")) == (1, 1)
        assert requests("pre_start_container", "ok") == 0  # exported from the start
        assert samples.value("nri_accel_request_duration_seconds_count", event="allocate") == 2
        assert samples.labelled("nri_accel_kubelet_registered") == {
            frozenset({("resource", name)}): 1 for name in (
                "acme.example/fpga", "acme.example/npu", "aws.amazon.com/neuron",
                "nvidia.com/gpu", "nvidia.com/mig-1g.10gb", "nvidia.com/mig-2g.20gb")}
        assert samples.value("nri_accel_inventory_refreshes_total") == 0
        # what kubelet is told: with `run` gone, every device Unhealthy (fails closed)
        assert (samples.value("nri_accel_advertised_devices", resource="nvidia.com/gpu",
                              health="Healthy"),
                samples.value("nri_accel_advertised_devices", resource="nvidia.com/gpu",
                              health="Unhealthy")) == (0, 2)
        kubelet.stop()  # kubelet gone: not ready, with the reason
        answer = wait_for(address, "/readyz", 503)
        assert "kubelet" in answer.text
