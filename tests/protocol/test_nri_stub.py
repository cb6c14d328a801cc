"""The plugin stub, in-process, against the runtime simulator over a real unix socket."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import socket
import time
from collections.abc import AsyncIterator, Generator
from typing import Any

import pytest
import structlog.testing

from nri_accel.errors import ConfigError, PolicyError, RequestError, StateError
from nri_accel.inventory import ContainerEdits, DeviceNode
from nri_accel.nri import adjust, fields
from nri_accel.nri import nri_pb2 as pb
from nri_accel.nri import stub as stub_module
from nri_accel.nri.simulator import (
    LEGACY_EVENTS,
    PluginError,
    Simulator,
    SimulatorError,
    make_container,
    make_pod,
    sync_fields,
)
from nri_accel.nri.stub import (
    BACKOFF_MAX,
    LINGER,
    NOTIFICATIONS,
    SYNC_SLICE,
    VALID_EVENTS,
    Identity,
    Stub,
    StubConfigError,
    _created,
    backoff_delays,
    event_bit,
    resolve_identity,
)
from nri_accel.ttrpc import MAX_MESSAGE_SIZE, Code

POD = make_pod({"name": "pod0", "namespace": "ml"})
CTR = make_container(POD, {"name": "train", "env": ["PATH=/bin"]})


class Injector:
    """Stands in for a device plugin: CreateContainer adds /dev/accel0 unless the pod
    is named "refuse-me", which it refuses the way the Engine refuses a request."""

    def __init__(self) -> None:
        self.synced: list[tuple[int, int]] = []
        self.released: list[str] = []

    def synchronize(self, pods: list[Any], containers: list[Any]) -> None:
        self.synced.append((len(pods), len(containers)))

    def create_container(self, pod: Any, container: Any) -> Any:
        if pod.name == "refuse-me":
            raise RequestError("unknown device \"acme.example/npu=9\"",
                               source="annotation devices.nri-accel.io/pod")
        return adjust.build_adjustment(
            ContainerEdits(device_nodes=(DeviceNode("/dev/accel0", 240, 0),)),
            {"granted": container.name})

    def stop_container(self, pod: Any, container: Any) -> None:
        self.released.append(container.name)


@contextlib.asynccontextmanager
async def serving(plugin: object, sock_path: str, **sim_options: Any
                  ) -> AsyncIterator[tuple[Simulator, Stub]]:
    """A simulator on `sock_path` and an external-mode stub connected to it."""
    async with Simulator(sock_path, **sim_options) as sim:
        stub = Stub(plugin, Identity("injector", "30"), socket_path=sock_path)
        task = asyncio.get_running_loop().create_task(stub.run())
        try:
            yield sim, stub
        finally:
            stub.stop()
            assert await asyncio.wait_for(task, 10) == 0


# ---- identity and event mask (no socket) -------------------------------------------

def test_identity_precedence_flags_env_argv0_defaults() -> None:
    env = {"NRI_PLUGIN_NAME": "from-env", "NRI_PLUGIN_IDX": "20"}
    assert resolve_identity("flag", "05", env=env, argv0="/x/10-argv") == Identity("flag", "05")
    assert resolve_identity(env=env, argv0="/x/10-argv") == Identity("from-env", "20")
    assert resolve_identity(env={}, argv0="/opt/nri/plugins/10-argv") == Identity("argv", "10")
    assert resolve_identity(env={}, argv0="nri-accel", default_name="nri-accel",
                            default_idx="40") == Identity("nri-accel", "40")
    assert resolve_identity(idx="07", env={}, argv0="/x/10-argv") == Identity("argv", "07")


@pytest.mark.parametrize("kwargs, source", [
    ({"name": "bad name", "idx": "10"}, "--name"),
    ({"name": "ok", "idx": "100"}, "--idx"),
    ({"env": {"NRI_PLUGIN_NAME": "x", "NRI_PLUGIN_IDX": "a1"}}, "NRI_PLUGIN_IDX"),
    # a value written with echo, or a YAML block scalar: the runtime refuses it
    # (pkg/api/plugin.go: two digits; a name of [a-zA-Z0-9_.+-])
    ({"env": {"NRI_PLUGIN_NAME": "x", "NRI_PLUGIN_IDX": "40\n"}}, "NRI_PLUGIN_IDX"),
    ({"env": {"NRI_PLUGIN_NAME": "x\n", "NRI_PLUGIN_IDX": "40"}}, "NRI_PLUGIN_NAME"),
    ({"env": {}}, "nri.name"),
])
def test_invalid_identity_names_its_source(kwargs: dict[str, Any], source: str) -> None:
    kwargs.setdefault("env", {})
    with pytest.raises(StubConfigError) as info:
        resolve_identity(argv0="nri-accel", **kwargs)
    assert info.value.source == source


def test_event_mask_follows_the_handlers_and_is_never_zero() -> None:
    assert Stub(Injector(), Identity("i", "30")).handled_events == (
        event_bit(pb.CREATE_CONTAINER) | event_bit(pb.STOP_CONTAINER))

    class Watcher:
        """A plugin that only watches pod and container notifications."""

        def state_change(self, event: int, pod: Any, container: Any) -> None: ...

    mask = Stub(Watcher(), Identity("w", "30")).handled_events
    assert mask == sum(event_bit(e) for e in NOTIFICATIONS)
    assert not mask & event_bit(pb.CREATE_CONTAINER)

    class Nothing:
        """A plugin with no event handler at all (a programming error)."""

        def synchronize(self, pods: Any, containers: Any) -> None: ...

    with pytest.raises(StubConfigError, match="no event handler"):
        Stub(Nothing(), Identity("n", "30"))


def test_reconnect_backoff_doubles_and_stays_within_a_second() -> None:
    delays = list(itertools.islice(backoff_delays(), 12))
    assert delays[:3] == [0.05, 0.1, 0.2]
    assert max(delays) == BACKOFF_MAX <= 1.0 and delays[-1] == BACKOFF_MAX


def test_inherited_fd_comes_from_the_environment() -> None:
    assert Stub.inherited_fd({}) is None
    plugin_end, runtime_end = socket.socketpair()  # what the runtime hands over
    with plugin_end, runtime_end:
        fd = plugin_end.fileno()
        assert Stub.inherited_fd({"NRI_PLUGIN_SOCKET": str(fd)}) == fd
        plugin_end.sendall(b"still open")  # the check leaves the connection as it was
        assert runtime_end.recv(16) == b"still open"
    with pytest.raises(StubConfigError, match="NRI_PLUGIN_SOCKET"):
        Stub.inherited_fd({"NRI_PLUGIN_SOCKET": "three"})


@contextlib.contextmanager
def _fd_of(kind: str, tmp_path: Any) -> Any:
    """An open fd that is not the runtime's connection, of the given kind."""
    with contextlib.ExitStack() as stack:
        if kind == "closed":
            r, w = os.pipe()
            os.close(r)
            os.close(w)
            yield r
        elif kind == "file":
            f = stack.enter_context(open(tmp_path / "f", "wb"))
            yield f.fileno()
        elif kind == "pipe":
            r, w = os.pipe()
            stack.callback(os.close, r)
            stack.callback(os.close, w)
            yield r
        else:
            family, type_ = ((socket.AF_INET, socket.SOCK_DGRAM) if kind == "udp"
                             else (socket.AF_UNIX, socket.SOCK_STREAM))
            s = stack.enter_context(socket.socket(family, type_))
            if kind == "listening":
                s.bind(str(tmp_path / "l.sock"))
                s.listen()
            yield s.fileno()


