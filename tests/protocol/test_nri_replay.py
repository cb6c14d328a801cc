"""Replay the real runtime's bytes into our plugin stub and check what it answers.

For each capture, the runtime->plugin reads are written, in their original chunking,
into one end of a socketpair whose other end the stub serves (as a pre-registered
plugin would). Before each read goes out, the stub must have answered as many
messages as the Go plugin had at that point of the recording, so the conversation
happens in the recorded order (Configure right after RegisterPlugin, each split
Synchronize chunk after the previous answer). The stub's answers are then decoded as
the runtime decodes them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from wire import (
    CAPTURES,
    decoded,
    relay_conns,
    replay,
    runtime_requests,
)

from nri_accel.inventory import ContainerEdits, DeviceNode
from nri_accel.nri import adjust
from nri_accel.nri import nri_pb2 as pb
from nri_accel.nri.stub import VALID_EVENTS
from nri_accel.ttrpc import FrameType, ttrpc_pb2

INJECTED = ContainerEdits(device_nodes=(DeviceNode("/dev/fakeaccel9", 240, 9, file_mode=0o660),))


class RecordingPlugin:
    """Stands in for an NRI plugin subscribed to every event: records each call and
    answers CreateContainer with one device."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def _record(self, name: str, detail: Any = None) -> None:
        self.calls.append((name, detail))

    def configure(self, config: str, runtime: str, version: str) -> None:
        self._record("configure", (runtime, version))

    def synchronize(self, pods: list[Any], containers: list[Any]) -> None:
        self._record("synchronize", (len(pods), len(containers)))

    def create_container(self, pod: Any, container: Any) -> Any:
        self._record("create_container", (pod.name, container.name))
        return adjust.build_adjustment(INJECTED)

    def update_container(self, pod: Any, container: Any, resources: Any) -> None:
        self._record("update_container", container.name)

    def stop_container(self, pod: Any, container: Any) -> None:
        self._record("stop_container", container.name)

    def validate_container_adjustment(self, request: Any) -> None:
        self._record("validate_container_adjustment", request.container.name)

    def update_pod_sandbox(self, pod: Any, overhead: Any, resources: Any) -> None:
        self._record("update_pod_sandbox", pod.name)


for _name in ("run_pod_sandbox", "stop_pod_sandbox", "remove_pod_sandbox",
              "post_update_pod_sandbox"):
    setattr(RecordingPlugin, _name,
            lambda self, pod, _n=_name: self._record(_n, pod.name))
for _name in ("post_create_container", "start_container", "post_start_container",
              "post_update_container", "remove_container"):
    setattr(RecordingPlugin, _name,
            lambda self, pod, container, _n=_name: self._record(_n, container.name))


RESPONSE_TYPES = {r: getattr(pb, f"{r}Response") for r in (
    "Configure", "Synchronize", "CreateContainer", "UpdateContainer", "StopContainer",
    "RunPodSandbox", "StopPodSandbox", "RemovePodSandbox", "PostCreateContainer",
    "StartContainer", "PostStartContainer", "PostUpdateContainer", "RemoveContainer",
    "ValidateContainerAdjustment")}
RESPONSE_TYPES["StateChange"] = pb.Empty  # CRI-O sends most events as StateChange


@pytest.mark.parametrize("capture", CAPTURES)
async def test_stub_answers_the_recorded_runtime_as_it_expects(
    nri_wire_dir: Path, capture: str
) -> None:
    for relay in relay_conns(nri_wire_dir, capture):
        frames, plugin, rc = await replay(nri_wire_dir, capture, relay, RecordingPlugin())
        assert rc == 0  # pre-registered: the connection ended, the stub returns

        # conn 2: our RegisterPlugin, as the runtime decodes it
        (conn, register), *answers = frames
        assert conn == 2 and register.type == FrameType.REQUEST and register.stream_id == 1
        envelope = ttrpc_pb2.Request.FromString(register.payload)
        assert (envelope.service, envelope.method) == ("nri.pkg.api.v1alpha1.Runtime",
                                                       "RegisterPlugin")
        req = pb.RegisterPluginRequest.FromString(envelope.payload)
        assert (req.plugin_name, req.plugin_idx, req.NRI_version) == ("recorder", "10",
                                                                      "v0.12.0")
        assert envelope.timeout_nano > 0

        # conn 1: one OK answer per runtime request, of the type the runtime expects
        by_stream = {f.stream_id: f for c, f in answers if c == 1}
        assert all(c == 1 and f.type == FrameType.RESPONSE for c, f in answers)
        requests = runtime_requests(nri_wire_dir, capture, relay)
        assert sorted(by_stream) == [sid for sid, _, _ in requests]
        sync_pods = sync_containers = 0
        for stream_id, method, payload in requests:
            response = ttrpc_pb2.Response.FromString(by_stream[stream_id].payload)
            assert not response.HasField("status"), (method, response.status)
            answer = RESPONSE_TYPES[method].FromString(response.payload)
            if method == "Configure":
                assert answer.events == VALID_EVENTS  # everything RecordingPlugin handles
            elif method == "Synchronize":
                sync = pb.SynchronizeRequest.FromString(payload)
                sync_pods += len(sync.pods)
                sync_containers += len(sync.containers)
                assert answer.more == sync.more and not answer.update
            elif method == "CreateContainer":
                assert [d.path for d in answer.adjust.linux.devices] == ["/dev/fakeaccel9"]
                assert answer.adjust.linux.devices[0].file_mode.value == 0o660
            elif method == "ValidateContainerAdjustment":
                assert not answer.reject

        # the plugin saw each event once and one Synchronize with everything
        names = [name for name, _ in plugin.calls]
        runtime = "cri-o" if capture.startswith("crio-") else "containerd"
        assert names[0] == "configure" and plugin.calls[0][1][0] == runtime
        assert plugin.calls[1] == ("synchronize", (sync_pods, sync_containers))
        handled = [m for _, m, _ in requests if m not in ("Configure", "Synchronize")]
        assert len(names) == 2 + len(handled)


async def test_split_synchronisation_reaches_the_plugin_once(nri_wire_dir: Path) -> None:
    frames, plugin, _ = await replay(nri_wire_dir, "split-sync-1500-containers", 1,
                                     RecordingPlugin())
    assert ("synchronize", (750, 1500)) in plugin.calls  # both chunks, delivered once
    chunks = [r for r in decoded(nri_wire_dir, "split-sync-1500-containers")
              if r["method"] == "Synchronize" and r["ttrpc_type"] == "response"]
    more = [pb.SynchronizeResponse.FromString(
        ttrpc_pb2.Response.FromString(f.payload).payload).more
        for c, f in frames if c == 1 and f.stream_id in {r["ttrpc_stream_id"] for r in chunks}]
    assert more == [True, False]
