"""The fault matrix: `nri-accel run` against runtimes that misbehave, over a real socket.

The daemon runs as a subprocess (daemon.py's helpers start it and read its log);
the runtime simulator, or a runtime wedged at one point of the handshake
(runtime_states.py), plays containerd. After each fault the daemon must still run, be
registered (again, when the fault cost it the connection), answer a CreateContainer
within the request timeout and hold as many file descriptors as before. SIGTERM
must stop it in every connection state, a runtime that stopped reading included;
stop() must do the same for a stub in this process and leave no task behind.
Waits are bounded for liveness only: nothing here measures speed (benchmarks do).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import shutil
import signal
import subprocess
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from daemon import gpu_request, log_events, start_daemon, stop, write_daemon_files
from runtime_states import (
    LIVENESS,
    STATES,
    WedgedRuntime,
    in_state,
    request_frame,
    stall_and_pipeline,
    until,
)

from nri_accel.nri import mux
from nri_accel.nri import nri_pb2 as pb
from nri_accel.nri import stub as stub_module
from nri_accel.nri.simulator import PluginConn, Simulator, make_container, make_pod
from nri_accel.nri.stub import Identity, Stub
from nri_accel.ttrpc import (
    MAX_MESSAGE_SIZE,
    Frame,
    FrameDecoder,
    FrameType,
)

# ---- looking at the daemon ----------------------------------------------------------------

# What the daemon opens for an instant to write its state atomically (a temporary file
# beside grants.json or nri-plugin.json, the directory to fsync): not a leak, and racing
# with a sample from here; everything else counts.
_STATE_WRITES = re.compile(r"/state(/\.(grants|nri)-[^/]*)?$")


def fd_count(pid: int) -> int:
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue  # closed meanwhile
        count += not _STATE_WRITES.search(target)
    return count


async def settled_fd_count(pid: int) -> int:
    """fd_count() once two samples 20 ms apart agree: what the daemon holds, without an
    fd it opens for an instant (a state write, from its writer thread) that one sample
    may catch."""
    count = fd_count(pid)
    for _ in range(50):
        await asyncio.sleep(0.02)
        count, last = fd_count(pid), count
        if count == last:
            return count
    raise AssertionError(f"the daemon's fd count did not settle within 1 s (now {count})")


def peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmHWM in /proc/{pid}/status")


@contextlib.asynccontextmanager
async def daemon_with_runtime(
    files: dict[str, str], **sim_options: Any,
) -> AsyncIterator[tuple[Simulator, PluginConn, subprocess.Popen[bytes]]]:
    """The simulator and the daemon registered with it; SIGTERM stops it cleanly at the end."""
    async with Simulator(files["socket"], **sim_options) as sim:
        proc = start_daemon(files)
        try:
            conn = await sim.wait_for_plugin("nri-accel", timeout=LIVENESS)
            yield sim, conn, proc
        finally:
            assert stop(proc) == 0


async def answers_a_gpu_request(sim: Simulator) -> None:
    """A CreateContainer asking for a GPU gets it (the simulator waits the request
    timeout and drops a plugin that does not answer); the GPU is released after."""
    pod, ctr = gpu_request("after-fault", "nvidia.com/gpu=0")
    rsp = await sim.create_container(pod, ctr)
    assert "/dev/nvidia0" in {d.path for d in rsp.adjust.linux.devices}
    await sim.remove_container(pod, ctr)


async def serves_again(sim: Simulator, conn: PluginConn, proc: subprocess.Popen[bytes],
                       fds: int) -> None:
    """After a fault on `conn`: the runtime drops the plugin if the fault left the
    connection open (containerd drops a plugin that stops answering), the daemon
    registers again and answers, and holds as many fds as before the fault."""
    if not conn.closed:
        conn.close()
    await sim.wait_for_plugin(after=conn, timeout=LIVENESS)
    await answers_a_gpu_request(sim)
    assert proc.poll() is None
    assert await settled_fd_count(proc.pid) == fds


def create_request(stream_id: int) -> bytes:
    pod, ctr = gpu_request("raw", "nvidia.com/gpu=1")
    payload = pb.CreateContainerRequest(pod=pod, container=ctr).SerializeToString()
    return request_frame(stream_id, "CreateContainer", payload)


GARBAGE = random.Random(10).randbytes(64 * 1024)


# ---- faults on a registered connection -----------------------------------------------------
# Each writes bytes on the runtime's end; `closes` says the runtime then hangs up,
# `conn_survives` that the fault is one the daemon answers and serves on past.

FAULTS: dict[str, tuple[bytes, bool, bool]] = {  # name: (bytes, closes, conn_survives)
    "garbage bytes on the socket": (GARBAGE, False, False),
    "garbage inside conn 1 mux frames": (mux.encode(1, GARBAGE), False, False),
    "garbage inside conn 2 mux frames": (mux.encode(2, GARBAGE), False, True),
    "frames for unknown mux conn ids": (
        b"".join(mux.encode(conn_id, b"?" * 16)
                 for conn_id in (0, 3, 0xFFFFFFFF, *range(100, 10100))), False, True),
    "a mux header over the size limit": (
        (1).to_bytes(4, "big") + (mux.PROTOCOL_MAX_PAYLOAD + 1).to_bytes(4, "big"),
        False, False),
    "a ttrpc header over the size limit": (
        # stream data skipped unbuffered; the oversize frame uses up no stream id
        mux.encode(1, (MAX_MESSAGE_SIZE + 1).to_bytes(4, "big") + (0x7FFFFFF1).to_bytes(4, "big")
                   + b"\1\0" + b"\0" * (MAX_MESSAGE_SIZE + 1)), False, True),
    "a truncated mux frame, then hang up": (
        (1).to_bytes(4, "big") + (1000).to_bytes(4, "big") + b"\0" * 10, True, False),
    "a truncated ttrpc frame, then hang up": (
        mux.encode(1, (5000).to_bytes(4, "big") + (1001).to_bytes(4, "big") + b"\1\0"
                   + b"\0" * 100), True, False),
    "half a CreateContainer, then hang up": (
        create_request(1001)[:2000], True, False),
    "a whole CreateContainer, then hang up before its answer": (
        create_request(1001), True, False),
}


@pytest.fixture(scope="module")
def one_daemon() -> Iterator[tuple[dict[str, str], subprocess.Popen[bytes]]]:
    """One daemon for every fault below, in turn: each test's simulator takes the
    socket path, the daemon connects to it. SIGTERM stops it cleanly at the end."""
    directory = Path(tempfile.mkdtemp(prefix="nri-"))
    files = write_daemon_files(directory)
    proc = start_daemon(files)
    try:
        yield files, proc
        assert stop(proc) == 0
    finally:
        stop(proc)
        shutil.rmtree(directory)


@pytest.mark.parametrize("fault", FAULTS)
async def test_after_a_fault_the_daemon_serves_again_and_leaks_no_fd(
    one_daemon: tuple[dict[str, str], subprocess.Popen[bytes]], fault: str,
) -> None:
    files, proc = one_daemon
    data, closes, conn_survives = FAULTS[fault]
    async with Simulator(files["socket"]) as sim:
        conn = await sim.wait_for_plugin("nri-accel", timeout=LIVENESS)
        logged = len(log_events(files))  # it serves every fault here, on either loop
        fds = await settled_fd_count(proc.pid)
        conn.write_raw(data)
        if closes:
            conn.close()
        elif conn_survives:
            await answers_a_gpu_request(sim)
            assert not conn.closed and sim.dropped == []
        await serves_again(sim, conn, proc, fds)
    events = [e["event"] for e in log_events(files)[logged:]]
    assert events.count("mux_unknown_connection") <= mux.UNKNOWN_CONNS_LOGGED


class AnswerCounter:
    """Takes the place of the simulator's client on conn 1: counts the answers."""

    def __init__(self) -> None:
        self.decoder = FrameDecoder()
        self.answers = 0

    def data_received(self, data: bytes) -> None:
        for frame in self.decoder.feed(data):
            assert isinstance(frame, Frame) and frame.type == FrameType.RESPONSE
            self.answers += 1


