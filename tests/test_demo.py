"""`nri-accel demo` (the README's main command) runs the real daemon end to end."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_demo_runs_the_daemon_and_prints_what_each_container_gets() -> None:
    proc = subprocess.run([sys.executable, "-m", "nri_accel.cli", "demo"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert re.search(r"daemon registered as 40-nri-accel \(pid \d+\)", out)
    blocks = {b.splitlines()[0]: b for b in out.split("\n\n") if b.strip()}
    one = blocks["ml/cuda-one/main"]
    assert re.search(r"devices .*/dev/nvidia\d ", one)
    assert "/dev/nvidiactl" in one
    assert re.search(r"NVIDIA_VISIBLE_DEVICES=GPU-[0-9a-f-]{36}$", one, re.M)
    assert "libcuda.so.1" in one
    assert "no devices" in blocks["sandbox/notebook/jupyter"]
    assert "REFUSED  annotation devices.nri-accel.io/pod: pod annotations may not grant" \
        in blocks["sandbox/grab-all/miner"]
    assert "REFUSED  annotation devices.nri-accel.io/container.app" \
        in blocks["research/malformed/app"]
    # The daemon's own canonical log lines, one per CreateContainer.
    log = out[out.index("daemon log"):]
    assert re.search(r"created  ml/cuda-one/main +nvidia\.com/gpu=\d+  \d+ us", log)
    assert re.search(r"refused  sandbox/grab-all/miner", log)
    assert "not granted" in log  # the notebook's ignored NVIDIA_VISIBLE_DEVICES=all


@pytest.mark.slow
def test_demo_json_is_one_document_with_every_container_and_the_log() -> None:
    proc = subprocess.run([sys.executable, "-m", "nri_accel.cli", "demo", "--json"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)  # the whole of stdout, nothing before or after
    assert set(doc) == {"node", "daemon", "containers", "log"}
    assert doc["node"]["devices"] == {"nvidia.com/gpu": 8, "nvidia.com/mig": 3}
    assert doc["node"]["nvidia_driver"] == {"version": "550.54.15", "cuda_version": "12.4"}
    assert doc["daemon"]["name"] == "40-nri-accel"
    assert isinstance(doc["daemon"]["pid"], int)

    by_name = {f"{c['namespace']}/{c['pod']}/{c['container']}": c for c in doc["containers"]}
    assert len(by_name) == len(doc["containers"]) == 7
    for c in doc["containers"]:
        assert ("adjustment" in c) != ("refused" in c), c  # exactly one of them
        assert isinstance(c["kubelet_annotations"], dict)
    one = by_name["ml/cuda-one/main"]
    (grant,) = one["kubelet_annotations"].values()
    uuid = grant.removeprefix("nvidia.com/gpu=")
    assert re.fullmatch(r"GPU-[0-9a-f-]{36}", uuid)
    adj = one["adjustment"]  # the protobuf JSON mapping: protojson field names
    paths = [d["path"] for d in adj["linux"]["devices"]]
    assert "/dev/nvidiactl" in paths
    assert any(re.fullmatch(r"/dev/nvidia\d", p) for p in paths)
    assert {"key": "NVIDIA_VISIBLE_DEVICES", "value": uuid} in adj["env"]
    assert any(m["destination"].endswith("/libcuda.so.1") for m in adj["mounts"])
    assert "linux" not in by_name["sandbox/notebook/jupyter"]["adjustment"]  # no devices
    refused = by_name["sandbox/grab-all/miner"]["refused"]
    assert refused["code"] == "PERMISSION_DENIED"
    assert refused["message"].startswith(
        "annotation devices.nri-accel.io/pod: pod annotations may not grant")
    assert by_name["research/malformed/app"]["refused"]["code"] == "INVALID_ARGUMENT"

    # The daemon's canonical log records, one per CreateContainer, in order.
    log = doc["log"]
    assert [f"{r['namespace']}/{r['pod']}/{r['container']}" for r in log] == list(by_name)
    assert [r["event"] for r in log] == [
        "container_refused" if "refused" in c else "container_created"
        for c in doc["containers"]]
    (granted,) = log[0]["devices"]
    assert f"/dev/nvidia{granted.removeprefix('nvidia.com/gpu=')}" in paths
    assert all(isinstance(r["duration_us"], int) for r in log)