@pytest.mark.parametrize(("kind", "why"), [
    ("closed", "is not open (Bad file descriptor)"),
    ("file", "is a regular file, not a socket"),
    ("pipe", "is a pipe (FIFO), not a socket"),
    ("udp", "is a AF_INET SOCK_DGRAM socket, not a unix stream socket"),
    ("listening", "is a listening socket, not a connection"),
    ("unconnected", "is a unix socket that is not connected"),
])
def test_an_inherited_fd_that_is_not_a_connection_is_a_config_error(kind, why, tmp_path):
    # NRI_PLUGIN_SOCKET=0 (stdin) or a closed fd once ended in an OSError traceback
    # ("Socket operation on non-socket", "Bad file descriptor") out of run().
    with _fd_of(kind, tmp_path) as fd:
        with pytest.raises(ConfigError) as info:
            Stub.inherited_fd({"NRI_PLUGIN_SOCKET": str(fd)})
        if kind != "closed":
            os.fstat(fd)  # still open: the check closes nothing
    assert info.value.source == "NRI_PLUGIN_SOCKET"
    assert str(info.value).startswith(f"NRI_PLUGIN_SOCKET: fd {fd} {why}")
    assert isinstance(info.value, StubConfigError)


async def test_one_runtime_unavailable_line_per_outage_whatever_the_error(
        sock_path: str, all_logs: None) -> None:
    # Something on the socket that is not a runtime: a listener that accepts and closes
    # each connection fails the retries with "Broken pipe" or "Connection reset" by
    # turns, and each change of text once made a new warning line. Here every other
    # connection gets bytes that are not NRI, so the text changes at every retry.
    accepted = 0

    async def close_at_once(reader: Any, writer: Any) -> None:
        nonlocal accepted
        accepted += 1
        if accepted % 2:
            writer.write(b"\xff" * 64)
            await writer.drain()
        writer.close()

    server = await asyncio.start_unix_server(close_at_once, sock_path)
    async with server:
        stub = Stub(Injector(), Identity("injector", "30"), socket_path=sock_path)
        with structlog.testing.capture_logs() as logs:
            task = asyncio.get_running_loop().create_task(stub.run())
            deadline = time.monotonic() + 10
            while accepted < 6 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            stub.stop()
            assert await asyncio.wait_for(task, 10) == 0
    assert accepted >= 6
    warnings = [e for e in logs if e["event"] == "runtime_unavailable"]
    assert len(warnings) == 1, warnings
    # the bytes that are not NRI: said in those lines, not once more a retry at error level
    assert [e for e in logs if e["log_level"] in ("warning", "error")] == warnings
    retries = [e["error"] for e in logs if e["event"] == "runtime_still_unavailable"]
    assert len(retries) >= 4 and len({warnings[0]["error"], *retries}) >= 2