@pytest.mark.slow
async def test_a_runtime_that_pipelines_and_stops_reading_gets_bounded_memory_and_all_answers(
    daemon_files: dict[str, str],
) -> None:
    requests = 200_000
    async with daemon_with_runtime(daemon_files) as (sim, conn, proc):
        fds, rss_before = await settled_fd_count(proc.pid), peak_rss_kib(proc.pid)
        counter = AnswerCounter()
        conn.mux.attach(mux.PLUGIN_SERVICE_CONN, counter.data_received, conn.client.connection_lost)
        await stall_and_pipeline(conn, requests)
        assert conn.mux.write_buffer_size > 0  # the daemon stopped reading: backpressure
        conn.mux.hold_reading("runtime stalled", False)
        await until(lambda: counter.answers == requests, f"{requests} answers")
        # Without backpressure the daemon buffers every answer: 200k grow it by ~60 MB.
        assert peak_rss_kib(proc.pid) - rss_before < 16 * 1024
        await serves_again(sim, conn, proc, fds)


async def test_restarts_in_a_loop_each_mean_one_registration_and_no_fd_leak(
    daemon_files: dict[str, str],
) -> None:
    restarts = 8
    proc = start_daemon(daemon_files)
    fds = None
    try:
        for _ in range(restarts):
            async with Simulator(daemon_files["socket"]) as sim:
                await sim.wait_for_plugin("nri-accel", timeout=LIVENESS)
                await answers_a_gpu_request(sim)
                fds = fds or await settled_fd_count(proc.pid)
                assert await settled_fd_count(proc.pid) == fds
    finally:
        assert stop(proc) == 0
    assert [e["event"] for e in log_events(daemon_files)].count("registered") == restarts


