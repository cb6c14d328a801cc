"""AccelPlugin's handlers over a fake Engine, and where `run` sends its logs."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
from structlog.testing import capture_logs

from nri_accel import log
from nri_accel.container import ContainerInfo
from nri_accel.engine import RESTORE_KEYS
from nri_accel.errors import NriAccelError, PolicyError, RequestError
from nri_accel.inventory import ContainerEdits, Device, DeviceNode
from nri_accel.nri import nri_pb2 as pb
from nri_accel.nri.simulator import LEGACY_EVENTS, Simulator, make_container, make_pod
from nri_accel.nri.stub import Identity, Stub, event_bit
from nri_accel.plugin import RESTORE_SLICE, AccelPlugin
from nri_accel.state import Grant
from nri_accel.vendors.nvidia import KIND_GPU

GPU0 = Device(kind=KIND_GPU, name="0", edits=ContainerEdits(
    device_nodes=(DeviceNode("/dev/nvidia0", 195, 0),)))


class FakePlan:
    """Stands in for engine.Plan: the fields AccelPlugin reads."""

    devices = (GPU0,)
    facts = (("capabilities", "compute,utility"),)
    edits = GPU0.edits
    annotations = MappingProxyType({"nri-accel.io/granted": "nvidia.com/gpu=0"})
    cdi_devices = ()
    grant = Grant("c", exclusive=frozenset({"nvidia.com/gpu=0"}))
    granted_by = MappingProxyType({"nvidia.com/gpu=0": "container annotation "
                                                       "devices.nri-accel.io"})
    notes = ("env NVIDIA_VISIBLE_DEVICES=all not granted: namespace 'ml' is not trusted",)


class FakeEngine:
    """Stands in for nri_accel.engine.Engine: grants GPU 0 to container "main", refuses
    "denied" with a PolicyError, fails on "buggy" like a bug would; records the rest."""

    def __init__(self) -> None:
        self.infos: list[ContainerInfo] = []
        self.committed: list[Any] = []
        self.released: list[str] = []
        self.restored: list[ContainerInfo] = []
        self.restore_parts: list[int] = []

    def plan(self, info: ContainerInfo) -> Any:
        self.infos.append(info)
        if info.container_name == "denied":
            raise PolicyError("may not grant devices in namespace 'ml'",
                              source="env NVIDIA_VISIBLE_DEVICES")
        if info.container_name == "buggy":
            raise ZeroDivisionError("division by zero")
        return FakePlan()

    def holds(self, container_id: str, pod: str, container_name: str) -> bool:
        return False

    def commit(self, plan: Any) -> None:
        self.committed.append(plan)

    def release(self, container_id: str) -> None:
        self.released.append(container_id)

    def release_pod(self, pod_uid: str, pod_id: str) -> tuple[Grant, ...]:
        self.released.append(f"pod {pod_uid}")
        return ()

    def held_containers(self) -> frozenset[str]:
        return frozenset()

    def grants_in(self, containers: Iterable[ContainerInfo],
                  unread: list[str] | None = None) -> list[Grant]:
        part = list(containers)
        self.restore_parts.append(len(part))
        self.restored += part
        return []

    def restore_grants(self, grants: list[Grant], *, known: bool = True) -> None:
        assert grants == [] and known


POD = make_pod({"name": "pod0", "namespace": "ml"})
ASKS = {"devices.nri-accel.io": "nvidia.com/gpu=0"}
"""A container annotation that makes a container ask (one that asks nothing never
reaches the Engine)."""


pytestmark = pytest.mark.usefixtures("all_logs")  # tests/conftest.py


def test_create_container_plans_builds_and_logs_one_canonical_line() -> None:
    engine = FakeEngine()
    ctr = make_container(POD, {"name": "main", "env": ["A=1"], "annotations": ASKS})
    with capture_logs() as logs:
        adj = pb.ContainerAdjustment.FromString(
            AccelPlugin(engine).create_container(POD, ctr))  # type: ignore[arg-type]
    assert [d.path for d in adj.linux.devices] == ["/dev/nvidia0"]
    assert dict(adj.annotations) == {"nri-accel.io/granted": "nvidia.com/gpu=0"}
    assert engine.infos[0].env == ("A=1",) and engine.infos[0].container_id == ctr.id
    (line,) = logs
    assert line["event"] == "container_created" and line["log_level"] == "info"
    assert (line["namespace"], line["pod"], line["container"]) == ("ml", "pod0", "main")
    assert line["devices"] == ["nvidia.com/gpu=0"]
    assert line["granted_by"] == {"nvidia.com/gpu=0": "container annotation devices.nri-accel.io"}
    assert line["capabilities"] == "compute,utility"
    assert len(engine.committed) == 1
    assert line["notes"] == list(FakePlan.notes)
    assert isinstance(line["duration_us"], int) and line["duration_us"] >= 0


def test_a_refusal_is_logged_once_and_raised_as_it_is() -> None:
    with capture_logs() as logs, pytest.raises(PolicyError) as info:
        AccelPlugin(FakeEngine()).create_container(  # type: ignore[arg-type]
            POD, make_container(POD, {"name": "denied", "annotations": ASKS}))
    assert str(info.value).startswith("env NVIDIA_VISIBLE_DEVICES: ")
    (line,) = logs
    assert (line["event"], line["source"]) == ("container_refused", "env NVIDIA_VISIBLE_DEVICES")
    assert line["exc_info"] is None


def test_a_bug_fails_the_container_with_a_readable_reason() -> None:
    with capture_logs() as logs, pytest.raises(NriAccelError, match="internal error: division"):
        AccelPlugin(FakeEngine()).create_container(  # type: ignore[arg-type]
            POD, make_container(POD, {"name": "buggy", "annotations": ASKS}))
    (line,) = logs
    assert line["event"] == "container_refused"
    assert isinstance(line["exc_info"], ZeroDivisionError)  # the traceback is kept


def test_synchronize_restores_the_granted_containers_a_slice_at_a_time() -> None:
    engine = FakeEngine()
    granted = {"nri-accel.io/granted": "nvidia.com/gpu=0"}
    containers = [make_container(POD, {"name": f"c{i}", "state": "CONTAINER_RUNNING",
                                       "annotations": granted}) for i in range(250)]
    turns = []

    async def main() -> None:
        accel = AccelPlugin(engine)  # type: ignore[arg-type]
        task = asyncio.ensure_future(accel.synchronize([POD], containers))
        while not task.done():  # the loop gets a turn after each slice
            turns.append(len(engine.restored))
            await asyncio.sleep(0)

    asyncio.run(main())
    assert engine.restore_parts == [RESTORE_SLICE, RESTORE_SLICE, 250 - 2 * RESTORE_SLICE]
    assert set(turns) >= {RESTORE_SLICE, 2 * RESTORE_SLICE}



def test_synchronize_restores_grants_of_many_keys_in_smaller_slices() -> None:
    """A slice is bounded by the grants' keys too (engine.restore_slices): 100 containers
    each naming 1,000 keys would be read in one turn of the loop (tens of ms)."""
    engine = FakeEngine()
    heavy = {"nri-accel.io/granted": ",".join(f"nvidia.com/gpu=GPU-{i}" for i in range(1000))}
    containers = [make_container(POD, {"name": f"c{i}", "state": "CONTAINER_RUNNING",
                                       "annotations": heavy}) for i in range(10)]
    asyncio.run(AccelPlugin(engine).synchronize([POD], containers))  # type: ignore[arg-type]
    per_slice = RESTORE_KEYS // 1000
    assert engine.restore_parts == [per_slice] * (10 // per_slice) + (
        [10 % per_slice] if 10 % per_slice else [])

def test_stop_and_remove_release_and_synchronize_restores_live_containers() -> None:
    engine = FakeEngine()
    accel = AccelPlugin(engine)  # type: ignore[arg-type]
    running = make_container(POD, {"name": "a", "state": "CONTAINER_RUNNING",
                                   "annotations": {"nri-accel.io/granted": "nvidia.com/gpu=0"}})
    stopped = make_container(POD, {"name": "b", "state": "CONTAINER_STOPPED"})
    asyncio.run(accel.synchronize([POD], [running, stopped]))
    assert [(c.container_id, dict(c.container_annotations)) for c in engine.restored] == [
        (running.id, {"nri-accel.io/granted": "nvidia.com/gpu=0"})]
    accel.stop_container(POD, running)
    accel.remove_container(POD, running)
    accel.remove_pod_sandbox(POD)
    assert engine.released == [running.id, running.id, f"pod {POD.uid}"]


DROP_IN = '[policy]\nmode = "standalone"\n'
"""What a runtime reads from /etc/nri/conf.d/40-nri-accel.conf and hands to Configure."""


def test_configure_reports_a_runtime_handed_config_instead_of_dropping_it() -> None:
    accel = AccelPlugin(FakeEngine())  # type: ignore[arg-type]
    with capture_logs() as logs:
        assert accel.configure("", "containerd", "v2.3.4") is None
    assert logs == []
    with capture_logs() as logs:
        assert accel.configure(DROP_IN, "containerd", "v2.3.4") is None
    (line,) = logs
    assert (line["event"], line["log_level"]) == ("runtime_plugin_config_ignored", "warning")
    assert (line["runtime"], line["size"]) == ("containerd", len(DROP_IN))
    assert "--config" in line["reason"]


class CdiPlan(FakePlan):
    """A grant handed to the runtime as a CDI name (devices.cdi_passthrough)."""

    cdi_devices = ("vendor.example/dev=a",)


class CdiEngine(FakeEngine):
    def plan(self, info: ContainerInfo) -> Any:
        super().plan(info)
        return CdiPlan()


@pytest.mark.parametrize(("runtime", "version", "applied"), [
    ("containerd", "v1.7.24", False),  # NRI v0.6: no CDI field at all
    ("containerd", "v1.7.29", False),  # the field, but no CDI injector
    ("containerd", "v2.0.7", False),
    ("containerd", "v1.7.30", True),
    ("containerd", "v2.1.0", True),
    ("containerd", "v2.3.4", True),
    ("cri-o", "1.36.3", True),
    ("containerd", "", True),  # not known: not refused
])
def test_cdi_names_are_refused_where_the_runtime_would_drop_them(
        runtime: str, version: str, applied: bool) -> None:
    """containerd 1.7 before 1.7.30 and 2.0 take an adjustment's CDI devices and create
    the container without them (containerd/nri pkg/runtime-tools/generate InjectCDIDevices
    does nothing without the runtime's injector): the container would run without its
    devices while nri-accel counts them as held, so it is refused instead."""
    engine = CdiEngine()
    accel = AccelPlugin(engine)  # type: ignore[arg-type]
    accel.configure("", runtime, version)
    ctr = make_container(POD, {"name": "main", "annotations": ASKS})
    if applied:
        adj = pb.ContainerAdjustment.FromString(accel.create_container(POD, ctr))
        assert [d.name for d in adj.CDI_devices] == ["vendor.example/dev=a"]
        assert len(engine.committed) == 1
        return
    with capture_logs() as logs, pytest.raises(RequestError) as info:
        accel.create_container(POD, ctr)
    assert info.value.source == "config devices.cdi_passthrough"
    assert f"{runtime} {version} ignores the CDI devices" in str(info.value)
    assert "vendor.example/dev=a" in str(info.value)
    assert engine.committed == []  # nothing held
    (line,) = logs
    assert line["event"] == "container_refused"


async def test_containerd_1_7_accepts_the_subscription_and_configure_reports_its_config(
    short_dir: Path,
) -> None:
    sock = str(short_dir / "nri.sock")
    async with Simulator(sock, plugin_config=DROP_IN, known_events=LEGACY_EVENTS) as sim:
        stub = Stub(AccelPlugin(FakeEngine()), Identity("nri-accel", "40"),  # type: ignore[arg-type]
                    socket_path=sock)
        with capture_logs() as logs:
            task = asyncio.get_running_loop().create_task(stub.run())
            conn = await sim.wait_for_plugin("nri-accel")
            stub.stop()
            assert await task == 0
    assert conn.events == (event_bit(pb.STOP_POD_SANDBOX) | event_bit(pb.REMOVE_POD_SANDBOX)
                           | event_bit(pb.CREATE_CONTAINER) | event_bit(pb.STOP_CONTAINER)
                           | event_bit(pb.REMOVE_CONTAINER))
    assert not sim.dropped
    assert [line["size"] for line in logs
            if line["event"] == "runtime_plugin_config_ignored"] == [len(DROP_IN)]


def test_logs_go_to_stderr_or_the_given_file_or_the_preregistered_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    assert log.open_log_file(None, preregistered=False) is None
    given = tmp_path / "given.log"
    f = log.open_log_file(str(given), preregistered=False)
    assert f is not None and f.path == str(given)  # type: ignore[attr-defined]
    f.close()
    default = tmp_path / "default.log"
    monkeypatch.setattr(log, "DEFAULT_PREREGISTERED_LOG", str(default))
    f = log.open_log_file(None, preregistered=True)
    assert f is not None and f.path == str(default)  # type: ignore[attr-defined]
    f.close()
    missing = tmp_path / "no" / "such" / "dir.log"
    with pytest.raises(FileNotFoundError):  # the App refuses it: --log-file, exit 2
        log.open_log_file(str(missing), preregistered=True)
    monkeypatch.setattr(log, "DEFAULT_PREREGISTERED_LOG", str(missing))
    assert log.open_log_file(None, preregistered=True) is None  # the default: stderr
    assert f"cannot open log file {missing}" in capsys.readouterr().err


def test_the_log_file_rotates_at_its_size_bound(tmp_path: Path) -> None:
    path = tmp_path / "nri-accel.log"
    f = log.RotatingFile(str(path), max_bytes=100)
    for i in range(10):
        f.write(f"line {i} " + "x" * 30 + "\n")
    f.close()
    assert path.stat().st_size <= 100
    assert (tmp_path / "nri-accel.log.1").stat().st_size <= 100
    assert "line 9" in path.read_text()
    assert not (tmp_path / "nri-accel.log.2").exists()  # one older file kept, no more