# ---- against the simulator -------------------------------------------------------------

async def test_registers_configures_and_answers_create_container(sock_path: str) -> None:
    plugin = Injector()
    async with serving(plugin, sock_path, runtime_name="containerd",
                       runtime_version="v2.3.4") as (sim, stub):
        conn = await sim.wait_for_plugin("injector")
        assert (conn.idx, conn.nri_version) == ("30", "v0.12.0")
        assert conn.events == stub.handled_events != 0
        assert (stub.runtime.name, stub.runtime.version) == ("containerd", "v2.3.4")
        assert (stub.runtime.request_timeout, stub.runtime.registration_timeout) == (2.0, 5.0)
        assert plugin.synced == [(0, 0)]
        rsp = await sim.create_container(POD, CTR)
        assert [d.path for d in rsp.adjust.linux.devices] == ["/dev/accel0"]
        assert dict(rsp.adjust.annotations) == {"granted": "train"}
        await sim.stop_container(POD, CTR)
        assert plugin.released == ["train"]


class AnswersAtAGlance(Injector):
    """A plugin whose CreateContainer decoder answers a container named "quick" itself
    (as nri.convert.glance_decoder answers one that asks for nothing): the bytes it
    returns are the response, and create_container is not called for it."""

    def __init__(self) -> None:
        super().__init__()
        self.created: list[str] = []
        self.request_decoders = {"CreateContainer": self._decode}

    @staticmethod
    def _decode(payload: bytes) -> Any:
        req = pb.CreateContainerRequest.FromString(payload)
        if req.container.name != "quick":
            return req
        rsp = pb.CreateContainerResponse(adjust=pb.ContainerAdjustment(
            annotations={"answered": "at a glance"}))
        return rsp.SerializeToString()

    def create_container(self, pod: Any, container: Any) -> Any:
        self.created.append(container.name)
        return super().create_container(pod, container)


async def test_a_create_container_decoder_may_answer_the_request_itself(
        sock_path: str) -> None:
    plugin = AnswersAtAGlance()
    async with serving(plugin, sock_path) as (sim, _):
        await sim.wait_for_plugin("injector")
        quick = await sim.create_container(POD, make_container(POD, {"name": "quick"}))
        assert dict(quick.adjust.annotations) == {"answered": "at a glance"}
        assert not quick.adjust.linux.devices
        rsp = await sim.create_container(POD, CTR)
        assert [d.path for d in rsp.adjust.linux.devices] == ["/dev/accel0"]
    assert plugin.created == ["train"]


async def test_configure_may_arrive_before_the_register_answer(sock_path: str) -> None:
    async with serving(Injector(), sock_path, configure_first=True) as (sim, stub):
        await sim.wait_for_plugin()
        await asyncio.wait_for(stub.registered.wait(), 5)
        assert (await sim.create_container(POD, CTR)).adjust.linux.devices


