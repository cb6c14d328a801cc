"""What the device plugin does with what it must not trust: the NRI side's state record
as any file at all (corrupt, huge, a FIFO, a symlink, from the future), a second device
plugin on the same kubelet directory, and requests far larger than kubelet sends. Over
real gRPC with the fake kubelet (fake_kubelet.py) where a request is concerned; waits
are bounded waits for an expected state, nothing measures how fast it comes."""

from __future__ import annotations

import json
import os
import socket
import threading

import grpc
import pytest
from structlog.testing import capture_logs

from nri_accel import state
from nri_accel.deviceplugin import deviceplugin_pb2 as pb2
from nri_accel.deviceplugin.resources import (
    MAX_CONTAINER_REQUESTS,
    PluginDevice,
    Resource,
    request_size_problem,
    shown_id,
    shown_ids,
)
from nri_accel.deviceplugin.server import DevicePlugins
from nri_accel.state import NRI_STATUS_FILE, NriStatus

from .conftest import GPU0, GPU2, NODE_CONFIG, allocate, node_inventory, pre_start, refused
from .fake_kubelet import WAIT

NEVER_RAN = "no `nri-accel run` has recorded its state on this node"
GOOD = {"registered": True, "runtime": "containerd v2.1.0", "plugin": "40-nri-accel",
        "pid": 4242, "heartbeat": 1000.0}


def record(**changes: object) -> str:
    return json.dumps({**GOOD, **changes})


def load_bounded(state_dir: str) -> NriStatus:
    """NriStatus.load in a thread, failing the test if it does not return (a FIFO that
    blocked it would hang the test otherwise)."""
    out: list[NriStatus] = []
    t = threading.Thread(target=lambda: out.append(NriStatus.load(state_dir)), daemon=True)
    t.start()
    t.join(WAIT)
    assert out, "NriStatus.load did not return"
    return out[0]


# ---- the record as any file at all --------------------------------------------------

CONTENTS = {
    "garbage": "garbage\x00\xff",
    "a JSON list": "[1, 2]",
    "truncated": record()[:30],
    "pid 1e999": record().replace('"pid": 4242', '"pid": 1e999'),
    "heartbeat 1e999": record().replace('"heartbeat": 1000.0', '"heartbeat": 1e999'),
    "heartbeat NaN": record().replace('"heartbeat": 1000.0', '"heartbeat": NaN'),
    "negative heartbeat": record(heartbeat=-5.0),
    "a field missing": json.dumps({k: v for k, v in GOOD.items() if k != "plugin"}),
    "registered as a string": record(registered="yes"),
    "pid as a float": record(pid=4242.5),
    "nested 200,000 deep": "[" * 200_000 + "]" * 200_000,  # over the size limit
    "nested 30,000 deep in a field": record()[:-1] + ', "x": ' + "[" * 30_000
                                     + "]" * 30_000 + "}",  # within it: RecursionError
    "a valid record padded past the limit": record() + " " * NriStatus.MAX_BYTES,
}


@pytest.mark.parametrize("content", CONTENTS.values(), ids=CONTENTS.keys())
def test_a_malformed_record_reads_as_not_registered_saying_the_file_is_malformed(
        tmp_path, content: str) -> None:
    (tmp_path / NRI_STATUS_FILE).write_text(content, encoding="utf-8",
                                            errors="surrogateescape")
    status = load_bounded(str(tmp_path))
    assert not status.registered and not status.usable(1000.0)
    why = status.why_not(1000.0)
    assert why.startswith(f"{tmp_path / NRI_STATUS_FILE} exists but ")
    assert "not a record of `nri-accel run`" in why and NEVER_RAN not in why
    assert len(why) < 500


def _fifo(path: str) -> None:
    os.mkfifo(path)


def _dangling(path: str) -> None:
    os.symlink(path + ".gone", path)


def _zero(path: str) -> None:
    os.symlink("/dev/zero", path)


def _link_to_good(path: str) -> None:  # `run` writes a regular file, never a link
    with open(path + ".real", "w", encoding="utf-8") as f:
        f.write(record())
    os.symlink(path + ".real", path)


