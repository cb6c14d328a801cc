"""AccelPlugin over a real Engine: what a grant's life looks like from the runtime's side.

An answer that could not be delivered holds nothing, a pod sandbox's end frees what its
containers held (CRI-O sends nothing for a failed create), the checkpoint follows every
change, and the status file the device plugin reads says whether `run` is registered.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest
from demo_node import demo_inventory
from grants import held
from structlog.testing import capture_logs

from nri_accel import plugin
from nri_accel.config import Config, PolicyConfig
from nri_accel.edits import MAX_ENV_STRING
from nri_accel.engine import Engine
from nri_accel.errors import RequestError
from nri_accel.nri import convert
from nri_accel.nri import nri_pb2 as pb
from nri_accel.nri.simulator import make_container, make_pod
from nri_accel.plugin import AccelPlugin
from nri_accel.state import CHECKPOINT_FILE, Checkpoint, CheckpointWriter, NriStatus, boottime
from nri_accel.ttrpc import MAX_MESSAGE_SIZE

STANDALONE = Config(policy=PolicyConfig(mode="standalone"))
KEY = "devices.nri-accel.io/container.main"

pytestmark = pytest.mark.usefixtures("all_logs")


@pytest.mark.parametrize(("length", "why"), [
    (MAX_MESSAGE_SIZE, "cannot be passed to a process"),
    (MAX_ENV_STRING, "cannot be passed to a process"),
])
def test_a_variable_too_long_to_extend_is_refused_by_name_and_holds_nothing(length, why):
    engine = Engine(demo_inventory(), STANDALONE)
    pod = make_pod({"name": "p", "annotations": {KEY: "nvidia.com/gpu: 2"}})
    huge = "LD_LIBRARY_PATH=" + ":".join(f"/opt/lib{i:07d}" for i in range(length // 16))
    ctr = make_container(pod, {"name": "main", "env": [huge]})
    with pytest.raises(RequestError) as e:
        AccelPlugin(engine).create_container(pod, ctr)
    assert e.value.source == "env LD_LIBRARY_PATH"
    assert why in e.value.message
    assert held(engine) == {}
    # The same container with a sane path is answered, and holds its GPUs.
    ok = make_container(pod, {"name": "main", "env": ["LD_LIBRARY_PATH=/opt/lib"]})
    AccelPlugin(engine).create_container(pod, ok)
    assert len(held(engine)[ok.id]) == 2


def test_an_answer_over_the_message_limit_is_refused_before_anything_is_held(monkeypatch):
    # Whatever makes an adjustment too large for the runtime's connection (here the limit
    # is lowered: no real request reaches 4 MiB once LD_LIBRARY_PATH is bounded), the
    # container is refused naming its largest variable, and nothing is held.
    monkeypatch.setattr(plugin, "MAX_ADJUSTMENT_BYTES", 1000)
    engine = Engine(demo_inventory(), STANDALONE)
    pod = make_pod({"name": "p", "annotations": {KEY: "nvidia.com/gpu: 2"}})
    ctr = make_container(pod, {"name": "main", "env": ["LD_LIBRARY_PATH=" + "/x" * 4000]})
    with pytest.raises(RequestError) as e:
        AccelPlugin(engine).create_container(pod, ctr)
    assert e.value.source == "env LD_LIBRARY_PATH"
    assert "limit of the runtime's NRI connection" in e.value.message
    assert held(engine) == {}
    # where the variable is not most of it, the devices' edits are named, counted
    ctr = make_container(pod, {"name": "main", "env": ["LD_LIBRARY_PATH=/x"]})
    with pytest.raises(RequestError) as e:
        AccelPlugin(engine).create_container(pod, ctr)
    assert e.value.source == "container"
    assert re.search(r"mostly the edits of the devices asked for \(\d+ device nodes, \d+ "
                     r"mounts, \d+ env entries, 0 hooks\)", e.value.message)
    assert held(engine) == {}


def test_a_failed_create_is_freed_by_its_pod_sandbox_ending():
    # crio-1.36.3-failed-create: CreateContainer answered, `runc create` failed, then only
    # StopPodSandbox and RemovePodSandbox.
    engine = Engine(demo_inventory(), STANDALONE)
    accel = AccelPlugin(engine)
    pod = make_pod({"name": "p", "annotations": {KEY: "nvidia.com/gpu: 4"}})
    accel.create_container(pod, make_container(pod, {"name": "main"}))
    other = make_pod({"name": "q", "annotations": {KEY: "nvidia.com/gpu: 1"}})
    accel.create_container(other, make_container(other, {"name": "main"}))
    assert len(held(engine)) == 2
    accel.stop_pod_sandbox(pod)
    assert [len(v) for v in held(engine).values()] == [1]
    accel.remove_pod_sandbox(pod)  # harmless once freed
    assert [len(v) for v in held(engine).values()] == [1]


async def test_the_checkpoint_follows_every_change(tmp_path: Path):
    engine = Engine(demo_inventory(), STANDALONE)
    checkpoint = Checkpoint(str(tmp_path), boot_id="boot-1")
    writer = CheckpointWriter(checkpoint, engine.holdings.snapshot)
    accel = AccelPlugin(engine, writer.changed)
    pod = make_pod({"name": "p", "annotations": {KEY: "nvidia.com/gpu: 1"}})
    ctr = make_container(pod, {"name": "main"})
    # Until a Synchronize, the answer to a create that grants goes out once the
    # checkpoint holds the grant: a plugin killed right after answering restarts knowing
    # it (containerd 1.7 sends a plugin it launched no Synchronize, ever).
    answer = accel.create_container(pod, ctr)
    assert asyncio.iscoroutine(answer) and not (tmp_path / CHECKPOINT_FILE).exists()
    assert isinstance(await answer, bytes)
    doc = json.loads((tmp_path / CHECKPOINT_FILE).read_text())
    assert doc["boot_id"] == "boot-1"
    assert [g["container_id"] for g in doc["grants"]] == [ctr.id]
    accel.remove_container(pod, ctr)
    await writer.flush()
    assert checkpoint.load() == ([], True)
    # Once synchronised, at once: a restart is synchronised again, and reads the grant
    # from the container's annotation.
    await accel.synchronize([pod], [])
    again = make_container(pod, {"name": "main"})
    assert isinstance(accel.create_container(pod, again), bytes)
    assert [len(v) for v in held(engine).values()] == [1]
    await writer.flush()


async def test_a_create_that_replaces_a_grant_and_asks_nothing_writes_the_checkpoint(
        tmp_path: Path):
    # kubelet's retry of a create under the same sandbox and name, its request changed
    # meanwhile (env from a ConfigMap) to ask for nothing: the earlier grant ends, in
    # the holdings and in the checkpoint (a restart without Synchronize reads that).
    engine = Engine(demo_inventory(), STANDALONE)
    checkpoint = Checkpoint(str(tmp_path), boot_id="b")
    writer = CheckpointWriter(checkpoint, engine.holdings.snapshot)
    accel = AccelPlugin(engine, writer.changed)
    pod = make_pod({"name": "p", "annotations": {KEY: "nvidia.com/gpu: 1"}})
    assert isinstance(await accel.create_container(pod, make_container(pod, {"name": "main"})),
                      bytes)
    assert [g.container_id for g in checkpoint.load()[0]] != []
    retried = make_pod({"name": "p", "annotations": {KEY: ""}})
    assert retried.id == pod.id
    answer = accel.create_container(retried, make_container(retried, {"name": "main",
                                                                       "id": "retry-1"}))
    assert isinstance(await answer, bytes)  # once the checkpoint says the grant ended
    assert held(engine) == {}
    assert checkpoint.load() == ([], True)


async def test_a_large_create_that_grants_waits_for_the_checkpoint_too(tmp_path: Path):
    engine = Engine(demo_inventory(), STANDALONE)
    writer = CheckpointWriter(Checkpoint(str(tmp_path), boot_id="b"), engine.holdings.snapshot)
    accel = AccelPlugin(engine, writer.changed)
    pod = make_pod({"name": "p", "annotations": {KEY: "nvidia.com/gpu: 1"}})
    ctr = make_container(pod, {"name": "main", "env": [f"V{i}=x" for i in range(20_000)]})
    payload = pb.CreateContainerRequest(pod=pod, container=ctr).SerializeToString()
    req = accel.request_decoders["CreateContainer"](payload)
    assert convert.is_large(req.container)  # read a run of fields at a time
    answer = await accel.create_container(req.pod, req.container)
    assert pb.ContainerAdjustment.FromString(answer).linux.devices
    grants, _ = Checkpoint(str(tmp_path), boot_id="b").load()
    assert [g.container_id for g in grants] == [ctr.id]


async def test_an_unreadable_checkpoint_stays_unknown_across_restarts_until_synchronize(
        tmp_path: Path):
    # Seen against containerd 1.7.24 (tests/e2e): it never synchronises a plugin it
    # launches, so nothing but the checkpoint says what runs. Each start of `run` writes
    # the checkpoint before it serves (as plugin._run does); that write must keep "not known",
    # or the next restart reads "nothing held" and a count takes a held GPU.
    (tmp_path / CHECKPOINT_FILE).write_text("{garbage")
    pod = make_pod({"name": "p", "annotations": {KEY: "nvidia.com/gpu: 1"}})
    named = make_pod({"name": "n", "annotations": {KEY: "nvidia.com/gpu=2"}})
    named_ctr = make_container(named, {"name": "main"})
    for _ in range(3):  # the start after the unreadable file, then two more
        engine = Engine(demo_inventory(), STANDALONE)
        checkpoint = Checkpoint(str(tmp_path), boot_id="boot-1")
        engine.load_checkpoint(*checkpoint.load())
        writer = CheckpointWriter(checkpoint, engine.holdings.snapshot,
                                  known=lambda e=engine: e.holdings.known)
        accel = AccelPlugin(engine, writer.changed)
        writer.changed()
        await writer.flush()
        # no device is granted exclusively, counted or named: a container nri-accel no
        # longer knows of may hold it
        for p, ctr in ((pod, make_container(pod, {"name": "main"})), (named, named_ctr)):
            with pytest.raises(RequestError) as e:
                accel.create_container(p, ctr)
            assert e.value.status == "UNAVAILABLE"
            assert "is not known" in e.value.message
        assert held(engine) == {}
        assert json.loads((tmp_path / CHECKPOINT_FILE).read_text())["known"] is False
    # A Synchronize says what runs: the state is known from then on, and stays so.
    await accel.synchronize([named], [])
    await writer.flush()
    grants, known = Checkpoint(str(tmp_path), boot_id="boot-1").load()
    assert known and grants == []
    accel.create_container(named, named_ctr)  # synchronised: answered at once
    assert held(engine) == {named_ctr.id: ("nvidia.com/gpu=2",)}


async def test_a_synchronize_listing_a_grant_it_cannot_read_leaves_the_state_unknown():
    engine = Engine(demo_inventory(), STANDALONE)
    accel = AccelPlugin(engine)
    pod = make_pod({"name": "p"})
    bad = make_container(pod, {"name": "bad",
                               "annotations": {"nri-accel.io/granted": "garbage"}})
    with capture_logs() as logs:
        await accel.synchronize([pod], [bad])
    (line,) = [e for e in logs if e["event"] == "grant_state_unknown"]
    assert (line["containers"], line["container_ids"]) == (1, [bad.id])
    asking = make_pod({"name": "a", "annotations": {KEY: "nvidia.com/gpu=1"}})
    with pytest.raises(RequestError) as e:
        accel.create_container(asking, make_container(asking, {"name": "main"}))
    assert e.value.status == "UNAVAILABLE"
    await accel.synchronize([pod], [])  # once it is gone, the state is known again
    assert accel.create_container(asking, make_container(asking, {"name": "main"}))


async def test_a_checkpoint_that_cannot_be_written_is_an_error_not_a_crash(tmp_path: Path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    writer = CheckpointWriter(Checkpoint(str(blocker)), lambda: ())
    written = writer.changed()
    await writer.flush()
    assert writer.failures == 1
    assert written.result() is False


async def test_before_a_synchronize_a_grant_the_checkpoint_could_not_keep_is_refused(
        tmp_path: Path):
    # the answer waits for the checkpoint (no Synchronize will say what runs after a
    # restart): where the write fails, the container is refused and holds nothing,
    # rather than answered with a grant the next start would not know of
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    engine = Engine(demo_inventory(), STANDALONE)
    writer = CheckpointWriter(Checkpoint(str(blocker)), engine.holdings.snapshot)
    accel = AccelPlugin(engine, writer.changed)
    pod = make_pod({"name": "p", "annotations": {KEY: "nvidia.com/gpu=1"}})
    ctr = make_container(pod, {"name": "main"})
    with pytest.raises(RequestError) as e:
        await accel.create_container(pod, ctr)
    assert e.value.status == "UNAVAILABLE"
    assert "could not be written to the grant checkpoint" in e.value.message
    assert held(engine) == {}
    counts, _, _ = accel.requests["create_container"].snapshot()
    assert (counts["ok"], counts["refused"]) == (0, 1)  # counted once, as refused
    await writer.flush()
    # where it can be written, the same container is answered once it is
    ok = CheckpointWriter(Checkpoint(str(tmp_path)), engine.holdings.snapshot)
    assert await AccelPlugin(engine, ok.changed).create_container(pod, ctr)
    assert held(engine) == {ctr.id: ("nvidia.com/gpu=1",)}


def test_the_status_record_tells_the_device_plugin_whether_run_is_registered(tmp_path: Path):
    assert NriStatus.load(str(tmp_path)).usable() is False
    assert "no `nri-accel run`" in NriStatus.load(str(tmp_path)).why_not()
    now = boottime()
    NriStatus(True, "containerd v2.3.4", "40-nri-accel", 123, now).save(str(tmp_path))
    status = NriStatus.load(str(tmp_path))
    assert status.usable(now + 1) and status.why_not(now + 1) == ""
    assert not status.usable(now + NriStatus.STALE + 1)
    assert "stopped updating its state" in status.why_not(now + NriStatus.STALE + 1)
    NriStatus(False, "", "40-nri-accel", 123, now).save(str(tmp_path))
    assert "not registered" in NriStatus.load(str(tmp_path)).why_not(now)
    (tmp_path / "nri-plugin.json").write_text("{garbage")
    assert NriStatus.load(str(tmp_path)).usable() is False


async def test_writes_coalesce_while_one_is_in_flight(tmp_path: Path):
    engine = Engine(demo_inventory(), STANDALONE)
    checkpoint = Checkpoint(str(tmp_path), boot_id="b")
    saves: list[str] = []
    real_save = checkpoint.save

    def save(text: str) -> None:
        saves.append(text)
        real_save(text)

    checkpoint.save = save  # type: ignore[method-assign]
    writer = CheckpointWriter(checkpoint, engine.holdings.snapshot)
    accel = AccelPlugin(engine, writer.changed)
    answers = []
    for i in range(20):
        pod = make_pod({"name": f"p{i}", "annotations": {KEY: "nvidia.com/gpu=0"}})
        engine.holdings.replace_all([])  # each create the only one
        answers.append(accel.create_container(pod, make_container(pod, {"name": "main"})))
    await asyncio.gather(*answers)  # each answered once a write after it has finished
    assert 1 <= len(saves) < 20
    await asyncio.sleep(0)