async def test_a_refusal_fails_that_container_with_its_message_and_serving_goes_on(
    sock_path: str,
) -> None:
    async with serving(Injector(), sock_path) as (sim, _):
        await sim.wait_for_plugin()
        refused = make_pod({"name": "refuse-me"})
        with pytest.raises(PluginError) as info:
            await sim.create_container(refused, make_container(refused, {"name": "c"}))
        assert info.value.message == ("annotation devices.nri-accel.io/pod: "
                                      "unknown device \"acme.example/npu=9\"")
        assert info.value.code == Code.INVALID_ARGUMENT  # a malformed request
        assert (await sim.create_container(POD, CTR)).adjust.linux.devices
        assert sim.dropped == []


async def test_a_policy_refusal_says_permission_denied(sock_path: str) -> None:
    class Strict:
        """A plugin whose CreateContainer refuses like the trust policy does."""

        def create_container(self, pod: Any, container: Any) -> Any:
            raise PolicyError("pod annotations may not grant devices in namespace 'x'",
                              source="annotation devices.nri-accel.io/pod")

    async with serving(Strict(), sock_path) as (sim, _):
        await sim.wait_for_plugin()
        with pytest.raises(PluginError) as info:
            await sim.create_container(POD, CTR)
        assert info.value.code == Code.PERMISSION_DENIED
        assert info.value.message.startswith("annotation devices.nri-accel.io/pod: ")


async def test_an_unavailable_answer_fails_the_container_and_keeps_the_plugin(
        sock_path: str) -> None:
    # containerd's NRI closes a plugin on a transport failure or a missed deadline only:
    # an error the plugin answers with, UNAVAILABLE included (nri-accel's while the
    # state is unknown), fails that container; the simulator does as containerd does
    class Unsure:
        def create_container(self, pod: Any, container: Any) -> Any:
            if pod.name == "unsure":
                raise StateError("not known", source="container")
            return pb.ContainerAdjustment(annotations={"granted.example/x": "1"})

    async with serving(Unsure(), sock_path) as (sim, _):
        await sim.wait_for_plugin()
        unsure = make_pod({"name": "unsure"})
        with pytest.raises(PluginError) as info:
            await sim.create_container(unsure, make_container(unsure, {"name": "c"}))
        assert info.value.code == Code.UNAVAILABLE
        assert sim.dropped == []
        # and what the plugin's adjustment annotates is the container's from then on,
        # as containerd lists it in a later Synchronize
        await sim.create_container(POD, CTR)
        assert sim.containers[CTR.id].annotations["granted.example/x"] == "1"


async def test_a_bug_in_a_handler_is_an_error_answer_not_a_crash(sock_path: str) -> None:
    class Buggy:
        """A plugin whose CreateContainer has a bug (KeyError)."""

        def create_container(self, pod: Any, container: Any) -> Any:
            return {}["missing"]

    async with serving(Buggy(), sock_path) as (sim, stub):
        await sim.wait_for_plugin()
        for _ in range(2):
            with pytest.raises(PluginError, match="'missing'"):
                await sim.create_container(POD, CTR)
        assert stub.registrations == 1


async def test_a_plain_handler_runs_on_the_read_callback_and_an_async_one_in_a_task(
    sock_path: str,
) -> None:
    tasks: list[asyncio.Task[Any] | None] = []

    class Plain(Injector):
        """Injector that notes the task its CreateContainer runs in."""

        def create_container(self, pod: Any, container: Any) -> Any:
            tasks.append(asyncio.current_task())
            return super().create_container(pod, container)

    class Async(Plain):
        """The same, with an async CreateContainer."""

        async def create_container(self, pod: Any, container: Any) -> Any:  # type: ignore[override]
            await asyncio.sleep(0)
            return super().create_container(pod, container)

    for plugin in (Plain(), Async()):
        async with serving(plugin, sock_path) as (sim, _):
            await sim.wait_for_plugin()
            rsp = await sim.create_container(POD, CTR)
            assert [d.path for d in rsp.adjust.linux.devices] == ["/dev/accel0"]
    plain_task, async_task = tasks
    assert plain_task is None  # answered inline, as the request was read
    assert async_task is not None