@pytest.mark.slow
@pytest.mark.parametrize("containers, env_size, split", [
    (20_000, 0, False),     # ~3 MB: one Synchronize
    (30_000, 200, True),    # ~10 MB: over 4 MiB, the runtime splits it
])
async def test_synchronize_of_tens_of_thousands_of_containers(
    daemon_files: dict[str, str], containers: int, env_size: int, split: bool,
) -> None:
    async with Simulator(daemon_files["socket"], request_timeout=LIVENESS) as sim:
        pod = make_pod({"name": "many", "namespace": "batch"})
        sim.pods[pod.id] = pod
        template = make_container(pod, {"name": "c", "state": "CONTAINER_RUNNING",
                                        "env": [f"E={'e' * env_size}"]})
        for i in range(containers):
            ctr = pb.Container()
            ctr.CopyFrom(template)
            ctr.id, ctr.name = f"{i:064x}", f"c{i}"
            sim.containers[ctr.id] = ctr
        proc = start_daemon(daemon_files)
        try:
            await sim.wait_for_plugin("nri-accel", timeout=LIVENESS)
            assert (sim.sync_splits > 0) == split and sim.dropped == []
            await answers_a_gpu_request(sim)
        finally:
            assert stop(proc) == 0
    (synced,) = [e for e in log_events(daemon_files) if e["event"] == "synchronized"]
    assert synced["containers"] == containers


# ---- a runtime wedged in the handshake -------------------------------------------------------

@pytest.mark.slow
async def test_a_runtime_that_never_answers_register_plugin_is_left_after_its_timeout(
    daemon_files: dict[str, str],
) -> None:
    async with WedgedRuntime(daemon_files["socket"], "register") as runtime:
        proc = start_daemon(daemon_files)
        try:
            await asyncio.wait_for(runtime.reached.wait(), LIVENESS)
            fds = fd_count(proc.pid)
            # the default registration timeout (5 s) passes: the daemon connects again
            await until(lambda: runtime.accepted >= 2, "a second connection")
            await until(lambda: fd_count(proc.pid) <= fds, "the first connection closed")
        finally:
            assert stop(proc) == 0
    warnings = [e for e in log_events(daemon_files) if e["event"] == "runtime_unavailable"]
    assert "DEADLINE_EXCEEDED" in warnings[0]["error"]


