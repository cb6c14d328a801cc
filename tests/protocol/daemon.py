"""`nri-accel run` as a subprocess: helpers of the tests that drive the real daemon.

The daemon gets a small saved inventory (four GPUs, the NVIDIA driver's control node
and nvidia-smi) and a standalone-mode config, so pod annotations grant devices; it
logs JSON lines to a file the tests read and keeps its state (the grant checkpoint) in
a directory of its own. conftest.py's `daemon_files` fixture writes these files in a
fresh short directory.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from types import MappingProxyType
from typing import Any

from nri_accel.inventory import (
    ContainerEdits,
    Device,
    DeviceNode,
    Driver,
    Inventory,
    Mount,
)
from nri_accel.nri import nri_pb2 as pb
from nri_accel.nri.simulator import make_container, make_pod
from nri_accel.vendors.nvidia import KIND_GPU

GPUS = 4


def _inventory() -> Inventory:
    gpus = tuple(
        Device(kind=KIND_GPU, name=str(i), uuid=f"GPU-{i:08d}-0000-4000-8000-000000000000",
               vendor="nvidia",
               edits=ContainerEdits(device_nodes=(DeviceNode(f"/dev/nvidia{i}", 195, i),)))
        for i in range(GPUS))
    driver = Driver("nvidia", "550.54.15", "12.4", MappingProxyType({
        "": ContainerEdits(device_nodes=(DeviceNode("/dev/nvidiactl", 195, 255),)),
        "utility": ContainerEdits(mounts=(Mount("/usr/bin/nvidia-smi", "/usr/bin/nvidia-smi"),)),
        "compute": ContainerEdits(),
    }))
    return Inventory(devices=gpus, drivers=MappingProxyType({"nvidia": driver}))


def key(i: int) -> str:
    """The grant record's name of GPU i (nri_accel.inventory.Device.key)."""
    return _inventory().devices[i].key


def write_daemon_files(directory: Path) -> dict[str, str]:
    """The daemon's inventory and config (standalone mode, debug logs) in `directory`;
    the paths of those, of its log file and of the runtime's socket."""
    inventory = directory / "inventory.json"
    inventory.write_text(_inventory().to_json())
    config = directory / "config.toml"
    config.write_text('[policy]\nmode = "standalone"\n[log]\nlevel = "debug"\n')
    return {"inventory": str(inventory), "config": str(config),
            "log": str(directory / "daemon.log"), "socket": str(directory / "nri.sock"),
            "state": str(directory / "state")}


def run_args(files: dict[str, str], *extra: str) -> list[str]:
    return [sys.executable, "-m", "nri_accel", "run", "--inventory", files["inventory"],
            "--config", files["config"], "--log-file", files["log"],
            "--state-dir", files["state"], *extra]


def start_daemon(files: dict[str, str], *extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(run_args(files, "--socket", files["socket"], *extra),
                            stdin=subprocess.DEVNULL)


def log_events(files: dict[str, str]) -> list[dict[str, Any]]:
    with open(files["log"], encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
    return proc.wait(timeout=10)


def gpu_request(pod_name: str, value: str) -> tuple[pb.PodSandbox, pb.Container]:
    pod = make_pod({"name": pod_name, "namespace": "ml",
                    "annotations": {"devices.nri-accel.io/container.main": value}})
    return pod, make_container(pod, {"name": "main", "env": ["PATH=/usr/bin"]})