async def test_state_change_stands_in_for_notifications_old_and_new(sock_path: str) -> None:
    seen: list[tuple[int, str, str]] = []

    class Watcher:
        """A plugin that watches notifications and takes part in creation."""

        def state_change(self, event: int, pod: Any, container: Any) -> None:
            seen.append((event, pod.name, container.name if container else ""))

        def create_container(self, pod: Any, container: Any) -> None:
            return None

    async with serving(Watcher(), sock_path) as (sim, _):
        await sim.wait_for_plugin()
        await sim.run_pod_sandbox(POD)
        assert (await sim.create_container(POD, CTR)) == pb.CreateContainerResponse()
        await sim.start_container(POD, CTR)
        await sim.state_change(pb.POST_START_CONTAINER, POD, CTR)
        await sim.state_change(pb.REMOVE_POD_SANDBOX, POD)
    assert seen == [(pb.RUN_POD_SANDBOX, "pod0", ""), (pb.START_CONTAINER, "pod0", "train"),
                    (pb.POST_START_CONTAINER, "pod0", "train"),
                    (pb.REMOVE_POD_SANDBOX, "pod0", "")]


async def test_configure_may_narrow_the_subscription_but_not_widen_it(sock_path: str) -> None:
    class Narrow(Injector):
        """A plugin that subscribes to fewer events than it handles."""

        def configure(self, config: str, runtime: str, version: str) -> int:
            return event_bit(pb.CREATE_CONTAINER)

    async with serving(Narrow(), sock_path) as (sim, _):
        conn = await sim.wait_for_plugin()
        assert conn.events == event_bit(pb.CREATE_CONTAINER)

    class Greedy(Injector):
        """A plugin that asks for events it has no handler for."""

        def configure(self, config: str, runtime: str, version: str) -> int:
            return VALID_EVENTS

    async with serving(Greedy(), sock_path) as (sim, stub):
        await sim.wait_for(lambda s: bool(s.dropped), 5)
        assert "does not handle" in sim.dropped[0][1]
        assert not stub.registered.is_set()


async def test_a_runtime_refuses_a_subscription_to_events_it_does_not_know(
    sock_path: str,
) -> None:
    class Watcher(Injector):
        """A plugin whose state_change stands in for every notification, the pod-update
        one included, which containerd 1.7's NRI does not know."""

        def state_change(self, event: int, pod: Any, container: Any) -> None:
            pass

    async with serving(Injector(), sock_path, known_events=LEGACY_EVENTS) as (sim, _):
        conn = await sim.wait_for_plugin()
        assert conn.events == event_bit(pb.CREATE_CONTAINER) | event_bit(pb.STOP_CONTAINER)
    async with serving(Watcher(), sock_path, known_events=LEGACY_EVENTS) as (sim, _):
        await sim.wait_for(lambda s: bool(s.dropped), 5)
    unknown = event_bit(pb.POST_UPDATE_POD_SANDBOX)
    assert sim.dropped[0] == ("30-injector", f"invalid plugin events: 0x{unknown:x}")


async def test_two_plugins_adding_one_device_fail_the_container_with_the_runtimes_words(
    sock_path: str,
) -> None:
    class DeviceOnly:
        """A device plugin that adds /dev/accel0 and nothing else."""

        def create_container(self, pod: Any, container: Any) -> Any:
            return adjust.build_adjustment(
                ContainerEdits(device_nodes=(DeviceNode("/dev/accel0", 240, 0),)))

    async with Simulator(sock_path) as sim:
        stubs = [Stub(DeviceOnly(), Identity(name, idx), socket_path=sock_path)
                 for name, idx in (("second", "20"), ("first", "10"))]
        tasks = [asyncio.get_running_loop().create_task(s.run()) for s in stubs]
        await sim.wait_for(lambda s: len(s.plugins) == 2, 5)
        with pytest.raises(SimulatorError) as info:
            await sim.create_container(POD, CTR)
        for stub in stubs:
            stub.stop()
        assert await asyncio.gather(*tasks) == [0, 0]
    # pkg/api FieldOwners.Conflict: the later plugin (by index), the owner, Field, key
    assert str(info.value) == (
        'plugins "20-second" and "10-first" both tried to set Devices /dev/accel0')


def _big_state(sim: Simulator, containers: int, env: int = 40) -> None:
    """One pod and `containers` running containers of ~4 KiB each (`env` entries of
    ~100 bytes), as CRI's are."""
    pod = make_pod({"name": "sync", "annotations": {"filler": "x" * 1000}})
    sim.pods[pod.id] = pod
    template = make_container(pod, {"name": "c", "state": "CONTAINER_RUNNING",
                                    "env": [f"VAR{j}=value-{j}-{'y' * 80}" for j in range(env)]})
    for i in range(containers):
        ctr = pb.Container()
        ctr.CopyFrom(template)
        ctr.id, ctr.name = f"{i:064x}", f"c{i}"
        sim.containers[ctr.id] = ctr