FILES = {"a FIFO": (_fifo, "is a pipe (FIFO)"), "a directory": (os.mkdir, "is a directory"),
         "a dangling symlink": (_dangling, "is a symbolic link"),
         "a symlink to /dev/zero": (_zero, "is a symbolic link"),
         "a symlink to a valid record": (_link_to_good, "is a symbolic link")}


@pytest.mark.parametrize(("make", "what"), FILES.values(), ids=FILES.keys())
def test_anything_but_a_regular_file_is_refused_without_being_read(tmp_path, make,
                                                                    what: str) -> None:
    make(str(tmp_path / NRI_STATUS_FILE))
    status = load_bounded(str(tmp_path))
    assert not status.usable(1000.0)
    assert status.why_not(1000.0).startswith(f"{tmp_path / NRI_STATUS_FILE} exists but {what}")


def test_an_absent_record_and_a_good_one_read_as_before(tmp_path) -> None:
    assert NriStatus.load(str(tmp_path)).why_not(1000.0) == NEVER_RAN
    (tmp_path / NRI_STATUS_FILE).write_text(record(), encoding="utf-8")
    assert NriStatus.load(str(tmp_path)) == NriStatus(True, "containerd v2.1.0",
                                                      "40-nri-accel", 4242, 1000.0)
    NriStatus(True, "containerd v2.1.0", "40-nri-accel", 4242, 1000.0).save(str(tmp_path))
    size = (tmp_path / NRI_STATUS_FILE).stat().st_size
    assert size < 200 < NriStatus.MAX_BYTES  # what `run` writes, far below the limit
    assert NriStatus.load(str(tmp_path)).usable(1001.0)


def test_a_heartbeat_from_the_future_is_not_believed(tmp_path) -> None:
    NriStatus(True, "containerd v2.1.0", "40-nri-accel", 4242, 4598.0).save(str(tmp_path))
    status = NriStatus.load(str(tmp_path))
    assert not status.usable(1000.0)
    why = status.why_not(1000.0)
    assert why.startswith("`nri-accel run` (pid 4242) recorded its state 3598 s in the future")
    assert "ago" not in why
    assert status.usable(4598.5)  # the writer's clock caught up (within FUTURE: tolerated)


def test_a_record_turning_malformed_while_serving_fails_closed_with_one_line(
        tmp_path, monkeypatch, all_logs) -> None:
    # Before: OverflowError out of check_nri, "nri_poll_failed" with a traceback every
    # poll, the last (healthy) state kept, Allocate failing INTERNAL.
    monkeypatch.setattr(state, "boottime", lambda: 1000.0)
    nri = tmp_path / "state"
    NriStatus(True, "containerd v2.1.0", "40-nri-accel", 4242, 1000.0).save(str(nri))
    plugins = DevicePlugins(node_inventory(), str(tmp_path), config=NODE_CONFIG,
                            state_dir=str(nri))
    with capture_logs() as logs:
        assert plugins.check_nri() == ""
        (nri / NRI_STATUS_FILE).write_text(CONTENTS["pid 1e999"], encoding="utf-8")
        reasons = {plugins.check_nri() for _ in range(3)}
        (nri / NRI_STATUS_FILE).unlink()
        _fifo(str(nri / NRI_STATUS_FILE))
        assert "is a pipe (FIFO)" in plugins.check_nri()
    (reason,) = reasons
    assert reason.startswith(f"{nri / NRI_STATUS_FILE} exists but is not a valid record")
    assert plugins.nri_down
    assert [(e["event"], e.get("reason", "")) for e in logs] == [
        ("nri_plugin_available", ""), ("nri_plugin_unavailable", reason)]


