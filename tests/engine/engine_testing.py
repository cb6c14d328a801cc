"""Helpers for the selection, edits, Engine and explain tests (imported by the tests).

`demo_inventory()` is the built-in demo node (nri_accel/demo/inventory.json: 8 x A100 80GB
PCIe on 2 NUMA nodes, NVLink bridges pairing 0-1, 2-3, 4-5, GPU 7 in MIG mode with three
MIG devices). `neuron_inventory` stands for a small trn1-style node: 4 Neuron devices of
2 NeuronCores each on a NeuronLink ring. `cdi_inventory` stands for a node whose only
accelerators come from a vendor's CDI spec (acme.example/npu). `container()` builds the
ContainerInfo that nri/convert.py would build from NRI's CreateContainer request (each
container id its own container name unless given: one pod's containers have distinct
names, and a new create of the same pod and name replaces the earlier grant).
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import MappingProxyType

import structlog
from demo_node import DEMO_INVENTORY as DEMO_INVENTORY  # re-exported: tests/demo_node.py
from demo_node import demo_inventory as demo_inventory
from grants import admit as admit  # re-exported: tests/grants.py
from grants import held as held

from nri_accel.config import Config, DevicesConfig, PolicyConfig
from nri_accel.container import ContainerInfo
from nri_accel.inventory import ContainerEdits, Device, DeviceNode, Driver, Hook, Inventory, Mount
from nri_accel.log import configure
from nri_accel.policy import Request
from nri_accel.select import Selection
from nri_accel.syntax import DeviceClaim
from nri_accel.vendors.neuron import KIND as KIND_NEURON
from nri_accel.vendors.nvidia import DEFAULT_CAPABILITIES, DEFAULT_OPTIONS, Options
from nri_accel.vendors.nvidia.requirements import Requirements

REPO = Path(__file__).resolve().parents[2]
DEMO_DIR = REPO / "nri_accel" / "demo"
DEMO_CONFIG = DEMO_DIR / "config.toml"
DEMO_PODS = DEMO_DIR / "pods.yaml"

GPU_UUIDS = {
    "0": "GPU-4f1c2a3e-8b2d-4c71-9a5e-0d3b6c7e1a10",
    "3": "GPU-1a7d4c8e-3f6b-4d2a-9e5c-8b1f0a6d3e43",
    "4": "GPU-6d2f8a1c-9e4b-4a7d-8c3f-1e5b7d0a9c54",
}
MIG_UUIDS = {
    "7:0": "MIG-5b2d7e9a-1f3c-5a8e-9d4b-7c0e2a6f1b98",
    "7:2": "MIG-3f7a9c2e-8b1d-5c4f-a2e9-6d8b1f5c3e1a",
}



def standalone() -> Config:
    return Config(policy=PolicyConfig(mode="standalone"))


def kubernetes(*trusted: str, devices: DevicesConfig | None = None) -> Config:
    return Config(policy=PolicyConfig("kubernetes", frozenset(trusted)),
                  devices=devices or DevicesConfig())


def container(*, namespace: str = "default", pod: str = "pod", name: str = "",
              cid: str = "c1", pod_annotations: dict[str, str] | None = None,
              annotations: dict[str, str] | None = None, env: tuple[str, ...] = (),
              spec_devices: Mapping[str, tuple[str, int, int]] | None = None,
              mount_destinations: frozenset[str] = frozenset()) -> ContainerInfo:
    return ContainerInfo(
        namespace=namespace,
        pod_name=pod,
        pod_uid=f"uid-{pod}",
        container_name=name or f"main-{cid}",
        container_id=cid,
        pod_annotations=MappingProxyType(pod_annotations or {}),
        container_annotations=MappingProxyType(annotations or {}),
        env=env,
        spec_devices=MappingProxyType(spec_devices or {}),
        mount_destinations=mount_destinations,
    )


def allocated(value: str, **kw: object) -> ContainerInfo:
    """A container whose device-plugin allocation (trusted container annotation) is `value`."""
    return container(annotations={"devices.nri-accel.io": value}, **kw)  # type: ignore[arg-type]


def neuron_inventory() -> Inventory:
    devices = []
    for i in range(4):
        devices.append(Device(
            kind=KIND_NEURON, name=str(i), aliases=(f"neuron{i}",),
            edits=ContainerEdits(device_nodes=(DeviceNode(f"/dev/neuron{i}", 240, i),)),
            attributes=MappingProxyType({"cores": "2"}),
            links=(str((i + 1) % 4), str((i - 1) % 4)), vendor="neuron"))
    return Inventory(devices=tuple(devices),
                     drivers=MappingProxyType({"neuron": Driver("neuron", "2.19.64.0")}))


def cdi_inventory(*, hooks: tuple[Hook, ...] = ()) -> Inventory:
    spec_edits = ContainerEdits(
        env=("ACME_RUNTIME=1",),
        mounts=(Mount("/opt/acme/lib/libacme.so.1", "/opt/acme/lib/libacme.so.1"),),
        hooks=hooks)
    devices = tuple(
        Device(kind="acme.example/npu", name=f"npu{i}",
               edits=ContainerEdits(device_nodes=(DeviceNode(f"/dev/acme{i}", 300, i),),
                                    env=(f"ACME_VISIBLE={i}",)),
               vendor="cdi:acme.example/npu")
        for i in range(2))
    driver = Driver("cdi:acme.example/npu",
                    capabilities=MappingProxyType({"": spec_edits}))
    return Inventory(devices=devices, drivers=MappingProxyType({driver.vendor: driver}))


# Stands for the operator's terminal: the CLI verbs configure logging to stderr, and
# structlog keeps the stream of its first use, while capsys's stream is closed after each
# test. Tests that run a verb in-process point its logging here instead, and the
# process-wide structlog configuration is restored afterwards so that later tests see
# the configuration they expect.
LOG_SINK = io.StringIO()


@contextlib.contextmanager
def cli_logs_to_sink(monkeypatch) -> Iterator[None]:  # type: ignore[no-untyped-def]
    import nri_accel.log

    def setup(level: str = "info", fmt: str = "auto", file: object = None) -> None:
        configure(level="warning", fmt="json", file=LOG_SINK)

    monkeypatch.setattr(nri_accel.log, "configure", setup)
    saved = structlog.get_config()
    try:
        yield
    finally:
        structlog.configure(**saved)


def request(*, grants: tuple[DeviceClaim, ...] = (), limits: tuple[DeviceClaim, ...] = (),
            nvidia_none: bool = False, capabilities: frozenset[str] | None = None,
            requirements: Requirements | None = None, mig_config: bool = False,
            mig_monitor: bool = False, cdi_names: tuple[str, ...] = ()) -> Request:
    """The Request the policy would hand on, its NVIDIA settings given by keyword."""
    options = Options(capabilities=DEFAULT_CAPABILITIES if capabilities is None
                      else capabilities,
                      capabilities_source="" if capabilities is None else "test",
                      requirements=requirements, mig_config=mig_config,
                      mig_monitor=mig_monitor)
    return Request(grants=grants, limits=limits,
                   drivers_only=frozenset({"nvidia.com"}) if nvidia_none else frozenset(),
                   options=(("nvidia", options),) if options != DEFAULT_OPTIONS else (),
                   cdi_names=cdi_names)


def held_names(selection: Selection) -> frozenset[str]:
    """Qualified names of what a selection holds exclusively."""
    return frozenset(d.qualified_name for d in (*selection.devices, *selection.passthrough)
                     if d.key in selection.exclusive)


def keys(inventory: Inventory, *qualified: str) -> dict[str, str]:
    """What select() takes as `busy`: the holdings keys (Device.key) of devices named by
    qualified name, each held by "ns/pod/holder"."""
    by_name = {d.qualified_name: d.key for d in inventory.devices}
    return {by_name[q]: "ns/pod/holder" for q in qualified}
