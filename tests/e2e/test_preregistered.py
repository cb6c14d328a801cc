"""End to end: nri-accel as a pre-registered plugin that containerd launches itself, and
the grants it keeps across containerd's restarts (issue #9 item 3), against the same
real containerds as test_containerd.py (Debian's 1.7.24, NRI v0.6, and 2.1.9, NRI v0.8).
Every test runs once per containerd; its id names the version.

How containerd treats a plugin it launches (NRI's pkg/adaptation: startPlugins,
newLaunchedPlugin; and what these tests observed): when it starts, it runs every
executable NN-name in plugin_path with no arguments, NRI_PLUGIN_NAME, NRI_PLUGIN_IDX and
NRI_PLUGIN_SOCKET=3 as its environment and stdin/stdout on /dev/null, and waits for it to
register. The NRI of 2.1.9 then sends it Synchronize ('pre-installed NRI plugin
"40-nri-accel" synchronization success'); that of 1.7.24 never does (it synchronises
only plugins that connect to its socket). Neither kills the plugin when it stops: the
connection closes and nri-accel exits by itself; the next containerd launches a new one.
So on 1.7 a relaunched nri-accel knows what running containers hold only from its
checkpoint (<state dir>/grants.json); on 2.x the Synchronize says it too, from the grant
annotations containerd hands back.

The plugin file is a shell script that execs this virtualenv's nri-accel with the test's
flags (containerd_e2e.LaunchedPlugin): nothing is written in the real /etc or /run.
Each containerd runs under its own temporary directory, with the placeholder inventory
(an 8-GPU node whose driver files exist as empty files, so that a container starts) and
the standalone trust policy; pods ask for GPUs by count in their pod annotation.
containerd, its shims, the plugin, mounts and cgroups are removed on the way out.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from containerd_e2e import (
    DEMO_INVENTORY,
    FULL_NAME,
    GRANTED,
    PLUGIN_IDX,
    PLUGIN_NAME,
    POD_ANNOTATION,
    Assets,
    Containerd,
    CriClient,
    LaunchedPlugin,
    Runtime,
    parse_version,
    placeholder_inventory,
    runtime_problem,
    runtimes_or_skip,
    wait_for,
)

pytestmark = pytest.mark.slow

RUNTIMES = runtimes_or_skip()
ONE_GPU = {POD_ANNOTATION: "nvidia.com/gpu: 1"}  # a count: the allocator chooses
SYNCED = f'pre-installed NRI plugin "{FULL_NAME}" synchronization success'  # 2.x only
SYNCING = f"synchronizing plugin {FULL_NAME}"  # logged by both NRIs before a Synchronize
GPU_NODE = re.compile(r"/dev/nvidia[0-9]+")


@dataclass(frozen=True)
class Granted:
    """One container's GPU as containerd stored it in the OCI spec: the grant record
    annotation, the GPU device nodes, NVIDIA_VISIBLE_DEVICES."""

    record: str
    nodes: frozenset[str]
    visible: str

    @classmethod
    def of(cls, spec: dict[str, Any]) -> Granted:
        env = dict(e.partition("=")[::2] for e in spec["process"]["env"])
        nodes = frozenset(d["path"] for d in spec["linux"].get("devices", [])
                          if GPU_NODE.fullmatch(d["path"]))
        return cls(spec["annotations"].get(GRANTED, ""), nodes,
                   env.get("NVIDIA_VISIBLE_DEVICES", ""))


@dataclass(kw_only=True)
class Launched(CriClient):
    """containerd with nri-accel pre-registered, a CRI client, and the log of each launch
    (nri-accel-<name>.log under `base`)."""

    containerd: Containerd
    plugin: LaunchedPlugin
    base: Path

    @property
    def is_1x(self) -> bool:
        return self.containerd.runtime.version < (2, 0, 0)

    def diagnose(self) -> str:
        return f"{self.containerd.diagnose()}\n{self.plugin.diagnose()}"

    def launch(self, name: str) -> int:
        """Start containerd, which launches nri-accel logging to nri-accel-<name>.log;
        return once it registered (and, on 2.x, was synchronised) with containerd's log
        mark from before the start."""
        self.plugin.install(self.base / f"nri-accel-{name}.log")
        mark = self.containerd.mark()
        self.containerd.start()

        def ready() -> bool:
            if self.plugin.event("fatal_error") is not None:
                raise AssertionError(f"nri-accel failed to start\n{self.diagnose()}")
            return self.plugin.event("registered") is not None and (
                self.is_1x or SYNCED in self.containerd.messages(mark))

        wait_for(f"containerd to launch and register {FULL_NAME}", ready,
                 diagnose=self.diagnose)
        return mark

    def stop(self) -> None:
        """Stop containerd (exit 0); the plugin it launched must exit by itself."""
        assert self.plugin.pids(), f"no nri-accel runs\n{self.diagnose()}"
        assert self.containerd.stop_daemon() == 0, self.diagnose()
        wait_for("nri-accel to exit with containerd", lambda: not self.plugin.pids(),
                 diagnose=self.diagnose)

    def checkpoint(self) -> dict[str, Any]:
        return dict(json.loads((self.plugin.state_dir / "grants.json").read_text()))

    def held(self) -> dict[str, list[str]]:
        """The checkpoint's grants: container id -> device keys held exclusively."""
        return {g["container_id"]: g["exclusive"] for g in self.checkpoint()["grants"]}

    def wait_held(self, expected: dict[str, list[str]]) -> None:
        """Until the checkpoint holds `expected` (it is written after the answer, off
        the plugin's event loop)."""
        wait_for(f"the checkpoint to hold {expected}", lambda: self.held() == expected,
                 diagnose=lambda: f"checkpoint: {self.checkpoint()}\n{self.diagnose()}")

    def create_with_one_gpu(self, pod: str) -> tuple[str, str, Granted]:
        """A pod asking for one GPU by count, its container created: (sandbox id,
        container id, what the container got)."""
        sandbox_id, sandbox_config = self.run_pod(pod, ONE_GPU)
        container_id = self.create_container(sandbox_id, sandbox_config, "cuda")
        return sandbox_id, container_id, Granted.of(self.containerd.container_spec(container_id))

    def events(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.plugin.events() if e.get("event") == name]