@pytest.mark.parametrize("make", [
    lambda p: open(p, "w", encoding="utf-8").write("[" * 200_000),  # noqa: SIM115
    _fifo, _zero,
], ids=["corrupt", "FIFO", "/dev/zero"])
def test_the_plugin_starts_and_refuses_over_grpc_whatever_the_record_is(
        kubelet, nri_side, plugins, make) -> None:
    # Before: a corrupt file crashed `device-plugin` at start; a FIFO blocked its event
    # loop forever (every RPC DEADLINE_EXCEEDED); /dev/zero grew its memory unbounded.
    nri_side.remove()
    make(nri_side.path)
    plugins()
    gpu = kubelet.wait_registered("nvidia.com/gpu")
    kubelet.wait_list(gpu, lambda r: all(d.health == "Unhealthy" for d in r.devices),
                      "every GPU Unhealthy")
    error = refused(lambda: allocate(kubelet, gpu.request.endpoint, [GPU0]))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"{nri_side.path} exists but " in error.details()
    os.unlink(nri_side.path)
    nri_side.register()  # `run` writes its record: served again
    kubelet.wait_list(gpu, lambda r: r.devices[0].health == "Healthy", "GPU 0 Healthy")
    assert allocate(kubelet, gpu.request.endpoint, [GPU0]).container_responses


# ---- one device plugin per kubelet directory ----------------------------------------


def test_a_second_plugin_waits_for_the_first_and_never_takes_its_sockets(
        kubelet, plugins, all_logs) -> None:
    # Before: each deleted the other's live sockets as "left by an earlier run" and
    # served again, forever: dozens of registrations a second.
    with capture_logs() as logs:
        first = plugins()
        gpu = kubelet.wait_registered("nvidia.com/gpu")
        second = plugins()
        kubelet.wait_for(lambda: second.plugins.ready() is not None
                         and "waiting" in second.plugins.ready(), "the second one waits")
        for _ in range(3):  # the first one's polls: its sockets stay its own
            first.call(first.plugins.tick())
        assert kubelet.registrations("nvidia.com/gpu") == [gpu]
        assert first.plugins.ready() is None
        first.stop()  # the old pod ends: the second takes over
        again = kubelet.wait_registered("nvidia.com/gpu", count=2)
        assert [d.ID for d in kubelet.wait_list(again).devices] == [GPU0, GPU2]
        kubelet.wait_for(lambda: second.plugins.ready() is None, "the second one is ready")
    busy = [e for e in logs if e["event"] == "kubelet_dir_busy"]
    assert len(busy) == 1 and busy[0]["other_pids"] == [os.getpid()]
    assert [e["event"] for e in logs].count("kubelet_dir_acquired") == 1


def test_a_plugin_taking_over_registers_after_kubelet_handled_the_first_ones_streams(
        kubelet, plugins) -> None:
    # kubelet hands the first plugin's stream ends on by resource name, a little later
    # (manager.go PluginDisconnected): a Register before that has its new endpoint
    # marked stopped, every Allocate refused while its stream stays open.
    kubelet.disconnects_by_resource, kubelet.forget_delay = True, 0.3
    first = plugins()
    gpu = kubelet.wait_registered("nvidia.com/gpu")
    kubelet.wait_list(gpu)
    second = plugins()
    kubelet.wait_for(lambda: second.plugins.ready() is not None
                     and "waiting" in second.plugins.ready(), "the second one waits")
    first.stop()
    again = kubelet.wait_registered("nvidia.com/gpu", count=2)
    kubelet.wait_for(lambda: gpu.stopped or again.stopped,
                     "kubelet to hand the first plugin's stream end on")
    assert gpu.stopped and not again.stopped
    assert [d.ID for d in kubelet.wait_list(again).devices] == [GPU0, GPU2]


def test_a_live_socket_of_a_process_without_the_lock_is_not_taken_over(kubelet,
                                                                        plugins) -> None:
    # An older nri-accel (no directory lock) serving during the upgrade: its socket
    # accepts connections, so it is not "left by an earlier run".
    path = os.path.join(kubelet.directory, "nri-accel-nvidia.com_gpu.sock")
    live = socket.socket(socket.AF_UNIX)
    live.bind(path)
    live.listen()
    inode = os.stat(path).st_ino
    running = plugins()
    kubelet.wait_registered("nvidia.com/mig-1g.10gb")  # the others are served
    running.call(running.plugins.tick())
    assert os.stat(path).st_ino == inode
    assert kubelet.registrations("nvidia.com/gpu") == []
    live.close()  # it exits (without removing its socket): now a stale one, replaced
    conn = kubelet.wait_registered("nvidia.com/gpu")
    assert [d.ID for d in kubelet.wait_list(conn).devices] == [GPU0, GPU2]