async def test_split_synchronisation_is_collected_and_delivered_once(sock_path: str) -> None:
    plugin = Injector()
    async with Simulator(sock_path) as sim:
        _big_state(sim, 1500)
        size = pb.SynchronizeRequest(pods=sim.pods.values(),
                                     containers=sim.containers.values()).ByteSize()
        assert size > MAX_MESSAGE_SIZE
        stub = Stub(plugin, Identity("injector", "30"), socket_path=sock_path)
        task = asyncio.get_running_loop().create_task(stub.run())
        await sim.wait_for_plugin()
        stub.stop()
        await task
    assert sim.sync_splits >= 1
    assert plugin.synced[-1] == (1, 1500)


@pytest.mark.parametrize("returns", [None, []], ids=["None", "no updates"])
def test_the_last_synchronize_part_is_logged_with_the_runtimes_counts(returns: Any,
                                                                    all_logs: None) -> None:
    # the "synchronized" line comes with the answer to the last part, whatever a plain
    # synchronize() returns (None, most of them: nri-accel check's probe)
    class Plain:
        def synchronize(self, pods: list[Any], containers: list[Any]) -> Any:
            return returns

        def start_container(self, pod: Any, container: Any) -> None:
            pass

    stub = Stub(Plain(), Identity("plain", "31"), socket_path="/nonexistent")
    part = pb.SynchronizeRequest(pods=[pb.PodSandbox(id="p")],
                                 containers=[pb.Container(id="c1"), pb.Container(id="c2")])
    with structlog.testing.capture_logs() as logs:
        answer = stub._synchronize(None, part.SerializeToString())
    assert answer == b""
    assert [(e["event"], e["pods"], e["containers"]) for e in logs
            if e["event"] == "synchronized"] == [("synchronized", 1, 2)]


async def test_a_split_synchronisation_delivers_the_runtime_state_field_for_field(
    sock_path: str,
) -> None:
    # The simulator encodes each pod and container once and joins the chunks from those
    # bytes: what the plugin decodes must still be the runtime's messages, unchanged.
    class Recorder(Injector):
        def synchronize(self, pods: list[Any], containers: list[Any]) -> None:
            self.got = (list(pods), list(containers))

    plugin = Recorder()
    async with serving(plugin, sock_path) as (sim, _):
        _big_state(sim, 1500)
        second = make_pod({"name": "second", "namespace": "other"})
        sim.pods[second.id] = second
        await sim.wait_for_plugin()
    assert sim.sync_splits >= 1
    assert plugin.got == (list(sim.pods.values()), list(sim.containers.values()))


async def test_a_split_synchronisation_hands_over_what_keep_synchronized_kept_of_each_part(
    sock_path: str,
) -> None:
    class Keeper(Injector):
        """Keeps only the ids of each part, and counts the parts."""

        def __init__(self) -> None:
            super().__init__()
            self.parts = 0
            self.got: tuple[list[Any], list[Any]] = ([], [])

        def keep_synchronized(self, pods: Any, containers: Any) -> tuple[list[Any], list[Any]]:
            self.parts += 1
            return [p.id for p in pods], [c.id for c in containers]

        def synchronize(self, pods: list[Any], containers: list[Any]) -> None:
            self.got = (pods, containers)

    plugin = Keeper()
    async with serving(plugin, sock_path) as (sim, _):
        _big_state(sim, 1500)
        await sim.wait_for_plugin()
    assert sim.sync_splits >= 1 and plugin.parts > 1
    assert plugin.got == (list(sim.pods), list(sim.containers))


class _Turns:
    """The event loop's turns while entered, counted by a task that yields each turn."""

    def __init__(self) -> None:
        self.count = 0
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> _Turns:
        async def count() -> None:
            while True:
                self.count += 1
                await asyncio.sleep(0)

        self._task = asyncio.get_running_loop().create_task(count())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()


async def _synchronize_big_state(plugin: Any, sock_path: str, containers: int,
                                 env: int = 40) -> int:
    """`plugin` registered with a runtime holding _big_state(containers, env), until
    synced; the bytes of a container's field in the Synchronize."""
    async with serving(plugin, sock_path) as (sim, _):
        _big_state(sim, containers, env)
        await sim.wait_for_plugin()
        return len(sync_fields((), list(sim.containers.values())[:1])[1][0])


