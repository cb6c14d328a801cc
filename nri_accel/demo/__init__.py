"""`nri-accel demo`: the real daemon, a simulated runtime, a built-in node and pods.

Owns: the demo nodes (NODES: each a saved inventory and its pods, one configuration for
all), the demo run and its printout. Imports explain (Pod manifests, the simulated
kubelet), nri.simulator (the runtime side of NRI), nri.adjust (JSON rendering), config,
inventory, log and the standard library; at module level only the standard library and msgspec
(the CLI reads NODES for its --node choices).

The daemon is started exactly as an operator would (`nri-accel run --socket ...`) as a
subprocess, against the chosen node's inventory and the built-in configuration
(config.toml: Kubernetes policy, one trusted namespace). The nodes: `a100` (the default;
inventory.json and pods.yaml: an 8-GPU A100 node with one GPU in MIG mode) and `mixed`
(mixed/: seven Intel Gaudi2 and four AMD MI300X devices, what discovery finds on the
gaudi2-hls and mi300x fake roots put on one node). explain.KubeletDevices plays kubelet
with nri-accel's device plugin: it allocates the pods' device-plugin resources
(nvidia.com/gpu, nvidia.com/mig-<profile>, habana.ai/gaudi, amd.com/gpu) and hands the
plugin's Allocate annotations to the containers. The simulator plays containerd: it
accepts the registration, configures and synchronises the plugin, then sends
CreateContainer for every container of the node's pods over the real unix socket, and
prints what each container got back.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from msgspec import Struct

HERE = Path(__file__).resolve().parent
CONFIG = HERE / "config.toml"


class Node(Struct, frozen=True):
    """One built-in demo node: a saved Inventory and the pods created on it."""

    inventory: Path
    pods: Path


NODES = {
    "a100": Node(HERE / "inventory.json", HERE / "pods.yaml"),
    "mixed": Node(HERE / "mixed" / "inventory.json", HERE / "mixed" / "pods.yaml"),
}
DEFAULT_NODE = "a100"


def main_demo(args: argparse.Namespace) -> int:
    from nri_accel import log

    log.configure(level="warning", fmt="console")
    import tempfile  # here: the CLI imports this module for NODES, `run` included

    # `nri-accel demo | head`: the reader leaving ends it quietly (cli.main)
    with tempfile.TemporaryDirectory(prefix="nri-accel-demo-") as tmp:
        return asyncio.run(_demo(Path(tmp), args.node, as_json=args.json))


async def _demo(tmp: Path, name: str, *, as_json: bool) -> int:
    from nri_accel.config import load_config
    from nri_accel.explain import KubeletDevices, pod_containers, read_manifests
    from nri_accel.inventory import Inventory
    from nri_accel.nri.adjust import to_dict
    from nri_accel.nri.simulator import PluginError, Simulator, make_container, make_pod

    demo_node = NODES[name]
    inventory = Inventory.load(demo_node.inventory)
    kubelet = KubeletDevices(inventory, load_config(str(CONFIG)))
    pods = str(demo_node.pods)
    containers = [c for m in read_manifests(pods) for c in pod_containers(m, pods, kubelet)]
    socket_path = str(tmp / "nri.sock")
    log_path = tmp / "daemon.log"
    node = _node(name, demo_node, inventory)
    if not as_json:
        _print_header(node)
    results: list[dict[str, Any]] = []
    async with Simulator(socket_path, runtime_name="nri-accel-demo") as sim:
        # The daemon's stdout goes to stderr: stdout is the demo's (one JSON document).
        daemon = subprocess.Popen(
            [sys.executable, "-m", "nri_accel", "run", "--socket", socket_path,
             "--inventory", str(demo_node.inventory), "--config", str(CONFIG),
             "--log-file", str(log_path), "--state-dir", str(tmp / "state")],
            stdin=subprocess.DEVNULL, stdout=2,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            plugin = await sim.wait_for_plugin(timeout=10.0)
            registered = {"name": plugin.full_name, "pid": daemon.pid, "socket": socket_path}
            if not as_json:
                print(f"daemon registered as {plugin.full_name} (pid {daemon.pid}), "
                      f"socket {socket_path}\n")
            for c in containers:
                info = c.info
                pod = make_pod({"name": info.pod_name, "namespace": info.namespace,
                                "uid": info.pod_uid, "annotations": dict(info.pod_annotations)})
                ctr = make_container(pod, {"name": info.container_name, "env": list(info.env),
                                           "annotations": dict(info.container_annotations)})
                result: dict[str, Any] = {
                    "namespace": info.namespace, "pod": info.pod_name,
                    "container": info.container_name,
                    "kubelet_annotations": dict(sorted(info.container_annotations.items())),
                }
                title = f"{info.namespace}/{info.pod_name}/{info.container_name}"
                try:
                    rsp = await sim.create_container(pod, ctr)
                except PluginError as e:
                    result["refused"] = {"code": e.code.name, "message": e.message}
                    if not as_json:
                        print(f"{title}\n  REFUSED  {e.message}\n")
                else:
                    result["adjustment"] = to_dict(rsp.adjust)
                    if not as_json:
                        print(_render(title, info.container_annotations, rsp.adjust))
                results.append(result)
        finally:
            daemon.terminate()
            daemon.wait(timeout=10)
    log_records = _read_log(log_path)
    if as_json:
        doc = {"node": node, "daemon": registered, "containers": results, "log": log_records}
        print(json.dumps(doc, indent=2))
    else:
        _print_log(log_records)
    return 0


def _node(name: str, demo_node: Node, inventory: Any) -> dict[str, Any]:
    """The demo node in brief: its inputs, device counts by kind, the unhealthy devices
    (qualified name -> why), each driver's version and the NVIDIA driver's."""
    nvidia = inventory.driver("nvidia")
    kinds: dict[str, int] = {}
    for d in inventory.devices:
        kinds[d.kind] = kinds.get(d.kind, 0) + 1
    return {
        "name": name,
        "inventory": str(demo_node.inventory), "config": str(CONFIG),
        "pods": str(demo_node.pods),
        "devices": kinds,
        "unhealthy": {d.qualified_name: d.attributes.get("health", "")
                      for d in inventory.devices if not d.healthy},
        "drivers": {vendor: d.version for vendor, d in inventory.drivers.items()},
        "nvidia_driver": ({"version": nvidia.version, "cuda_version": nvidia.cuda_version}
                          if nvidia else None),
    }


def _print_header(node: Mapping[str, Any]) -> None:
    nvidia = node["nvidia_driver"]
    drivers = [f"NVIDIA driver {nvidia['version']}, CUDA {nvidia['cuda_version']}"
               if vendor == "nvidia" else f"{vendor} driver {version}"
               for vendor, version in node["drivers"].items()]
    print("demo node: " + ", ".join(f"{n} x {k}" for k, n in node["devices"].items())
          + "".join(f"; {d}" for d in drivers))
    print(f"inventory {node['inventory']}\nconfig    {node['config']}\n"
          f"pods      {node['pods']}")
    for device, why in node["unhealthy"].items():
        print(f"unhealthy {device}: {why}")
    print()


def _render(title: str, kubelet: Mapping[str, str], adj: Any) -> str:
    """What kubelet passed (the device plugin's Allocate annotations) and what the
    daemon answered."""
    devices = [d.path for d in adj.linux.devices]
    env = [f"{e.key}={e.value}" for e in adj.env]
    lines = [title]
    lines.extend(f"  kubelet  {k}={v}" for k, v in sorted(kubelet.items()))
    if devices:
        lines.append(f"  devices  {' '.join(devices)}")
    else:
        lines.append("  no devices")
    if adj.mounts:
        libs = sorted(os.path.basename(m.destination) for m in adj.mounts)
        shown = ", ".join(libs[:6]) + (f", ... ({len(libs)} in all)" if len(libs) > 6 else "")
        lines.append(f"  mounts   {shown}")
    lines.extend(f"  env      {kv}" for kv in env)
    lines.extend(f"  annot.   {k}={v}" for k, v in sorted(adj.annotations.items()))
    return "\n".join(lines) + "\n"


def _read_log(path: Path) -> list[dict[str, Any]]:
    """The daemon's canonical per-container log records (one per CreateContainer)."""
    try:
        text = path.read_text()
    except OSError:
        return []
    records = []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and rec.get("event") in ("container_created",
                                                          "container_refused"):
            records.append(rec)
    return records


def _print_log(records: list[dict[str, Any]]) -> None:
    """The canonical log lines, as an operator sees them."""
    print("daemon log (one line per CreateContainer):")
    if not records:
        print("  (no log written)")
    for rec in records:
        who = f"{rec.get('namespace')}/{rec.get('pod')}/{rec.get('container')}"
        if rec["event"] == "container_created":
            what = ",".join(rec.get("devices") or []) or "-"
            notes = "; ".join(rec.get("notes") or [])
            print(f"  created  {who:<36} {what}  {rec.get('duration_us')} us"
                  + (f"  [{notes}]" if notes else ""))
        else:
            print(f"  refused  {who:<36} {rec.get('error')}  {rec.get('duration_us')} us")