# ---- request sizes ------------------------------------------------------------------


def test_request_limits_and_shown_ids() -> None:
    gpu = Resource("nvidia.com/gpu")
    assert request_size_problem(gpu, 1, [0]) == ""
    assert "more than the limit of 16" in request_size_problem(gpu, 17, iter(()))
    assert "names 1 device IDs, more than the 0 this resource advertises" in (
        request_size_problem(gpu, 1, [1]))
    # time-slicing: each device is advertised `replicas` times, and kubelet may give
    # one container several replicas
    eight = tuple(PluginDevice(f"GPU-{x}::{n}", f"nvidia.com/gpu=GPU-{x}::{n}")
                  for x in "ab" for n in range(4))  # as resources_from_inventory lists them
    sliced = Resource("nvidia.com/gpu", eight, replicas=4)
    assert request_size_problem(sliced, 1, [8]) == ""
    assert "names 9 device IDs, more than the 8 this resource advertises" in (
        request_size_problem(sliced, 1, [9]))
    assert shown_id("x" * 81) == "x" * 80 + "..."
    assert shown_ids(["a"] * 10) == ["a"] * 8 + ["... (2 more)"]
    assert shown_ids(["a", "b" * 200]) == ["a", "b" * 80 + "..."]


def test_too_many_container_requests_are_refused_before_any_work(
        kubelet, nri_side, plugins, all_logs) -> None:
    plugins()
    gpu = kubelet.wait_registered("nvidia.com/gpu").request.endpoint
    ok = allocate(kubelet, gpu, *[[GPU0]] * MAX_CONTAINER_REQUESTS)
    assert len(ok.container_responses) == MAX_CONTAINER_REQUESTS
    nri_side.unregister()  # checked before the NRI side, before any line per container
    with capture_logs() as logs:
        error = refused(lambda: allocate(kubelet, gpu, *[[]] * 10_000))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.details() == ("nvidia.com/gpu: 10000 container requests in one call, "
                                   "more than the limit of 16 (kubelet sends one)")
        error = refused(lambda: allocate(kubelet, gpu, [GPU0, GPU2, "GPU-x"]))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "names 3 device IDs, more than the 2 this resource advertises" in (
            error.details())
        channel, stub = kubelet.client(gpu)
        with channel:
            error = refused(lambda: stub.GetPreferredAllocation(
                pb2.PreferredAllocationRequest(container_requests=[
                    pb2.ContainerPreferredAllocationRequest(allocation_size=1)] * 17),
                timeout=WAIT))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    events = [e["event"] for e in logs if e.get("resource") == "nvidia.com/gpu"
              and e["event"] not in ("registered", "serving")]  # a thread's late lines
    assert events == ["allocate_refused", "allocate_refused",
                      "get_preferred_allocation_refused"]  # no line per container


def test_while_the_nri_side_is_down_logged_ids_are_truncated(kubelet, nri_side, plugins,
                                                             all_logs) -> None:
    nri_side.unregister()
    plugins()
    gpu = kubelet.wait_registered("nvidia.com/gpu").request.endpoint
    huge = "B" * (1 << 20)
    with capture_logs() as logs:
        error = refused(lambda: pre_start(kubelet, gpu, [huge] + ["id"] * 50_000))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        error = refused(lambda: allocate(kubelet, gpu, [huge, GPU0]))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    pre, alloc = (e for e in logs if e["event"] in ("pre_start_refused", "allocate_refused"))
    assert pre["devices"] == ["B" * 80 + "..."] + ["id"] * 7 + ["... (49993 more)"]
    assert alloc["devices"] == [["B" * 80 + "...", GPU0]]
    assert len(error.details()) < 1000