@pytest.mark.parametrize("env", [40, 0], ids=["4 KiB containers", "small containers"])
async def test_keep_synchronized_takes_a_slice_at_a_time_and_the_loop_turns_between(
    sock_path: str, env: int,
) -> None:
    turns = _Turns()

    class Slices(Injector):
        """Notes each keep_synchronized() call: its size and the loop turns so far."""

        def __init__(self) -> None:
            super().__init__()
            self.calls: list[tuple[int, int]] = []

        def keep_synchronized(self, pods: Any, containers: Any) -> tuple[list[Any], list[Any]]:
            self.calls.append((len(pods) + len(containers), turns.count))
            return [p.id for p in pods], [c.id for c in containers]

    plugin = Slices()
    async with turns:
        field = await _synchronize_big_state(plugin, sock_path, 1500, env)
    sizes = [size for size, _ in plugin.calls]
    # a part is decoded a run of fields at a time (the field reaching RUN_BYTES ends
    # one), and a run's containers are handed over SYNC_SLICE at a time
    per_run = min(-(-fields.RUN_BYTES // field), fields.RUN_FIELDS)
    assert sum(sizes) == 1501 and max(sizes) == min(SYNC_SLICE, per_run)
    assert max(sizes) == (33 if env else SYNC_SLICE)
    seen = [at for _, at in plugin.calls]
    assert all(a < b for a, b in itertools.pairwise(seen))  # the loop ran between any two
    assert plugin.synced == [(1, 1500)]


async def test_a_keep_synchronized_of_steps_is_run_a_step_per_loop_turn(
    sock_path: str,
) -> None:
    turns = _Turns()

    class Steps(Injector):
        """keep_synchronized() as a generator of three steps (as nri.convert.synced()
        reads a huge container): notes the loop turns at each step."""

        def __init__(self) -> None:
            super().__init__()
            self.steps: list[int] = []

        def keep_synchronized(self, pods: Any, containers: Any,
                              ) -> Generator[None, None, tuple[list[Any], list[Any]]]:
            for _ in range(3):
                self.steps.append(turns.count)
                yield
            return [p.id for p in pods], [c.id for c in containers]

    plugin = Steps()
    async with turns:
        await _synchronize_big_state(plugin, sock_path, 600, env=0)  # one run of fields
    slices = 1 + -(-600 // SYNC_SLICE)  # the pod, then the containers SYNC_SLICE at a time
    assert len(plugin.steps) == 3 * slices
    assert all(a < b for a, b in itertools.pairwise(plugin.steps))  # the loop ran between
    assert plugin.synced == [(1, 600)]  # what the generators returned was kept


async def test_a_plugin_without_synchronize_still_passes_split_synchronisation(
    sock_path: str,
) -> None:
    class CreateOnly:
        """A plugin with no synchronize handler."""

        def create_container(self, pod: Any, container: Any) -> None:
            return None

    async with Simulator(sock_path) as sim:
        _big_state(sim, 1500)
        stub = Stub(CreateOnly(), Identity("create-only", "30"), socket_path=sock_path)
        task = asyncio.get_running_loop().create_task(stub.run())
        await sim.wait_for_plugin()
        assert sim.sync_splits >= 1 and sim.dropped == []
        stub.stop()
        await task


async def test_runtime_restart_means_reconnect_and_register_again(sock_path: str) -> None:
    plugin = Injector()
    stub = Stub(plugin, Identity("injector", "30"), socket_path=sock_path)
    task = asyncio.get_running_loop().create_task(stub.run())  # runtime not there yet
    await asyncio.sleep(0.2)
    for round_ in range(2):
        async with Simulator(sock_path) as sim:
            await sim.wait_for_plugin(timeout=5)
            assert (await sim.create_container(POD, CTR)).adjust.linux.devices
        assert stub.registrations == round_ + 1
    stub.stop()
    assert await asyncio.wait_for(task, 5) == 0
    assert plugin.synced == [(0, 0), (0, 0)]


async def test_a_handler_too_slow_for_the_runtime_gets_dropped_and_comes_back(
    sock_path: str,
) -> None:
    class Slow(Injector):
        """A plugin whose first CreateContainer outlasts the runtime's timeout."""

        slow = True

        async def create_container(self, pod: Any, container: Any) -> Any:
            if self.slow:
                self.slow = False
                await asyncio.sleep(5)
            return super().create_container(pod, container)

    async with serving(Slow(), sock_path, request_timeout=0.3) as (sim, stub):
        first = await sim.wait_for_plugin()
        assert (await sim.create_container(POD, CTR)) == pb.CreateContainerResponse()
        assert "CreateContainer" in sim.dropped[0][1]  # dropped; the event went on without it
        again = await sim.wait_for_plugin(after=first, timeout=5)
        assert again is not first and stub.registrations == 2
        assert (await sim.create_container(POD, CTR)).adjust.linux.devices


async def test_shutdown_reaches_the_plugin(sock_path: str) -> None:
    class Graceful(Injector):
        """A plugin that wants to hear about the runtime shutting down."""

        down = False

        def shutdown(self) -> None:
            self.down = True

    plugin = Graceful()
    async with serving(plugin, sock_path) as (sim, _):
        await sim.wait_for_plugin()
        await sim.shutdown()
    assert plugin.down


class StoppedWhileAnswering(Injector):
    """A plugin whose process is told to stop (SIGTERM) as it makes an answer: stop()
    comes before the answer is written."""

    stub: Stub | None = None

    def serve(self, sock_path: str) -> asyncio.Task[int]:
        """Its stub, running against the runtime at `sock_path`."""
        self.stub = Stub(self, Identity("injector", "30"), socket_path=sock_path)
        return asyncio.get_running_loop().create_task(self.stub.run())

    def create_container(self, pod: Any, container: Any) -> Any:
        assert self.stub is not None
        self.stub.stop()
        return super().create_container(pod, container)


async def test_a_stopping_plugin_leaves_the_runtime_time_to_read_its_last_answer(
    sock_path: str,
) -> None:
    # containerd's multiplexer may act on the close before an answer it has already
    # received (stub.LINGER): the plugin keeps the socket open LINGER after writing.
    plugin = StoppedWhileAnswering()
    async with Simulator(sock_path) as sim:
        task = plugin.serve(sock_path)
        conn = await sim.wait_for_plugin()
        asked = time.monotonic()
        rsp = await sim.create_container(POD, CTR)
        assert [d.path for d in rsp.adjust.linux.devices] == ["/dev/accel0"]
        await asyncio.wait_for(conn.mux.lost, 5)
        stayed = time.monotonic() - asked
        assert await asyncio.wait_for(task, 5) == 0
    assert stayed >= 0.9 * LINGER, stayed  # the answer was written after `asked`


async def test_a_stopping_plugin_closes_when_the_runtime_does_not_waiting_out_its_linger(
    sock_path: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(stub_module, "LINGER", 30.0)
    plugin = StoppedWhileAnswering()
    async with Simulator(sock_path) as sim:
        task = plugin.serve(sock_path)
        await sim.wait_for_plugin()
        assert (await sim.create_container(POD, CTR)).adjust.linux.devices
        assert not task.done()  # lingering
    assert await asyncio.wait_for(task, 5) == 0  # the runtime closed: no 30 s wait


async def test_a_stub_cancelled_while_it_lingers_still_closes_its_socket(
    sock_path: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(stub_module, "LINGER", 60.0)
    plugin = StoppedWhileAnswering()
    async with Simulator(sock_path) as sim:
        task = plugin.serve(sock_path)
        conn = await sim.wait_for_plugin()
        assert (await sim.create_container(POD, CTR)).adjust.linux.devices
        task.cancel()  # a caller that will not wait (the probe's own deadline)
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 5)
        await asyncio.wait_for(conn.mux.lost, 5)


@pytest.mark.parametrize("env_bytes", [0, 100, 20_000, 3 << 20])  # 1-, 2-, 3-byte lengths
@pytest.mark.parametrize("with_updates", [False, True])
def test_an_encoded_adjustment_is_answered_as_the_message_would_be(
    env_bytes: int, with_updates: bool,
) -> None:
    adjustment = adjust.build_adjustment(
        ContainerEdits(env=(f"BIG={'x' * env_bytes}",),
                       device_nodes=(DeviceNode("/dev/accel0", 240, 0),)), {"k": "v"})
    updates = [pb.ContainerUpdate(container_id="other")] if with_updates else []
    encoded = adjustment.SerializeToString(deterministic=True)
    as_message = (adjustment, updates) if with_updates else adjustment
    as_bytes = (encoded, updates) if with_updates else encoded
    assert _created(as_bytes) == _created(as_message)
    assert pb.CreateContainerResponse.FromString(_created(as_bytes)).adjust == adjustment
