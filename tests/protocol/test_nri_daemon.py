"""`nri-accel run` as a subprocess against the runtime simulator over real sockets.

The daemon runs on daemon.py's four-GPU inventory in standalone mode, so pod
annotations grant devices. The simulator plays containerd; tests drive it and read
the daemon's JSON log file.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from daemon import gpu_request, key, log_events, run_args, start_daemon, stop

from nri_accel.nri import mux
from nri_accel.nri import nri_pb2 as pb
from nri_accel.nri.simulator import (
    PluginConn,
    PluginError,
    Simulator,
    make_container,
    make_pod,
)
from nri_accel.nri.stub import PLUGIN_SERVICE
from nri_accel.ttrpc import Code, Frame, FrameDecoder, FrameType, encode_frame, ttrpc_pb2


def running_with(sim: Simulator, pod_name: str, granted: str) -> None:
    """A running container the plugin granted `granted` before it restarted."""
    pod = make_pod({"name": pod_name, "namespace": "ml"})
    ctr = make_container(pod, {"name": "main", "state": "CONTAINER_RUNNING",
                               "annotations": {"nri-accel.io/granted": granted}})
    sim.pods[pod.id], sim.containers[ctr.id] = pod, ctr


async def test_daemon_registers_synchronises_thousands_and_answers(
    daemon_files: dict[str, str],
) -> None:
    async with Simulator(daemon_files["socket"], configure_first=True) as sim:
        running_with(sim, "holder-a", key(0))
        running_with(sim, "holder-b", key(1))
        filler = make_pod({"name": "filler", "namespace": "batch"})
        sim.pods[filler.id] = filler
        template = make_container(filler, {"name": "c", "state": "CONTAINER_RUNNING",
                                           "env": [f"V{j}={'v' * 100}" for j in range(30)]})
        for i in range(3000):
            ctr = pb.Container()
            ctr.CopyFrom(template)
            ctr.id, ctr.name = f"{i:064x}", f"c{i}"
            sim.containers[ctr.id] = ctr
        proc = start_daemon(daemon_files)
        try:
            conn = await sim.wait_for_plugin("nri-accel", timeout=20)
            assert conn.idx == "40" and sim.sync_splits >= 1
            assert conn.events == sum(1 << (e - 1) for e in (
                pb.STOP_POD_SANDBOX, pb.REMOVE_POD_SANDBOX, pb.CREATE_CONTAINER,
                pb.STOP_CONTAINER, pb.REMOVE_CONTAINER))

            pod, ctr = gpu_request("trainer", "nvidia.com/gpu: 2")
            rsp = await sim.create_container(pod, ctr)
            paths = sorted(d.path for d in rsp.adjust.linux.devices)
            assert paths == ["/dev/nvidia2", "/dev/nvidia3", "/dev/nvidiactl"]
            assert rsp.adjust.annotations["nri-accel.io/granted"] == f"{key(2)},{key(3)}"
            assert [m.destination for m in rsp.adjust.mounts] == ["/usr/bin/nvidia-smi"]

            pod2, ctr2 = gpu_request("late", "nvidia.com/gpu: 1")
            with pytest.raises(PluginError) as refused:
                await sim.create_container(pod2, ctr2)
            assert refused.value.message.startswith(
                "annotation devices.nri-accel.io/container.main")
            # No GPU free: the status says what kind of refusal it is (the runtime quotes it).
            assert refused.value.code == Code.RESOURCE_EXHAUSTED

            await sim.stop_container(pod, ctr)  # releases GPUs 2 and 3
            rsp = await sim.create_container(pod2, ctr2)
            assert rsp.adjust.annotations["nri-accel.io/granted"] == key(2)
        finally:
            assert stop(proc) == 0

    events = log_events(daemon_files)
    created = [e for e in events if e["event"] == "container_created"]
    refused_lines = [e for e in events if e["event"] == "container_refused"]
    assert [(e["namespace"], e["pod"], e["container"], e["devices"]) for e in created] == [
        ("ml", "trainer", "main", ["nvidia.com/gpu=2", "nvidia.com/gpu=3"]),
        ("ml", "late", "main", ["nvidia.com/gpu=2"])]
    assert created[0]["capabilities"] == "compute,utility"
    assert all(isinstance(e["duration_us"], int) for e in created + refused_lines)
    assert [(e["pod"], e["source"]) for e in refused_lines] == [
        ("late", "annotation devices.nri-accel.io/container.main")]
    assert any(e["event"] == "registered" for e in events)


async def test_runtime_gone_and_back_the_daemon_registers_again(
    daemon_files: dict[str, str],
) -> None:
    proc = start_daemon(daemon_files)
    try:
        for _ in range(2):
            async with Simulator(daemon_files["socket"]) as sim:
                await sim.wait_for_plugin("nri-accel", timeout=10)
                pod, ctr = gpu_request("p", "nvidia.com/gpu=0")
                assert (await sim.create_container(pod, ctr)).adjust.linux.devices
            await asyncio.sleep(0.3)  # runtime down a while: the daemon keeps retrying
            assert proc.poll() is None
    finally:
        assert stop(proc, signal.SIGINT) == 0
    assert sum(e["event"] == "registered" for e in log_events(daemon_files)) == 2


class Tap:
    """Sees the daemon's answers on conn 1 before the simulator's client does, so a test
    can send raw frames and read their answers by stream id."""

    def __init__(self, conn: PluginConn) -> None:
        self.decoder = FrameDecoder()
        self.answers: dict[int, Frame] = {}
        self.forward = conn.client.data_received
        conn.mux.attach(mux.PLUGIN_SERVICE_CONN, self.data_received, conn.client.connection_lost)
        self.conn = conn

    def data_received(self, data: bytes) -> None:
        for frame in self.decoder.feed(data):
            assert isinstance(frame, Frame)
            self.answers[frame.stream_id] = frame
        self.forward(data)

    def send_request(self, stream_id: int, envelope: bytes, length: int | None = None) -> None:
        frame = encode_frame(stream_id, FrameType.REQUEST, envelope,
                             max_message_size=len(envelope))
        if length is not None:  # claim another length in the header (oversize test)
            frame = length.to_bytes(4, "big") + frame[4:]
        # in frames of 4096 bytes, each under the mux's limit, whatever the ttrpc length
        # says (mux.encode frames as Go does, its rest in one frame: a 5 MiB one would
        # stop at the mux, not reach the ttrpc layer this test is about)
        self.conn.write_raw(b"".join(mux.encode(mux.PLUGIN_SERVICE_CONN, frame[i:i + 4096])
                                     for i in range(0, len(frame), 4096)))

    async def answer(self, stream_id: int) -> ttrpc_pb2.Response:
        async with asyncio.timeout(10):
            while stream_id not in self.answers:
                await asyncio.sleep(0.005)
        return ttrpc_pb2.Response.FromString(self.answers[stream_id].payload)


def envelope(method: str, payload: bytes) -> bytes:
    return ttrpc_pb2.Request(service=PLUGIN_SERVICE, method=method, payload=payload,
                             timeout_nano=2_000_000_000).SerializeToString()


async def test_malformed_and_oversize_input_is_answered_and_serving_goes_on(
    daemon_files: dict[str, str],
) -> None:
    proc = start_daemon(daemon_files)
    try:
        async with Simulator(daemon_files["socket"]) as sim:
            conn = await sim.wait_for_plugin(timeout=10)
            tap = Tap(conn)
            pod, ctr = gpu_request("p", "nvidia.com/gpu=1")
            good = pb.CreateContainerRequest(pod=pod, container=ctr).SerializeToString()

            tap.send_request(101, envelope("CreateContainer", b"\x0a\xff\xff\xff"))
            bad_nri = (await tap.answer(101)).status
            assert bad_nri.code == Code.INVALID_ARGUMENT
            assert "malformed CreateContainerRequest" in bad_nri.message

            tap.send_request(103, b"\xff\xff\xff")  # not a ttrpc Request at all
            assert (await tap.answer(103)).status.code == Code.INVALID_ARGUMENT

            tap.send_request(105, envelope("NoSuchMethod", b""))
            assert (await tap.answer(105)).status.code == Code.UNIMPLEMENTED

            big = 5 << 20  # declared over ttrpc's 4 MiB; the payload streams past
            tap.send_request(107, b"\0" * big, length=big)
            assert (await tap.answer(107)).status.code == Code.RESOURCE_EXHAUSTED

            tap.send_request(109, envelope("CreateContainer", good))
            answer = await tap.answer(109)
            assert not answer.HasField("status")
            adjust = pb.CreateContainerResponse.FromString(answer.payload).adjust
            assert "/dev/nvidia1" in {d.path for d in adjust.linux.devices}
            assert sim.dropped == [] and len(sim.connections) == 1

            # A mux frame longer than any peer may send: the daemon drops the socket
            # and connects again.
            conn.write_raw(b"\0\0\0\1\xff\xff\xff\xf0")
            again = await sim.wait_for_plugin(after=conn, timeout=10)
            assert (await sim.create_container(pod, ctr)).adjust.linux.devices
            assert again is not conn
    finally:
        assert stop(proc) == 0
    lines = log_events(daemon_files)
    events = [e["event"] for e in lines]
    assert events.count("registered") == 2
    broken, *closed = [e for e in lines if e["event"] == "runtime_disconnected"]
    assert broken["level"] == "error"
    assert broken["error"].startswith("the peer sent bytes that are not NRI (mux ")
    assert "while registered" in broken["error"]
    # the simulator closing at the end, where that comes before SIGTERM: no error
    assert [(e["level"], e["error"]) for e in closed] in ([], [("warning", None)])
    refused = [e for e in events if e.startswith("ttrpc_frame_refused")]
    assert any("RESOURCE_EXHAUSTED" in e for e in refused)  # the ttrpc layer's own line


AS_FD_3 = (  # argv: FD PROGRAM ARGS...: exec PROGRAM with FD as its fd 3
    "import os, sys; fd = int(sys.argv[1]); os.dup2(fd, 3); fd != 3 and os.close(fd); "
    "os.execv(sys.argv[2], sys.argv[2:])"
)


async def test_preregistered_launch_uses_fd_3_logs_to_its_file_and_exits_with_the_runtime(
    daemon_files: dict[str, str],
) -> None:
    runtime_end, plugin_end = socket.socketpair()
    bare_env = {"NRI_PLUGIN_NAME": "accel", "NRI_PLUGIN_IDX": "15", "NRI_PLUGIN_SOCKET": "3"}
    proc = subprocess.Popen(  # the runtime passes the socket as fd 3 (Go's ExtraFiles)
        [sys.executable, "-c", AS_FD_3, str(plugin_end.fileno()), *run_args(daemon_files)],
        env=bare_env, pass_fds=(plugin_end.fileno(),), stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    plugin_end.close()
    try:
        async with Simulator(daemon_files["socket"]) as sim:
            conn = await sim.adopt(runtime_end)
            await asyncio.wait_for(conn.ready, 10)
            assert (conn.name, conn.idx) == ("accel", "15")
            pod, ctr = gpu_request("p", "nvidia.com/gpu=3")
            rsp = await sim.create_container(pod, ctr)
            assert "/dev/nvidia3" in {d.path for d in rsp.adjust.linux.devices}
            conn.close()  # the runtime goes away: a launched plugin exits
            assert await asyncio.to_thread(proc.wait, 10) == 0
    finally:
        stop(proc)
    lines = log_events(daemon_files)
    (start,) = [e for e in lines if e["event"] == "plugin_starting"]
    assert (start["mode"], start["socket"], start["plugin"]) == ("pre-registered", "fd 3",
                                                                  "15-accel")
    assert start["event_loop"] == "uvloop"  # nri.event_loop = "auto" (App.run_loop)
    events = [e["event"] for e in lines]
    assert "registered" in events and "container_created" in events


async def test_sigterm_stops_cleanly_and_closes_the_connection(
    daemon_files: dict[str, str],
) -> None:
    async with Simulator(daemon_files["socket"]) as sim:
        proc = start_daemon(daemon_files)
        conn = await sim.wait_for_plugin(timeout=10)
        assert stop(proc, signal.SIGTERM) == 0
        await asyncio.wait_for(conn.mux.lost, 5)
    events = [e["event"] for e in log_events(daemon_files)]
    assert events[-2:] == ["signal_received", "plugin_stopped"]
    assert "runtime_disconnected" not in events


def test_a_bad_config_is_a_usage_error_naming_the_key(daemon_files: dict[str, str]) -> None:
    Path(daemon_files["config"]).write_text('[nri]\nidx = "4"\n')
    done = subprocess.run(run_args(daemon_files), capture_output=True, text=True, timeout=30,
                          check=False)
    assert done.returncode == 2
    assert "nri.idx" in done.stderr
