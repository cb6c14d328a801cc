"""nri-accel's own plugin against the real CRI-O 1.36.3 captures (../shared/nri-wire).

CRI-O differs from containerd where grants live or die (the captures' README): most
events come as StateChange, a container created without kubelet's labels has no NRI
name, pod annotations are copied into every container's, and after a `runc create`
that fails inside CreateContainer nothing more is sent for that container. The replayed
bytes drive AccelPlugin over a real Engine; what it answered and what it holds after
each step are checked.

The node: the demo inventory (8 A100s) plus the CDI device the captured pod asks for,
`vendor.example/dev=a` (pod annotation `cdi.k8s.io/x`), under the standalone policy, so
the pod annotation `devices.nri-accel.io/pod: nvidia.com/gpu=1` grants GPU 1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from demo_node import demo_inventory
from grants import held
from wire import replay, runtime_requests

from nri_accel.config import Config, PolicyConfig
from nri_accel.engine import Engine
from nri_accel.inventory import ContainerEdits, Device, DeviceNode, Inventory
from nri_accel.nri import nri_pb2 as pb
from nri_accel.plugin import AccelPlugin
from nri_accel.state import Checkpoint
from nri_accel.ttrpc import ttrpc_pb2

pytestmark = pytest.mark.usefixtures("all_logs")

GPU1 = "nvidia.com/gpu=1"


def node() -> Inventory:
    inv = demo_inventory()
    cdi = Device(kind="vendor.example/dev", name="a", edits=ContainerEdits(
        device_nodes=(DeviceNode("/dev/vexa", 240, 0),)), vendor="")
    return Inventory(devices=(*inv.devices, cdi), drivers=inv.drivers)


class Watching(AccelPlugin):
    """AccelPlugin that records, after each call that can change a grant, what the
    engine holds (container name -> qualified names; the names CRI-O gave)."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self.steps: list[tuple[str, dict[str, tuple[str, ...]]]] = []
        self.created: list[tuple[str, Any]] = []

    def _step(self, what: str) -> None:
        names = {g.container_id: g.container_name for g in self.engine.holdings.grants()}
        self.steps.append((what, {names[c]: q for c, q in held(self.engine).items()}))

    def create_container(self, pod: Any, container: Any) -> Any:
        adjust = super().create_container(pod, container)
        self.created.append((container.name, adjust))
        self._step("create")
        return adjust

    def stop_container(self, pod: Any, container: Any) -> None:
        super().stop_container(pod, container)
        self._step("stop")

    def remove_container(self, pod: Any, container: Any) -> None:
        super().remove_container(pod, container)
        self._step("remove")

    def stop_pod_sandbox(self, pod: Any) -> None:
        super().stop_pod_sandbox(pod)
        self._step("stop pod")

    def remove_pod_sandbox(self, pod: Any) -> None:
        super().remove_pod_sandbox(pod)
        self._step("remove pod")

    async def synchronize(self, pods: list[Any], containers: list[Any]) -> None:
        await super().synchronize(pods, containers)
        self._step("synchronize")


def engine(**kw: Any) -> Engine:
    return Engine(node(), Config(policy=PolicyConfig(mode="standalone"), **kw))


def create_answers(wire_dir: Path, capture: str, relay: int,
                   frames: list[Any]) -> list[pb.CreateContainerResponse]:
    streams = {sid for sid, method, _ in runtime_requests(wire_dir, capture, relay)
               if method == "CreateContainer"}
    out = []
    for conn, frame in frames:
        if conn == 1 and frame.stream_id in streams:
            response = ttrpc_pb2.Response.FromString(frame.payload)
            assert not response.HasField("status"), response.status
            out.append(pb.CreateContainerResponse.FromString(response.payload))
    return out


async def test_a_failed_create_is_freed_when_its_pod_goes(nri_wire_dir: Path) -> None:
    plugin = Watching(engine())
    frames, _, rc = await replay(nri_wire_dir, "crio-1.36.3-failed-create", 1, plugin)
    assert rc == 0
    (answer,) = create_answers(nri_wire_dir, "crio-1.36.3-failed-create", 1, frames)
    assert {d.path for d in answer.adjust.linux.devices} >= {"/dev/nvidia1", "/dev/vexa"}
    # CreateContainer answered: GPU 1 (and the CDI device) held. Then `runc create`
    # failed and CRI-O sent nothing for the container: only the pod's stop and removal.
    assert [what for what, _ in plugin.steps] == ["synchronize", "create", "stop pod",
                                                  "remove pod"]
    assert plugin.steps[1][1] == {"ctr-missing": (GPU1, "vendor.example/dev=a")}
    assert plugin.steps[2][1] == {}  # the pod's stop freed it
    assert held(plugin.engine) == {}


async def test_lifecycle_names_the_unnamed_container_and_frees_each_grant(
        nri_wire_dir: Path) -> None:
    plugin = Watching(engine())
    frames, _, rc = await replay(nri_wire_dir, "crio-1.36.3-lifecycle", 1, plugin)
    assert rc == 0
    answers = create_answers(nri_wire_dir, "crio-1.36.3-lifecycle", 1, frames)
    # Container A is stopped and removed before B is created: each gets GPU 1 in turn.
    assert len(answers) == 2
    for a in answers:
        assert "/dev/nvidia1" in {d.path for d in a.adjust.linux.devices}
    # B was created without kubelet's labels: no NRI name, its CRI name from CRI-O's
    # metadata annotation.
    assert [name for name, _ in plugin.created] == ["ctr-a", ""]
    assert ("create", {"ctr-b": (GPU1, "vendor.example/dev=a")}) in plugin.steps
    assert plugin.steps[-1] == ("remove pod", {})


async def test_a_restart_keeps_the_live_containers_grant(nri_wire_dir: Path,
                                                        tmp_path: Path) -> None:
    # conn 1: the container is created (and granted) and runs; CRI-O stops. conn 2: the
    # plugin restarted, from its checkpoint; the Synchronize lists the live container.
    # The captured container carries no nri-accel annotation (a logger plugin answered
    # in the recording): its grant comes from the checkpoint, kept because it still runs.
    first = Watching(engine())
    await replay(nri_wire_dir, "crio-1.36.3-restart-sync", 1, first)
    assert first.steps[-1][1] == {"ctr-live": (GPU1, "vendor.example/dev=a")}
    checkpoint = Checkpoint(str(tmp_path), boot_id="boot")
    checkpoint.save(first.engine.holdings.to_json("boot"))

    restarted = Watching(engine())
    restarted.engine.load_checkpoint(*checkpoint.load())
    await replay(nri_wire_dir, "crio-1.36.3-restart-sync", 2, restarted)
    what, holding = restarted.steps[0]
    assert (what, holding) == ("synchronize", {"ctr-live": (GPU1, "vendor.example/dev=a")})
    # and then the container and its pod are stopped and removed
    assert restarted.steps[-1] == ("remove pod", {})
