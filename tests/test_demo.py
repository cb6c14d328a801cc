"""`nri-accel demo` (the README's main command) runs the real daemon end to end, on the
default a100 node and on the mixed (Intel Gaudi and AMD Instinct) node."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from demo_node import mixed_inventory

from nri_accel.demo import NODES
from nri_accel.inventory import Device, Inventory


@pytest.mark.slow
def test_demo_runs_the_daemon_and_prints_what_each_container_gets() -> None:
    proc = subprocess.run([sys.executable, "-m", "nri_accel", "demo"],
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
    proc = subprocess.run([sys.executable, "-m", "nri_accel", "demo", "--json"],
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


# ---- the mixed node: Intel Gaudi and AMD Instinct ---------------------------------------

MIXED = Inventory.load(NODES["mixed"].inventory)


def test_mixed_node_inventory_is_what_discovery_finds_on_the_fake_roots(tmp_path: Path) -> None:
    """nri_accel/demo/mixed/inventory.json cannot drift from discovery: it is regenerated
    here from the gaudi2-hls and mi300x fake roots (UPDATE_GOLDEN=1 rewrites it)."""
    text = mixed_inventory(tmp_path).to_json()
    if os.environ.get("UPDATE_GOLDEN") == "1":
        NODES["mixed"].inventory.write_text(text)
    assert text == NODES["mixed"].inventory.read_text(), \
        "UPDATE_GOLDEN=1 regenerates nri_accel/demo/mixed/inventory.json"


def _granted(annotation: str) -> list[Device]:
    """The devices a device-plugin Allocate annotation names (qualified names)."""
    out = []
    for qualified in annotation.split(","):
        kind, _, ident = qualified.partition("=")
        device = MIXED.find(kind, ident)
        assert device is not None, qualified
        out.append(device)
    return out


def _nodes(devices: list[Device]) -> list[str]:
    return [n.path for d in devices for n in d.edits.device_nodes]


@pytest.mark.slow
def test_demo_mixed_node_prints_gaudi_and_amd_containers() -> None:
    proc = subprocess.run([sys.executable, "-m", "nri_accel", "demo", "--node", "mixed"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    head = out.splitlines()
    assert head[0] == ("demo node: 4 x amd.com/gpu, 7 x habana.ai/gaudi; amd driver 6.10.5; "
                       "gaudi driver 1.18.0-ee698fb")
    assert head[1].endswith("nri_accel/demo/mixed/inventory.json")
    assert "unhealthy habana.ai/gaudi=5: Needs reset" in head
    blocks = {b.splitlines()[0]: b for b in out.split("\n\n") if b.strip()}

    # Device plugin: the Allocate annotation's devices are exactly what the container gets.
    gaudi = blocks["ml/gaudi-train/trainer"]
    (annotation,) = re.findall(r"kubelet  devices\.nri-accel\.io/resource\.habana\.ai_gaudi="
                               r"(\S+)", gaudi)
    granted = _granted(annotation)
    assert len(granted) == 2 and all(d.healthy for d in granted)
    assert re.search(r"devices  (.*)", gaudi)[1].split() == sorted(_nodes(granted))
    modules = ",".join(d.attributes["module_id"] for d in granted)
    assert f"HABANA_VISIBLE_DEVICES={','.join(d.name for d in granted)}\n" in gaudi
    assert f"HABANA_VISIBLE_MODULES={modules}\n" in gaudi

    amd = blocks["ml/rocm-one/main"]
    (annotation,) = re.findall(r"resource\.amd\.com_gpu=(\S+)", amd)
    (gpu,) = _granted(annotation)
    (render,) = _nodes([gpu])
    assert render.startswith("/dev/dri/renderD")
    assert f"devices  {render} /dev/kfd\n" in amd
    assert f"env      AMD_VISIBLE_DEVICES={gpu.name}\n" in amd

    # Env in the trusted namespace; the untrusted namespace gets nothing.
    assert "HABANA_VISIBLE_DEVICES=0,3\n  env      HABANA_VISIBLE_MODULES=3,2" \
        in blocks["research/gaudi-env/bench"]
    assert "devices  /dev/dri/renderD128 /dev/dri/renderD131 /dev/kfd" \
        in blocks["research/rocm-env/main"]
    grab = blocks["sandbox/grab-env/shell"]
    assert "no devices" in grab
    assert "env      AMD_VISIBLE_DEVICES=none" in grab
    assert "env      HABANA_VISIBLE_DEVICES=none" in grab
    assert ("REFUSED  env HABANA_VISIBLE_DEVICES: habana.ai/gaudi=5 is unhealthy (Needs reset)"
            in blocks["research/gaudi-reset/bench"])
    assert ("REFUSED  env AMD_VISIBLE_DEVICES: 'GPU-3a5c4e1f2b7d9086' is ROCm's UUID form; "
            "AMD_VISIBLE_DEVICES takes the unique id as '0x3a5c4e1f2b7d9086'"
            in blocks["research/rocm-uuid/main"])

    log = out[out.index("daemon log"):]
    assert re.search(r"created  ml/gaudi-train/trainer +habana\.ai/gaudi=\d,habana\.ai/gaudi=\d"
                     r"  \d+ us", log)
    assert re.search(r"created  sandbox/grab-env/shell +-  \d+ us  \[env HABANA_VISIBLE_DEVICES"
                     r"=all not granted", log)
    assert re.search(r"refused  research/gaudi-reset/bench +env HABANA_VISIBLE_DEVICES", log)


@pytest.mark.slow
def test_demo_mixed_node_json_env_matches_the_granted_devices() -> None:
    proc = subprocess.run([sys.executable, "-m", "nri_accel", "demo", "--node", "mixed",
                           "--json"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert set(doc) == {"node", "daemon", "containers", "log"}
    node = doc["node"]
    assert node["name"] == "mixed"
    assert node["devices"] == {"amd.com/gpu": 4, "habana.ai/gaudi": 7}
    assert node["unhealthy"] == {"habana.ai/gaudi=5": "Needs reset"}
    assert node["drivers"] == {"amd": "6.10.5", "gaudi": "1.18.0-ee698fb"}
    assert node["nvidia_driver"] is None

    by_name = {f"{c['namespace']}/{c['pod']}/{c['container']}": c for c in doc["containers"]}
    assert len(by_name) == 7
    granted_env = 0
    for c in by_name.values():
        if "refused" in c:
            continue
        adj = c["adjustment"]
        env = {e["key"]: e["value"] for e in adj["env"]}
        annotation = adj.get("annotations", {}).get("nri-accel.io/granted")
        granted = _granted(annotation) if annotation else []
        devices = {(d["path"], int(d["major"]), int(d.get("minor", 0)))
                   for d in adj.get("linux", {}).get("devices", [])}
        gaudis = sorted((d for d in granted if d.kind == "habana.ai/gaudi"),
                        key=lambda d: int(d.name))
        gpus = sorted((d for d in granted if d.kind == "amd.com/gpu"), key=lambda d: int(d.name))
        expected = {(n.path, n.major, n.minor) for d in granted for n in d.edits.device_nodes}
        if gpus:  # /dev/kfd: the AMD driver's one node for every GPU
            (kfd,) = MIXED.driver("amd").capabilities[""].device_nodes
            expected.add((kfd.path, kfd.major, kfd.minor))
        assert devices == expected, c["pod"]
        if gaudis:
            granted_env += 1
            assert env["HABANA_VISIBLE_DEVICES"] == ",".join(d.name for d in gaudis)
            assert env["HABANA_VISIBLE_MODULES"] == ",".join(d.attributes["module_id"]
                                                             for d in gaudis)
        if gpus:
            granted_env += 1
            assert env["AMD_VISIBLE_DEVICES"] == ",".join(d.name for d in gpus)
            assert not {"ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"} & set(env)
        if not granted:  # the untrusted namespace: its env asks, nothing is granted
            assert env == {"AMD_VISIBLE_DEVICES": "none", "HABANA_VISIBLE_DEVICES": "none"}
    assert granted_env == 4  # two Gaudi and two AMD containers
    assert "linux" not in by_name["sandbox/grab-env/shell"]["adjustment"]

    reset = by_name["research/gaudi-reset/bench"]["refused"]
    assert reset["message"] == ("env HABANA_VISIBLE_DEVICES: habana.ai/gaudi=5 is unhealthy "
                                "(Needs reset): it is granted to no new container")
    uuid = by_name["research/rocm-uuid/main"]["refused"]
    assert uuid["code"] == "INVALID_ARGUMENT"
    assert "takes the unique id as '0x3a5c4e1f2b7d9086'" in uuid["message"]

    log = doc["log"]
    assert [f"{r['namespace']}/{r['pod']}/{r['container']}" for r in log] == list(by_name)
    assert [r["event"] for r in log] == [
        "container_refused" if "refused" in c else "container_created"
        for c in doc["containers"]]