# ---- SIGTERM and stop() in every state ------------------------------------------------------

@pytest.mark.parametrize("state", STATES)
async def test_sigterm_stops_the_daemon_in_every_state(
    daemon_files: dict[str, str], state: str,
) -> None:
    def retrying() -> bool:  # the log may not exist yet, its last line may be partial
        log = Path(daemon_files["log"])
        return log.exists() and '"runtime_unavailable"' in log.read_text()

    async with in_state(state, daemon_files["socket"], lambda: start_daemon(daemon_files),
                        retrying) as proc:
        proc.send_signal(signal.SIGTERM)
        # Liveness, not speed: a close that waits on the runtime hangs 30 s and more.
        assert await asyncio.to_thread(proc.wait, 5) == 0
    events = [e["event"] for e in log_events(daemon_files)]
    assert events[-2:] == ["signal_received", "plugin_stopped"]


class Bystander:
    """A plugin that takes part in CreateContainer and changes nothing."""

    def create_container(self, pod: Any, container: Any) -> None:
        return None


async def stop_in_state(sock_path: str, state: str) -> None:
    """An in-process stub brought into `state`, stopped: its run() returns 0 within 5 s.
    (Its "connecting" state is seen in the stub's warnings: the test needs all_logs.)"""
    stub = Stub(Bystander(), Identity("injector", "30"), socket_path=sock_path)

    def start() -> asyncio.Task[int]:
        return asyncio.get_running_loop().create_task(stub.run())

    with structlog.testing.capture_logs() as logs:
        async with in_state(state, sock_path, start,
                            lambda: any(e["event"] == "runtime_unavailable" for e in logs)
                            ) as task:
            stub.stop()
            assert await asyncio.wait_for(task, 5) == 0


@pytest.mark.parametrize("state", STATES)
async def test_stop_ends_an_in_process_stub_in_every_state_leaving_no_task_or_fd(
    sock_path: str, state: str, all_logs: None,
) -> None:
    # A first stub, stopped the same way, lets the loop make what it makes once: uvloop
    # opens /dev/null once, at its first socket, and keeps it while the loop lives.
    await stop_in_state(sock_path, state)
    before_tasks = asyncio.all_tasks()
    before_fds = fd_count(os.getpid())
    await stop_in_state(sock_path, state)
    assert asyncio.all_tasks() == before_tasks
    assert fd_count(os.getpid()) == before_fds


ANSWERED_NOTHING = [s for s in STATES if s not in (
    "mid split Synchronize", "registered and idle",
    "write buffer full: the runtime stopped reading")]


@pytest.mark.parametrize("state", ANSWERED_NOTHING)
async def test_a_stub_that_answered_nothing_yet_stops_without_lingering(
    sock_path: str, state: str, monkeypatch: pytest.MonkeyPatch, all_logs: None,
) -> None:
    # stub.LINGER keeps a stopping plugin's socket open for the runtime to read its last
    # answer; its own RegisterPlugin is no answer: nothing to wait for.
    monkeypatch.setattr(stub_module, "LINGER", 60.0)
    await stop_in_state(sock_path, state)


async def test_an_in_process_stub_through_runtime_restarts_keeps_no_task_or_fd_of_old_sessions(
    sock_path: str,
) -> None:
    stub = Stub(Bystander(), Identity("bystander", "30"), socket_path=sock_path)
    task = asyncio.get_running_loop().create_task(stub.run())
    baseline: tuple[int, int] | None = None
    for _ in range(5):
        async with Simulator(sock_path) as sim:
            await sim.wait_for_plugin(timeout=LIVENESS)
            pod = make_pod({"name": "p"})
            await sim.create_container(pod, make_container(pod, {"name": "c"}))
            now = (len(asyncio.all_tasks()), fd_count(os.getpid()))
            baseline = baseline or now
            assert now == baseline
    stub.stop()
    assert await asyncio.wait_for(task, 5) == 0
    assert stub.registrations == 5