@pytest.fixture(scope="module", params=RUNTIMES, ids=lambda r: r.id)
def launched(request: pytest.FixtureRequest, assets: Assets,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launched]:
    """containerd with nri-accel pre-registered, started once per containerd."""
    runtime: Runtime = request.param
    if problem := runtime_problem(runtime):
        pytest.fail(problem)
    base = tmp_path_factory.mktemp(f"launched-{runtime.id}")
    cgroup_parent = f"/nri-accel-e2e-{os.getpid()}-launched"
    containerd = Containerd(runtime, base / "c", assets.snapshotter, cgroup_parent)
    plugin = LaunchedPlugin(containerd.plugin_dir, placeholder_inventory(DEMO_INVENTORY, base),
                            assets.config, base / "state")
    with contextlib.ExitStack() as cleanup:  # last registered runs first, each one runs
        cleanup.callback(plugin.kill)  # whatever containerd left running
        cleanup.callback(containerd.stop)
        channel = grpc.insecure_channel(f"unix://{containerd.address}")
        cleanup.callback(channel.close)
        node = Launched(containerd=containerd, plugin=plugin, base=base, pb2=assets.pb2,
                        cri=assets.pb2_grpc.RuntimeServiceStub(channel),
                        cgroup_parent=cgroup_parent)
        node.launch("first")
        containerd.import_image(assets.image)
        cleanup.callback(node.remove_pods)
        yield node


