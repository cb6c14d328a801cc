"""`nri-accel run --root` on a fake H100 node follows its GPUs' health: a GPU the NVIDIA
health watch marks unhealthy (an XID the fake NVML raises, as the driver would) is
granted to no new container, by a refusal naming it, and is granted again once NVML's
recheck passes. tests/fakes/roots/h100 is the node; its libnvidia-ml is the fake NVML
of tests/fakes/nvml driving the real pynvml. Waits are bounded waits for an expected
line or answer; nothing measures how fast it comes."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
from daemon import log_events, stop
from fakes.nvml.node import FakeNode
from fakes.roots import materialise

from nri_accel.nri.simulator import PluginError, Simulator, make_container, make_pod
from nri_accel.ttrpc import Code

H100 = ["GPU-74106407-f32f-0663-90a7-a1acf7eb04ae", "GPU-08f22e65-3b2d-59a7-2659-c71f416a3808",
        "GPU-126d4085-7b1a-a246-402b-e786f0d2a595", "GPU-d6a0ae3c-5011-a59d-c8a7-2b61c6a912e7"]
WAIT = 20.0


def request(name: str, value: str) -> tuple[object, object]:
    pod = make_pod({"name": name, "namespace": "ml",
                    "annotations": {"devices.nri-accel.io/container.main": value}})
    return pod, make_container(pod, {"name": "main"})


async def until_logged(log_file: Path, predicate: object, what: str) -> dict:
    deadline = asyncio.get_running_loop().time() + WAIT
    while True:
        files = {"log": str(log_file)}
        for event in log_events(files) if log_file.exists() else []:
            if predicate(event):  # type: ignore[operator]
                return event
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"no log line: {what}")
        await asyncio.sleep(0.05)


@pytest.mark.slow
async def test_an_unhealthy_gpu_is_refused_by_name_and_granted_again_once_healthy(
        tmp_path: Path, short_dir: Path) -> None:
    root = materialise("h100", tmp_path / "h100")
    node = FakeNode(root)
    config = tmp_path / "config.toml"
    config.write_text('[policy]\nmode = "standalone"\n'
                      f'[discovery]\nrefresh_interval = 0\ndriver_root = "{root.driver_root}"\n'
                      '[health]\nrecheck_interval = 1.0\n[log]\nlevel = "debug"\n')
    log_file = short_dir / "run.log"
    sock = str(short_dir / "nri.sock")
    async with Simulator(sock) as sim:
        proc = subprocess.Popen(
            [sys.executable, "-m", "nri_accel", "run", "--socket", sock, "--root",
             root.root, "--config", str(config), "--log-file", str(log_file),
             "--state-dir", str(short_dir / "state")], stdin=subprocess.DEVNULL)
        try:
            await sim.wait_for_plugin("nri-accel", timeout=WAIT)
            await until_logged(log_file, lambda e: e.get("event") == "health_watch_started",
                               "the NVML watch registered for events")
            pod, ctr = request("first", f"nvidia.com/gpu={H100[1]}")
            await sim.create_container(pod, ctr)
            await sim.remove_container(pod, ctr)

            node.inject(f"xid {H100[1]} 79")
            await until_logged(log_file, lambda e: e.get("event") == "unhealthy_devices"
                               and f"nvidia.com/gpu={H100[1]}" in (e.get("unhealthy") or {}),
                               "GPU 1 marked unhealthy")
            pod, ctr = request("second", f"nvidia.com/gpu={H100[1]}")
            with pytest.raises(PluginError) as refused:
                await sim.create_container(pod, ctr)
            assert refused.value.code == Code.RESOURCE_EXHAUSTED
            assert "nvidia.com/gpu=1 is unhealthy (XID 79)" in refused.value.message
            counted = request("count", "nvidia.com/gpu: 4")
            with pytest.raises(PluginError, match="only 3 of 4 are free"):
                await sim.create_container(*counted)

            # Quiet for recheck_interval, the fake GPU answers NVML: healthy again.
            await until_logged(log_file, lambda e: e.get("event") == "unhealthy_devices"
                               and e.get("unhealthy") == {} and e["timestamp"] >
                               refused_at(log_file), "GPU 1 healthy again")
            rsp = await sim.create_container(pod, ctr)
            assert "/dev/nvidia1" in {d.path for d in rsp.adjust.linux.devices}
        finally:
            assert stop(proc) == 0


def refused_at(log_file: Path) -> str:
    """When the daemon refused the unhealthy GPU (the first container_refused line)."""
    return next(e["timestamp"] for e in log_events({"log": str(log_file)})
                if e.get("event") == "container_refused")
