"""The adjustment builder: ContainerEdits -> the ContainerAdjustment the runtime applies."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from nri_accel.inventory import ContainerEdits, DeviceNode, Hook, Mount
from nri_accel.nri import adjust
from nri_accel.nri import nri_pb2 as pb

GPU0 = DeviceNode("/dev/nvidia0", 195, 0)
CTL = DeviceNode("/dev/nvidiactl", 195, 255, file_mode=0o666, uid=0, gid=44)
LOOP = DeviceNode("/dev/loop7", 7, 7, type="b")
LIB = Mount("/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15",
            "/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15")
SMI = Mount("/usr/bin/nvidia-smi", "/usr/bin/nvidia-smi")
SOCK = Mount("/run/nvidia-persistenced/socket", "/run/nvidia-persistenced/socket")
HOOK = Hook("createContainer", "/usr/libexec/nri-accel/ldcache", ("ldcache", "--update"),
            ("PATH=/usr/bin",), timeout=5)

EDITS = ContainerEdits(
    env=("NVIDIA_VISIBLE_DEVICES=GPU-1", "NVIDIA_DRIVER_CAPABILITIES=compute,utility"),
    device_nodes=(GPU0, CTL, LOOP),
    mounts=(LIB, SMI, SOCK),
    hooks=(HOOK,),
)


def test_devices_mounts_env_hooks_annotations_and_cdi_names() -> None:
    adj = adjust.build_adjustment(EDITS, {"nri-accel.io/granted": "nvidia.com/gpu=0"},
                                  ("vendor.example/npu=b", "vendor.example/npu=a"))
    devices = {d.path: d for d in adj.linux.devices}
    assert devices["/dev/nvidia0"] == pb.LinuxDevice(path="/dev/nvidia0", type="c",
                                                     major=195, minor=0)
    ctl = devices["/dev/nvidiactl"]
    assert (ctl.file_mode.value, ctl.uid.value, ctl.gid.value) == (0o666, 0, 44)
    assert ctl.HasField("uid")  # uid 0 is set, not absent
    assert not devices["/dev/nvidia0"].HasField("file_mode")
    assert devices["/dev/loop7"].type == "b"
    assert {(m.source, m.destination, m.type, tuple(m.options)) for m in adj.mounts} == {
        (m.host_path, m.container_path, "bind", ("ro", "nosuid", "nodev", "bind"))
        for m in (LIB, SMI, SOCK)}
    assert [(e.key, e.value) for e in adj.env] == [
        ("NVIDIA_VISIBLE_DEVICES", "GPU-1"), ("NVIDIA_DRIVER_CAPABILITIES", "compute,utility")]
    (hook,) = adj.hooks.create_container
    assert (hook.path, list(hook.args), list(hook.env), hook.timeout.value) == (
        HOOK.path, list(HOOK.args), list(HOOK.env), 5)
    assert not adj.hooks.prestart and not adj.hooks.poststart
    assert dict(adj.annotations) == {"nri-accel.io/granted": "nvidia.com/gpu=0"}
    assert [d.name for d in adj.CDI_devices] == ["vendor.example/npu=a", "vendor.example/npu=b"]


def test_no_cgroup_rule_is_added_the_runtime_derives_it_from_the_device() -> None:
    adj = adjust.build_adjustment(EDITS)
    assert not adj.linux.HasField("resources")


@pytest.mark.parametrize("point, field", sorted(adjust.HOOK_FIELDS.items()))
def test_each_oci_hook_point_lands_in_its_field(point: str, field: str) -> None:
    adj = adjust.build_adjustment(ContainerEdits(hooks=(Hook(point, "/bin/true"),)))
    assert [h.path for h in getattr(adj.hooks, field)] == ["/bin/true"]
    assert not getattr(adj.hooks, field)[0].HasField("timeout")


def test_unknown_hook_point_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"'preStart'.*createRuntime"):
        adjust.build_adjustment(ContainerEdits(hooks=(Hook("preStart", "/bin/true"),)))


def test_same_input_in_any_order_gives_identical_bytes() -> None:
    reference = adjust.build_adjustment(EDITS, {"b": "2", "a": "1"}).SerializeToString(
        deterministic=True)
    rng = random.Random(7)
    for _ in range(20):
        nodes, mounts = list(EDITS.device_nodes), list(EDITS.mounts)
        rng.shuffle(nodes)
        rng.shuffle(mounts)
        edits = ContainerEdits(env=EDITS.env, device_nodes=tuple(nodes), mounts=tuple(mounts),
                               hooks=EDITS.hooks)
        got = adjust.build_adjustment(edits, {"a": "1", "b": "2"})
        assert got.SerializeToString(deterministic=True) == reference


def test_parent_mounts_come_before_their_children() -> None:
    parent = Mount("/opt/drv", "/usr/local/nvidia")
    child = Mount("/opt/drv/lib64", "/usr/local/nvidia/lib64")
    adj = adjust.build_adjustment(ContainerEdits(mounts=(child, SMI, parent)))
    assert [m.destination for m in adj.mounts] == [
        "/usr/bin/nvidia-smi", "/usr/local/nvidia", "/usr/local/nvidia/lib64"]


def test_each_key_appears_once_because_the_runtime_refuses_a_second_claim() -> None:
    twin = DeviceNode("/dev/nvidia0", 195, 7)
    edits = ContainerEdits(env=("A=1", "A=2"), device_nodes=(GPU0, twin),
                           mounts=(SMI, Mount("/elsewhere", SMI.container_path)))
    adj = adjust.build_adjustment(edits, cdi_devices=("x.example/y=1", "x.example/y=1"))
    assert [(d.path, d.minor) for d in adj.linux.devices] == [("/dev/nvidia0", 0)]
    assert [m.source for m in adj.mounts] == [SMI.host_path]
    assert [(e.key, e.value) for e in adj.env] == [("A", "1")]
    assert len(adj.CDI_devices) == 1


def test_nothing_to_do_is_an_empty_adjustment() -> None:
    adj = adjust.build_adjustment(ContainerEdits())
    assert adj.SerializeToString() == b""
    assert adjust.to_dict(adj) == {}


def test_json_matches_what_the_runtime_received_from_the_device_injector(
    nri_wire_dir: Path,
) -> None:
    """The same devices and mounts as create-devinj's adjustment render to the same
    protobuf JSON (protojson names, int64 as strings) as the Go side recorded."""
    recorded = json.loads((nri_wire_dir / "create-devinj.adjustment.json").read_text())["adjust"]
    edits = ContainerEdits(
        device_nodes=(
            DeviceNode("/dev/fakeaccel0", 240, 0),
            DeviceNode("/dev/fakeaccel1", 240, 1, file_mode=0o660, uid=1000, gid=1000),
            DeviceNode("/dev/nri-null", 1, 3),
            DeviceNode("/dev/nri-loop7", 7, 7, type="b"),
        ),
        mounts=(
            Mount("/srv/nri-harness/share", "/mnt/share", options=("bind", "ro")),
            Mount("tmpfs", "/mnt/scratch", type="tmpfs", options=("nosuid", "nodev", "size=16m")),
        ),
    )
    ours = json.loads(adjust.to_json(adjust.build_adjustment(edits)))

    def key(item: dict) -> str:
        return item.get("path") or item["destination"]

    assert sorted(ours["linux"]["devices"], key=key) == sorted(recorded["linux"]["devices"],
                                                               key=key)
    assert sorted(ours["mounts"], key=key) == sorted(recorded["mounts"], key=key)


def test_json_uses_protojson_names() -> None:
    text = adjust.to_json(adjust.build_adjustment(EDITS, cdi_devices=("a.b/c=d",)))
    data = json.loads(text)
    assert "CDIDevices" in data and "fileMode" in data["linux"]["devices"][-1]
    assert data["hooks"]["createContainer"][0]["timeout"] == {"value": "5"}
    assert text == adjust.to_json(adjust.build_adjustment(EDITS, cdi_devices=("a.b/c=d",)))


def _gpus(n: int, env: tuple[str, ...] = ()) -> ContainerEdits:
    """The edits of a grant of `n` GPUs (their nodes and NVIDIA_VISIBLE_DEVICES, 41
    characters a UUID), and `env` more."""
    uuids = ",".join(f"GPU-{i:08x}-0000-4000-8000-{i:012x}" for i in range(n))
    return ContainerEdits(env=(f"NVIDIA_VISIBLE_DEVICES={uuids}", *env),
                          device_nodes=(*(DeviceNode(f"/dev/nvidia{i}", 195, i)
                                          for i in range(n)), CTL),
                          mounts=(LIB, SMI))


def test_the_encoding_of_a_grant_of_hundreds_of_gpus_is_remembered() -> None:
    # A grant of 256 GPUs has an env of 10 KiB and an encoding of 20 KiB: remembered, it
    # is built once (an env over 4,096 characters was built again each time: 1.5 ms a
    # create on the 512-GPU node of bench_hotpath.py, 0.5 ms now).
    adjust._ENCODED.clear()
    edits = _gpus(256)
    first = adjust.encode_adjustment(edits)
    assert adjust.encode_adjustment(edits) is first
    assert adjust._ENCODED.held_chars == len(first) + sum(map(len, edits.env))
    assert len(pb.ContainerAdjustment.FromString(first).linux.devices) == 257


def test_an_encoding_made_large_by_the_containers_own_env_is_not_remembered() -> None:
    # The container's LD_LIBRARY_PATH comes back extended: 120 KiB of it (the kernel
    # passes up to 128 KiB) makes an entry over MEMO_LARGEST, built each time.
    adjust._ENCODED.clear()
    edits = _gpus(1, ("LD_LIBRARY_PATH=/lib:" + "x" * (120 << 10),))
    first = adjust.encode_adjustment(edits)
    assert adjust.encode_adjustment(edits) == first
    assert len(adjust._ENCODED) == 0


def test_the_encodings_remembered_are_bounded_by_their_bytes() -> None:
    # Distinct 60 KiB LD_LIBRARY_PATHs (each under MEMO_LARGEST): the memo starts over
    # rather than hold more than MEMO_BYTES.
    adjust._ENCODED.clear()
    for i in range(200):
        adjust.encode_adjustment(_gpus(1, (f"LD_LIBRARY_PATH=/lib{i}:" + "x" * (60 << 10),)))
        assert adjust._ENCODED.held_chars <= adjust.MEMO_BYTES
    assert 0 < len(adjust._ENCODED) < 200