@pytest.fixture(scope="module")
def holder(launched: Launched) -> tuple[str, Granted]:
    """A running container granted one GPU by count before any restart: its id and what
    it got. Its pod stays until the module ends."""
    _, container_id, got = launched.create_with_one_gpu("holder")
    launched.start_container(container_id)
    assert launched.containerd.task_state(container_id)["status"] == "running"
    assert got.record and len(got.nodes) == 1 and got.visible, got
    # the record, the node and the variable name the same GPU
    assert got.record == f"nvidia.com/gpu={got.visible}", got
    return container_id, got


def test_containerd_launches_the_plugin_with_fd_3_and_a_bare_environment(
        launched: Launched) -> None:
    (pid,) = launched.plugin.pids()
    environ = dict(v.partition(b"=")[::2] for v in
                   Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if v)
    # NRI's newLaunchedPlugin sets these three and nothing else (PWD is the shell's own,
    # added by the launcher script's /bin/sh)
    assert {k: v for k, v in environ.items() if k != b"PWD"} == {
        b"NRI_PLUGIN_NAME": PLUGIN_NAME.encode(), b"NRI_PLUGIN_IDX": PLUGIN_IDX.encode(),
        b"NRI_PLUGIN_SOCKET": b"3"}, environ
    fds = {fd: os.readlink(f"/proc/{pid}/fd/{fd}") for fd in (0, 1, 3)}
    assert fds[0] == fds[1] == "/dev/null", fds
    assert fds[3].startswith("socket:"), fds
    msgs = launched.containerd.messages()
    assert f"discovered plugin {FULL_NAME}" in msgs
    assert [m for m in msgs if re.fullmatch(
        rf'plugin "pre-connected:{FULL_NAME}\[\d+\]" registered as "{FULL_NAME}"', m)], msgs
    starting = launched.plugin.event("plugin_starting")
    assert starting is not None, launched.diagnose()
    # its name and index came from containerd's environment: no flag names them
    assert (starting["mode"], starting["socket"], starting["plugin"]) == (
        "pre-registered", "fd 3", FULL_NAME)
    registered = launched.plugin.event("registered")
    assert registered is not None
    assert parse_version(registered["runtime_version"]) == launched.containerd.runtime.version
    # the checkpoint is written before the plugin serves: nothing held, state known
    assert launched.checkpoint()["grants"] == [] and launched.checkpoint()["known"] is True
    if not launched.is_1x:
        (synchronized,) = launched.events("synchronized")
        assert (synchronized["pods"], synchronized["containers"]) == (0, 0)


def test_a_count_never_takes_the_gpu_held_across_a_containerd_restart(
        launched: Launched, holder: tuple[str, Granted]) -> None:
    """The holder keeps running while containerd restarts and launches a new nri-accel;
    a pod asking for one GPU by count then gets another GPU. On 1.7 only the checkpoint
    can tell the new plugin (no Synchronize comes); on 2.x the Synchronize restores the
    same grant from the holder's annotation, and both agree."""
    holder_id, held = holder
    key = held.record
    launched.wait_held({holder_id: [key]})
    launched.stop()
    # nri-accel saw the connection close and stopped cleanly (containerd did not kill it)
    assert [e["event"] for e in launched.plugin.events()][-2:] == [
        "runtime_disconnected", "plugin_stopped"], launched.diagnose()
    mark = launched.launch("restarted")
    assert launched.containerd.task_state(holder_id)["status"] == "running"

    (loaded,) = launched.events("checkpoint_loaded")
    assert (loaded["grants"], loaded["known"]) == (1, True), loaded
    (allocations,) = launched.events("allocations_loaded")
    assert (allocations["containers"], allocations["held"]) == (1, 1), allocations

    sandbox_id, container_id, got = launched.create_with_one_gpu("after-restart")
    assert got.record and got.record != key, (got, held)
    assert got.nodes and not got.nodes & held.nodes, (got, held)
    assert got.visible != held.visible
    created = launched.events("container_created")
    assert [c["pod"] for c in created] == ["after-restart"], created
    launched.wait_held({holder_id: [key], container_id: [got.record]})

    synchronized = launched.events("synchronized")
    if launched.is_1x:
        # observed on 1.7.24: no Synchronize, before or after the create
        assert synchronized == [], synchronized
        assert SYNCING not in launched.containerd.messages(mark)
    else:
        assert [(s["pods"], s["containers"]) for s in synchronized] == [(1, 1)]
        (restored,) = launched.events("allocations_restored")
        assert (restored["containers"], restored["held"]) == (1, 1), restored
    launched.remove_pod(sandbox_id)
    launched.wait_held({holder_id: [key]})


def test_without_its_checkpoint_only_a_synchronize_knows_the_held_gpu(
        launched: Launched, holder: tuple[str, Granted]) -> None:
    """The control case: the state directory is deleted while containerd is down and the
    holder runs. A missing checkpoint means "nothing was granted on this boot"
    (nri_accel.state): true of a state directory on /run, which only a reboot empties,
    with the containers it describes. Deleted by hand, it is false: on 1.7, where no
    Synchronize comes, a count then takes the holder's GPU (this test shows it, and so
    that the checkpoint is what prevents it in the test above); on 2.x the Synchronize
    restores the grant from the holder's annotation and the count gets another GPU."""
    _, held = holder
    launched.stop()
    shutil.rmtree(launched.plugin.state_dir)
    launched.launch("no-checkpoint")
    assert launched.events("checkpoint_absent"), launched.diagnose()
    sandbox_id, _, got = launched.create_with_one_gpu("no-checkpoint")
    if launched.is_1x:
        assert got == held, "1.7 sent a Synchronize, or the allocator changed its choice"
    else:
        (restored,) = launched.events("allocations_restored")
        assert (restored["containers"], restored["held"]) == (1, 1), restored
        assert got.record != held.record and not got.nodes & held.nodes, (got, held)
    launched.remove_pod(sandbox_id)


def test_an_unreadable_checkpoint_refuses_counts_until_a_synchronize(
        launched: Launched, holder: tuple[str, Granted]) -> None:
    """grants.json is garbage when containerd starts: the relaunched plugin does not
    know what runs and refuses counts (UNAVAILABLE) rather than guess. On 1.7 that lasts:
    the unknown state is checkpointed, and the next restart still refuses (nri-accel used
    to write "nothing held" over the unreadable file, and that restart then gave the
    holder's GPU away). On 2.x the Synchronize makes the state known and the count gets
    another GPU."""
    _, held = holder
    launched.stop()
    (launched.plugin.state_dir / "grants.json").write_text("{garbage")
    launched.launch("unreadable")
    assert launched.events("checkpoint_unreadable"), launched.diagnose()
    if not launched.is_1x:
        sandbox_id, _, got = launched.create_with_one_gpu("after-synchronize")
        assert got.record != held.record and not got.nodes & held.nodes, (got, held)
        wait_for("the checkpoint to say the state is known",
                 lambda: launched.checkpoint()["known"] is True, diagnose=launched.diagnose)
        launched.remove_pod(sandbox_id)
        return

    def count_refused(pod: str) -> None:
        sandbox_id, sandbox_config = launched.run_pod(pod, ONE_GPU)
        with pytest.raises(grpc.RpcError) as refused:
            launched.create_container(sandbox_id, sandbox_config, "cuda")
        details = refused.value.details()
        assert "code = Unavailable" in details, details
        assert POD_ANNOTATION in details and "is not known" in details, details
        launched.remove_pod(sandbox_id)

    count_refused("refused")
    assert launched.checkpoint()["known"] is False
    launched.stop()
    launched.launch("still-unknown")
    (loaded,) = launched.events("checkpoint_loaded")
    assert (loaded["known"], loaded["grants"]) == (False, 0), loaded
    count_refused("refused-again")
