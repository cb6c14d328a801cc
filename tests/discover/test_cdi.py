"""CDI specs: reading (validation, priorities, host nodes) and writing (round trip)."""

from __future__ import annotations

import json
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
import yaml
from fakes.roots import materialise
from hosttree import HostTree

from nri_accel.edits import MAX_EDITS
from nri_accel.inventory import ContainerEdits, Device, DeviceNode, Driver, Hook, Inventory, Mount
from nri_accel.vendors.cdi.spec import (
    discover_cdi,
    generate_specs,
    min_version,
    render_spec,
    spec_file_name,
)
from nri_accel.vendors.neuron import discover_neuron
from nri_accel.vendors.nvidia import KIND_GPU, KIND_MIG

DIRS = ("/etc/cdi", "/var/run/cdi")


def _spec(**over: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "cdiVersion": "0.6.0",
        "kind": "acme.example/npu",
        "devices": [{"name": "npu0", "containerEdits": {"deviceNodes": [{"path": "/dev/npu0"}]}},
                    {"name": "npu1", "containerEdits": {"deviceNodes": [{"path": "/dev/npu1"}]}}],
    }
    spec.update(over)
    return spec


def _tree(tmp_path: Path) -> HostTree:
    tree = HostTree(tmp_path / "node")
    tree.chardev("/dev/npu0", 240, 0)
    tree.chardev("/dev/npu1", 240, 1)
    tree.chardev("/dev/npu-ctl", 240, 255)
    return tree


def _write(tree: HostTree, host_path: str, spec: Any) -> None:
    if host_path.endswith(".json"):
        tree.file(host_path, json.dumps(spec))
    else:
        tree.file(host_path, yaml.safe_dump(spec))


def test_cdi_only_root(tmp_path: Path) -> None:
    found = discover_cdi(materialise("cdi-only", tmp_path / "node"), DIRS)
    assert [d.qualified_name for d in found.devices] == [
        "amd.com/gpu=0", "amd.com/gpu=1", "habana.ai/gaudi=0", "habana.ai/gaudi=1"]
    amd0 = found.devices[0]
    assert amd0.edits.device_nodes == (DeviceNode("/dev/dri/card1", 226, 1),
                                       DeviceNode("/dev/dri/renderD128", 226, 128))
    assert amd0.vendor == "cdi:/etc/cdi/amd.json"
    assert amd0.attributes["origin"] == "/etc/cdi/amd.json"
    drivers = {d.vendor: d for d in found.drivers}
    assert drivers["cdi:/etc/cdi/amd.json"].capabilities[""].device_nodes == (
        DeviceNode("/dev/kfd", 235, 0),)
    gaudi = drivers["cdi:/var/run/cdi/habana.ai-gaudi.yaml"]
    assert gaudi.version == "0.5.0"
    assert gaudi.capabilities[""].env == ("HABANA_LOGS=/var/log/habana_logs",)
    assert gaudi.capabilities[""].mounts == (
        Mount("/usr/lib/habanalabs", "/usr/lib/habanalabs"),)
    # the malformed spec is one problem and stops nothing; README.txt is not a spec
    assert [p.source for p in found.problems] == ["/etc/cdi/broken.yaml"]
    assert "deviceNodes[0].path" in found.problems[0].message


def test_json_and_yaml_read_the_same(tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    _write(tree, "/etc/cdi/a.json", _spec())
    _write(tree, "/var/run/cdi/b.yaml", _spec(kind="acme.example/tpu"))
    found = discover_cdi(tree.root, DIRS)
    npu = [d.edits for d in found.devices if d.kind == "acme.example/npu"]
    tpu = [d.edits for d in found.devices if d.kind == "acme.example/tpu"]
    assert npu == tpu and len(npu) == 2


def test_later_directory_wins_without_a_problem(tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    _write(tree, "/etc/cdi/npu.yaml", _spec(containerEdits={"env": ["FROM=etc"]}))
    _write(tree, "/var/run/cdi/npu.yaml", _spec(devices=[
        {"name": "npu0", "containerEdits": {"deviceNodes": [{"path": "/dev/npu0"}],
                                            "env": ["GEN=1"]}}]))
    found = discover_cdi(tree.root, DIRS)
    by_name = {d.name: d for d in found.devices}
    assert by_name["npu0"].edits.env == ("GEN=1",)
    assert by_name["npu0"].vendor == ""  # the /var/run spec has no spec-level edits
    assert by_name["npu1"].vendor == "cdi:/etc/cdi/npu.yaml"
    assert found.problems == ()
    assert [d.vendor for d in found.drivers] == ["cdi:/etc/cdi/npu.yaml"]


def test_same_priority_conflict_drops_the_device_and_blames_both_files(tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    _write(tree, "/etc/cdi/a.yaml", _spec())
    _write(tree, "/etc/cdi/b.json", _spec(devices=[
        {"name": "npu1", "containerEdits": {"env": ["X=1"]}}]))
    found = discover_cdi(tree.root, DIRS)
    assert [d.name for d in found.devices] == ["npu0"]
    assert [(p.source, "acme.example/npu=npu1" in p.message) for p in found.problems] == [
        ("/etc/cdi/a.yaml", True), ("/etc/cdi/b.json", True)]


BAD_SPECS = [
    (_spec(kind="acme"), "kind: 'acme' must be vendor/class"),
    (_spec(kind="acme.example/npu/x"), "must be vendor/class"),
    (_spec(kind="1acme.example/npu"), "vendor '1acme.example' must start with a letter"),
    (_spec(kind="acme.example/np*u"), "class 'np*u' may hold only"),
    (_spec(devices=[]), "devices: a spec must define at least one device"),
    (_spec(devices=[{"name": "-x", "containerEdits": {"env": ["A=1"]}}]),
     "devices[0].name: '-x' is not a device name"),
    # CDI's grammar allows it, but "npu::1" is what kubelet names replica 1 of "npu"
    (_spec(devices=[{"name": "npu::1", "containerEdits": {"env": ["A=1"]}}]),
     "devices[0].name: 'npu::1' is not a device name (letters, digits, '_', '-', '.', ':'; "
     "starting and ending with a letter or digit; no '::'"),
    (_spec(devices=[{"name": "a", "containerEdits": {"env": ["A=1"]}},
                    {"name": "a", "containerEdits": {"env": ["A=2"]}}]),
     "devices[1].name: device 'a' is defined twice"),
    (_spec(devices=[{"name": "a"}]), "devices[0].containerEdits: a device needs at least one"),
    (_spec(devices=[{"name": "a", "containerEdits": {"env": ["=1"]}}]),
     "devices[0].containerEdits.env: '=1' is not KEY=VALUE"),
    (_spec(extra=1), "extra: unknown field"),
    (_spec(devices=[{"name": "a", "containerEdits": {"deviceNodes": [
        {"path": "/dev/npu0", "hostpath": "/dev/npu0"}]}}]),
     "devices[0].containerEdits.deviceNodes[0].hostpath: unknown field"),
    (_spec(devices=[{"name": "a", "containerEdits": {"deviceNodes": [
        {"path": "/dev/npu0", "hostPath": "dev/npu0"}]}}]),
     "deviceNodes[0].hostPath: 'dev/npu0' must be an absolute path without '..'"),
    (_spec(devices=[{"name": "a", "containerEdits": {"deviceNodes": [
        {"path": "/dev/../etc/shadow"}]}}]), "must be an absolute path without '..'"),
    (_spec(devices=[{"name": "a", "containerEdits": {"deviceNodes": [
        {"path": "/dev/npu0", "permissions": "rwx"}]}}]), "permissions: 'rwx' must be made"),
    (_spec(devices=[{"name": "a", "containerEdits": {"deviceNodes": [
        {"path": "/dev/npu0", "permissions": "None"}]}}]), "permissions: 'None' must be made"),
    (_spec(devices=[{"name": "a", "containerEdits": {"deviceNodes": [
        {"path": "/dev/npu0", "major": -1}]}}]), "major: must be an integer >= 0"),
    (_spec(devices=[{"name": "a", "containerEdits": {"deviceNodes": [
        {"path": "/dev/npu0", "type": "p"}]}}]), "FIFO device nodes are not supported"),
    # Spec-level edits nri_accel.edits refuses make the whole file unusable.
    (_spec(containerEdits={"mounts": [{"hostPath": "/lib", "containerPath": "/proc/x"}]}),
     "containerEdits.mounts[0]: mount destination '/proc/x' is /, or under /proc or /sys"),
    (_spec(containerEdits={"mounts": [{"hostPath": "/lib", "containerPath": "/sys"}]}),
     "mount destination '/sys' is /, or under /proc or /sys"),
    (_spec(containerEdits={"mounts": [{"hostPath": "/var/lib/kubelet/device-plugins",
                                       "containerPath": "/var/lib/kubelet/device-plugins"}]}),
     "containerEdits.mounts[0]: mount source '/var/lib/kubelet/device-plugins' is under "
     "/var/lib/kubelet: kubelet state"),
    (_spec(containerEdits={"mounts": [{"hostPath": "/sys/class/drm", "containerPath": "/drm"}]}),
     "mount source '/sys/class/drm' is under /sys: sysfs"),
    (_spec(containerEdits={"env": ["LD_PRELOAD=/opt/acme/hook.so"]}),
     "containerEdits.env[0]: env LD_PRELOAD may not be set by nri-accel"),
    (_spec(containerEdits={"mounts": [{"hostPath": "tmpfs", "containerPath": "/scratch",
                                       "type": "tmpfs"}]}, cdiVersion="0.3.0"),
     "cdiVersion: 0.3.0 is too old for what the spec uses (needs at least 0.4.0)"),
    (_spec(containerEdits={"mounts": [{"containerPath": "/scratch", "type": "tmpfs"}]}),
     "containerEdits.mounts[0].hostPath: required"),
    (_spec(containerEdits={"mounts": [{"hostPath": "", "containerPath": "/scratch",
                                       "type": "tmpfs"}]}),
     "containerEdits.mounts[0].hostPath: required (the source"),
    (_spec(containerEdits={"deviceNodes": [{"path": "/dev/npu-ctl", "permissions": "rx"}]}),
     "containerEdits.deviceNodes[0].permissions: 'rx' must be made of r, w, m"),
    (_spec(containerEdits={"mounts": [{"hostPath": "lib", "containerPath": "/lib"}]}),
     "mounts[0].hostPath: 'lib' must be an absolute path"),
    (_spec(containerEdits={"hooks": [{"hookName": "preStart", "path": "/bin/true"}]}),
     "hooks[0].hookName: 'preStart' is not one of"),
    (_spec(containerEdits={"hooks": [{"hookName": "createContainer", "path": "true"}]}),
     "hooks[0].path: 'true' must be an absolute path"),
    (_spec(containerEdits={"hooks": [{"hookName": "poststop", "path": "/bin/true",
                                      "timeout": 0}]}), "timeout: must be an integer > 0"),
    (_spec(containerEdits={"hooks": [{"hookName": "poststop", "path": "/bin/true",
                                      "env": ["PATH"]}]}), "hooks[0].env: 'PATH' is not"),
    (_spec(containerEdits={"intelRdt": {"closID": "x"}}), "intelRdt: not supported"),
    (_spec(containerEdits={"netDevices": [{"hostInterfaceName": "a", "name": "b"}]},
           cdiVersion="1.1.0"), "netDevices: not supported"),
    (_spec(cdiVersion="0.2.0"), "cdiVersion: '0.2.0' is not a CDI version nri-accel reads"),
    (_spec(cdiVersion=0.6), "cdiVersion: must be a string"),
    (_spec(kind="acme.example/n.pu", cdiVersion="0.5.0"),
     "cdiVersion: 0.5.0 is too old for what the spec uses (needs at least 0.6.0)"),
    (_spec(cdiVersion="0.4.0", kind="acme/npu", devices=[{"name": "a", "containerEdits": {
        "deviceNodes": [{"path": "/dev/x", "hostPath": "/dev/npu0"}]}}]),
     "needs at least 0.5.0"),
    (_spec(cdiVersion="0.3.0", kind="acme/npu", devices=[{"name": "a", "containerEdits": {
        "mounts": [{"hostPath": "/a", "containerPath": "/a", "type": "bind"}]}}]),
     "needs at least 0.4.0"),
    (_spec(cdiVersion="0.6.0", containerEdits={"additionalGids": [44]}), "needs at least 0.7.0"),
    (["not", "a", "mapping"], "the spec must be a mapping"),
]


@pytest.mark.parametrize(("spec", "message"), BAD_SPECS)
def test_invalid_spec_is_one_problem_and_does_not_stop_others(
        tmp_path: Path, spec: Any, message: str) -> None:
    tree = _tree(tmp_path)
    _write(tree, "/etc/cdi/bad.yaml", spec)
    _write(tree, "/etc/cdi/good.json", _spec(kind="acme.example/good"))
    found = discover_cdi(tree.root, DIRS)
    assert [d.qualified_name for d in found.devices] == [
        "acme.example/good=npu0", "acme.example/good=npu1"]
    assert len(found.problems) == 1
    assert found.problems[0].source == "/etc/cdi/bad.yaml"
    assert message in found.problems[0].message


def test_0_6_0_minimum_comes_from_the_class_not_the_vendor_domain(tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    # device names starting with a letter, no hostPath: 0.3.0 suffices for acme.example/npu
    _write(tree, "/etc/cdi/npu.yaml", _spec(cdiVersion="0.3.0"))
    found = discover_cdi(tree.root, DIRS)
    assert (len(found.devices), found.problems) == (2, ())


@pytest.mark.parametrize(("name", "text", "message"), [
    ("x.json", "{", "not valid JSON"),
    ("x.yaml", "devices: [", "not valid YAML"),
    ("x.yaml", "", "the spec must be a mapping"),
    ("x.yaml", b"\xff\xfe", "not UTF-8"),
])
def test_unparsable_files(tmp_path: Path, name: str, text: str | bytes, message: str) -> None:
    tree = _tree(tmp_path)
    p = tree.path(f"/etc/cdi/{name}")
    p.parent.mkdir(parents=True)
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    found = discover_cdi(tree.root, DIRS)
    assert found.devices == ()
    assert found.problems[0].source == f"/etc/cdi/{name}"
    assert message in found.problems[0].message


def test_numbers_in_the_spec_must_match_the_host_node(tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    _write(tree, "/etc/cdi/npu.yaml", _spec(devices=[
        {"name": "npu0", "containerEdits": {"deviceNodes": [
            {"path": "/dev/npu0", "type": "c", "major": 240, "minor": 0}]}},
        {"name": "npu1", "containerEdits": {"deviceNodes": [
            {"path": "/dev/npu1", "type": "c", "major": 240, "minor": 9}]}},
        {"name": "npu2", "containerEdits": {"deviceNodes": [
            {"path": "/dev/npu-ctl", "type": "b"}]}},
    ]))
    found = discover_cdi(tree.root, DIRS)
    assert [d.name for d in found.devices] == ["npu0"]
    messages = [p.message for p in found.problems]
    assert "device acme.example/npu=npu1 left out" in messages[0]
    assert "the spec says 240:9, the host node is 240:1" in messages[0]
    assert "the spec says type 'b', the host node is 'c'" in messages[1]


def test_missing_or_symlinked_nodes(tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    tree.symlink("/dev/npu/by-path/1", "../../npu1")
    _write(tree, "/etc/cdi/npu.yaml", _spec(devices=[
        {"name": "npu0", "containerEdits": {"deviceNodes": [{"path": "/dev/npu0"}]}},
        {"name": "npu1", "containerEdits": {"deviceNodes": [{"path": "/dev/npu/by-path/1"}]}},
        {"name": "npu7", "containerEdits": {"deviceNodes": [{"path": "/dev/npu7"}]}},
    ]))
    _write(tree, "/etc/cdi/other.yaml", _spec(kind="acme.example/other", containerEdits={
        "deviceNodes": [{"path": "/dev/other-ctl"}]}))
    found = discover_cdi(tree.root, DIRS)
    # npu1's node is a symlink: left out; npu7's is missing: listed, unhealthy, no edits
    assert [(d.qualified_name, d.healthy) for d in found.devices] == [
        ("acme.example/npu=npu0", True), ("acme.example/npu=npu7", False)]
    npu7 = found.devices[1]
    assert npu7.attributes["health"] == "device node /dev/npu7 does not exist"
    assert not npu7.edits
    by_source: dict[str, list[str]] = {}
    for p in found.problems:
        by_source.setdefault(p.source, []).append(p.message)
    assert "is a symlink" in by_source["/etc/cdi/npu.yaml"][0]
    assert by_source["/etc/cdi/npu.yaml"][1] == (
        "device acme.example/npu=npu7 is unhealthy: device node /dev/npu7 does not exist")
    # a spec-level node that is missing makes the whole file unusable
    assert by_source["/etc/cdi/other.yaml"] == [
        "containerEdits: device node /dev/other-ctl: device node does not exist"]


def test_host_path_permissions_ids_and_hooks_are_kept(tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    _write(tree, "/etc/cdi/npu.yaml", _spec(cdiVersion="0.7.0", devices=[
        {"name": "npu0", "containerEdits": {
            "deviceNodes": [{"path": "/dev/accel0", "hostPath": "/dev/npu0", "permissions": "rw",
                             "fileMode": 0o660, "uid": 0, "gid": 44, "type": "u"}],
            "additionalGids": [0, 44],
            "hooks": [{"hookName": "createContainer", "path": "/usr/bin/acme-hook",
                       "args": ["acme-hook", "setup"], "env": ["A=1"], "timeout": 5}],
        }}]))
    (device,) = discover_cdi(tree.root, DIRS).devices
    assert device.edits.device_nodes == (DeviceNode(
        "/dev/accel0", 240, 0, host_path="/dev/npu0", permissions="rw", file_mode=0o660,
        uid=0, gid=44),)
    assert device.edits.additional_gids == (44,)  # 0 is ignored, as the spec says
    assert device.edits.hooks == (Hook("createContainer", "/usr/bin/acme-hook",
                                       ("acme-hook", "setup"), ("A=1",), 5),)


def test_mount_options_are_kept_or_default_to_read_only(tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    _write(tree, "/etc/cdi/npu.yaml", _spec(containerEdits={"mounts": [
        {"hostPath": "/opt/acme/lib", "containerPath": "/usr/lib/acme"},
        {"hostPath": "/run/acme.sock", "containerPath": "/run/acme.sock",
         "options": ["rbind", "rw"], "type": "none"}]}))
    (driver,) = discover_cdi(tree.root, DIRS).drivers
    assert driver.capabilities[""].mounts == (
        Mount("/opt/acme/lib", "/usr/lib/acme", "bind", ("ro", "nosuid", "nodev", "bind")),
        Mount("/run/acme.sock", "/run/acme.sock", "none", ("rbind", "rw")))


def test_tmpfs_mounts_are_read_with_a_source_name_and_options(tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    _write(tree, "/etc/cdi/npu.yaml", _spec(cdiVersion="0.4.0", kind="acme/npu", devices=[
        {"name": "npu0", "containerEdits": {
            "deviceNodes": [{"path": "/dev/npu0"}],
            "mounts": [
                {"hostPath": "tmpfs", "containerPath": "/var/cache/acme", "type": "tmpfs",
                 "options": ["size=64m", "mode=1777", "rw"]},
                {"hostPath": "none", "containerPath": "/scratch", "type": "tmpfs"}]}}]))
    found = discover_cdi(tree.root, DIRS)
    assert found.problems == ()
    (device,) = found.devices
    # Kept as written (the catalog forces nosuid, nodev); no options: nosuid, nodev.
    assert device.edits.mounts == (
        Mount("tmpfs", "/var/cache/acme", "tmpfs", ("size=64m", "mode=1777", "rw")),
        Mount("none", "/scratch", "tmpfs", ("nosuid", "nodev")))


def _problems(found: Any) -> list[str]:
    return [p.message for p in found.problems]


def test_a_device_whose_permissions_nri_cannot_honour_is_left_out(tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    tree.chardev("/dev/npu2", 240, 2)
    tree.chardev("/dev/npu3", 240, 3)
    _write(tree, "/etc/cdi/npu.yaml", _spec(devices=[
        {"name": "npu0", "containerEdits": {"deviceNodes": [
            {"path": "/dev/npu0", "permissions": "r"}]}},
        {"name": "npu1", "containerEdits": {"deviceNodes": [
            {"path": "/dev/npu1", "permissions": "none"}]}},
        {"name": "npu2", "containerEdits": {"deviceNodes": [
            {"path": "/dev/npu2", "permissions": "wrr"}]}},  # pkg/cdi accepts repeats
        {"name": "npu3", "containerEdits": {"deviceNodes": [
            {"path": "/dev/npu3", "permissions": "mwr"}]}},
    ]))
    found = discover_cdi(tree.root, DIRS)
    assert [(d.name, d.edits.device_nodes[0].permissions) for d in found.devices] == [
        ("npu2", "rw"), ("npu3", "rwm")]
    assert _problems(found) == [
        "device acme.example/npu=npu0 left out: devices[0].containerEdits.deviceNodes[0]"
        ".permissions: device node '/dev/npu0' has cgroup access 'r'; through NRI the "
        "runtime allows read and write ('rw') whatever is asked, which is wider: refused",
        "device acme.example/npu=npu1 left out: devices[1].containerEdits.deviceNodes[0]"
        ".permissions: device node '/dev/npu1' has cgroup access 'none'; through NRI the "
        "runtime allows read and write ('rw') whatever is asked, which is wider: refused",
    ]


def test_a_device_mounting_host_state_is_left_out(tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    tree.path("/var/lib/kubelet/device-plugins").mkdir(parents=True)
    tree.symlink("/opt/acme/plugins", "/var/lib/kubelet/device-plugins")
    _write(tree, "/etc/cdi/npu.yaml", _spec(devices=[
        {"name": "npu0", "containerEdits": {"mounts": [
            {"hostPath": "/var/lib/kubelet/device-plugins",
             "containerPath": "/var/lib/kubelet/device-plugins"}]}},
        {"name": "npu1", "containerEdits": {"mounts": [
            {"hostPath": "/opt/acme/plugins", "containerPath": "/plugins"}]}},
        {"name": "npu2", "containerEdits": {"mounts": [
            {"hostPath": "proc", "containerPath": "/host-proc", "type": "proc"}]}},
        {"name": "npu3", "containerEdits": {"mounts": [
            {"hostPath": "tmpfs", "containerPath": "/x", "type": "tmpfs",
             "options": ["remount"]}]}},
        {"name": "npu4", "containerEdits": {"deviceNodes": [{"path": "/dev/npu0"}],
                                            "mounts": [{"hostPath": "/opt/acme/lib",
                                                        "containerPath": "/opt/acme/lib"}]}},
    ]))
    found = discover_cdi(tree.root, DIRS)
    assert [d.name for d in found.devices] == ["npu4"]
    assert _problems(found) == [
        "device acme.example/npu=npu0 left out: devices[0].containerEdits.mounts[0]: mount "
        "source '/var/lib/kubelet/device-plugins' is under /var/lib/kubelet: kubelet state "
        "(device-plugin and pod-resources sockets, pod secrets and tokens, its client "
        "certificate)",
        "device acme.example/npu=npu1 left out: devices[1].containerEdits.mounts[0].hostPath: "
        "mount source '/opt/acme/plugins' leads to '/var/lib/kubelet/device-plugins': mount "
        "source '/var/lib/kubelet/device-plugins' is under /var/lib/kubelet: kubelet state "
        "(device-plugin and pod-resources sockets, pod secrets and tokens, its client "
        "certificate)",
        "device acme.example/npu=npu2 left out: devices[2].containerEdits.mounts[0]: mount "
        "'/host-proc' has type 'proc': only bind mounts and tmpfs are emitted",
        "device acme.example/npu=npu3 left out: devices[3].containerEdits.mounts[0]: tmpfs "
        "'/x' has option 'remount', which nri-accel does not pass",
    ]


def test_edits_past_the_limit_leave_the_device_out_or_refuse_the_file(tmp_path: Path) -> None:
    # nri_accel.edits.MAX_EDITS: the answer for a device is built on the event loop.
    tree = _tree(tmp_path)

    def mounts(n: int) -> list[dict[str, str]]:
        # Sources that do not exist: had they been resolved on the host, each would be
        # its own refusal; past the limit, only the limit is reported.
        return [{"hostPath": f"/opt/acme/missing/{i}", "containerPath": f"/opt/acme/{i}"}
                for i in range(n)]

    _write(tree, "/etc/cdi/npu.yaml", _spec(devices=[
        {"name": "npu0", "containerEdits": {"deviceNodes": [{"path": "/dev/npu0"}],
                                            "mounts": mounts(MAX_EDITS)}},
        {"name": "npu1", "containerEdits": {"deviceNodes": [{"path": "/dev/npu1"}],
                                            "mounts": mounts(MAX_EDITS - 1)}},
    ]))
    _write(tree, "/etc/cdi/ctl.yaml", _spec(kind="acme.example/ctl", containerEdits={
        "env": [f"V{i}=1" for i in range(MAX_EDITS + 1)]}))
    found = discover_cdi(tree.root, DIRS)
    assert [d.qualified_name for d in found.devices] == ["acme.example/npu=npu1"]
    assert len(found.devices[0].edits.mounts) == MAX_EDITS - 1
    assert [(p.source, p.message) for p in found.problems] == [
        ("/etc/cdi/ctl.yaml", f"containerEdits: {MAX_EDITS + 1} device nodes, mounts, env "
                              f"entries and hooks, over the {MAX_EDITS} nri-accel takes from "
                              "one device or capability"),
        ("/etc/cdi/npu.yaml", f"device acme.example/npu=npu0 left out: "
                              f"devices[0].containerEdits: {MAX_EDITS + 1} device nodes, "
                              f"mounts, env entries and hooks, over the {MAX_EDITS} nri-accel "
                              "takes from one device or capability"),
    ]


def test_composite_all_device_is_not_listed(tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    _write(tree, "/etc/cdi/npu.yaml", _spec(devices=[
        *_spec()["devices"],
        {"name": "all", "containerEdits": {"deviceNodes": [{"path": "/dev/npu0"},
                                                           {"path": "/dev/npu1"}]}}]))
    found = discover_cdi(tree.root, DIRS)
    assert [d.name for d in found.devices] == ["npu0", "npu1"]


def test_spec_file_symlink_resolves_inside_the_host_root(tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    _write(tree, "/opt/acme/npu.yaml", _spec())
    tree.symlink("/etc/cdi/npu.yaml", "/opt/acme/npu.yaml")  # absolute: a host path
    tree.symlink("/etc/cdi/sub.yaml", "../../opt/acme/npu.yaml")
    tree.path("/etc/cdi/nested.yaml").mkdir()  # a directory is skipped, as upstream does
    found = discover_cdi(tree.root, ("/etc/cdi",))
    # both links name the same file: a same-priority conflict, reported on both
    assert found.devices == ()
    assert sorted({p.source for p in found.problems}) == ["/etc/cdi/npu.yaml",
                                                          "/etc/cdi/sub.yaml"]


def test_a_relative_spec_link_in_a_linked_directory_goes_on_from_where_it_really_is(
        tmp_path: Path) -> None:
    # /etc/cdi -> /opt/vendor/cdi, and there acme.yaml -> ../shared/acme.yaml: the
    # kernel, and so the runtime reading the spec, opens /opt/vendor/shared/acme.yaml.
    tree = _tree(tmp_path)
    _write(tree, "/opt/vendor/shared/acme.yaml", _spec())
    _write(tree, "/etc/shared/acme.yaml", _spec(kind="decoy.example/npu"))
    tree.path("/opt/vendor/cdi").mkdir(parents=True)
    tree.symlink("/opt/vendor/cdi/acme.yaml", "../shared/acme.yaml")
    tree.symlink("/etc/cdi", "/opt/vendor/cdi")
    found = discover_cdi(tree.root, ("/etc/cdi",))
    assert {d.kind for d in found.devices} == {"acme.example/npu"}
    assert found.problems == ()


def test_missing_spec_dirs_are_fine(tmp_path: Path) -> None:
    found = discover_cdi(_tree(tmp_path).root, DIRS)
    assert (found.devices, found.drivers, found.problems) == ((), (), ())


@pytest.mark.parametrize(("spec", "version"), [
    ({"kind": "a/b", "devices": [{"name": "x"}]}, "0.3.0"),
    ({"kind": "a/b", "devices": [{"name": "x", "containerEdits": {
        "mounts": [{"type": "bind"}]}}]}, "0.4.0"),
    ({"kind": "a/b", "devices": [{"name": "0"}]}, "0.5.0"),
    ({"kind": "a/b", "containerEdits": {"deviceNodes": [{"hostPath": "/dev/x"}]},
      "devices": [{"name": "x"}]}, "0.5.0"),
    ({"kind": "a/b.c", "devices": [{"name": "x"}]}, "0.6.0"),
    ({"kind": "a/b", "devices": [{"name": "x", "annotations": {"k": "v"}}]}, "0.6.0"),
    ({"kind": "a/b", "devices": [{"name": "0", "containerEdits": {
        "additionalGids": [5]}}]}, "0.7.0"),
    # a tmpfs is a mount with a type: 0.4.0 (CDI SPEC.md: "Added `type` field to Mount")
    ({"kind": "a/b", "devices": [{"name": "x", "containerEdits": {"mounts": [
        {"hostPath": "tmpfs", "containerPath": "/scratch", "type": "tmpfs"}]}}]}, "0.4.0"),
    # permissions are in the first schema (0.3.0), "none" included: pkg/cdi's keyword
    # needs no version (specs-go/version.go checks no permissions)
    ({"kind": "a/b", "devices": [{"name": "x", "containerEdits": {"deviceNodes": [
        {"path": "/dev/x", "permissions": "r"}]}}]}, "0.3.0"),
    ({"kind": "a/b", "devices": [{"name": "x", "containerEdits": {"deviceNodes": [
        {"path": "/dev/x", "permissions": "none"}]}}]}, "0.3.0"),
])
def test_min_version(spec: dict[str, Any], version: str) -> None:
    assert min_version(spec) == version


# ---- writing ---------------------------------------------------------------------------


def _nvidia_inventory() -> Inventory:
    def gpu(i: int) -> Device:
        return Device(kind=KIND_GPU, name=str(i), uuid=f"GPU-{i}", vendor="nvidia",
                      edits=ContainerEdits(device_nodes=(DeviceNode(f"/dev/nvidia{i}", 195, i),)))

    mig = Device(kind=KIND_MIG, name="0:1", uuid="MIG-1", parent="0", vendor="nvidia",
                 edits=ContainerEdits(device_nodes=(
                     DeviceNode("/dev/nvidia0", 195, 0),
                     DeviceNode("/dev/nvidia-caps/nvidia-cap12", 508, 12))))
    lib = Mount("/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15",
                "/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15")
    smi = Mount("/usr/bin/nvidia-smi", "/usr/bin/nvidia-smi")
    gl = Mount("/usr/lib/x86_64-linux-gnu/libGLX_nvidia.so.550.54.15",
               "/usr/lib/x86_64-linux-gnu/libGLX_nvidia.so.550.54.15")
    driver = Driver(vendor="nvidia", version="550.54.15", capabilities=MappingProxyType({
        "": ContainerEdits(device_nodes=(DeviceNode("/dev/nvidiactl", 195, 255),)),
        "compute": ContainerEdits(mounts=(lib,)),
        "utility": ContainerEdits(mounts=(smi,)),
        "graphics": ContainerEdits(mounts=(gl,)),
    }))
    return Inventory(devices=(gpu(0), gpu(1), mig),
                     drivers=MappingProxyType({"nvidia": driver}))


def test_generate_nvidia_specs() -> None:
    gpu_spec, mig_spec = generate_specs(_nvidia_inventory())
    assert gpu_spec["kind"] == KIND_GPU
    assert gpu_spec["cdiVersion"] == "0.5.0"  # names start with a digit
    assert [d["name"] for d in gpu_spec["devices"]] == ["0", "1", "all"]
    assert gpu_spec["devices"][1]["containerEdits"] == {"deviceNodes": [
        {"path": "/dev/nvidia1", "type": "c", "major": 195, "minor": 1}]}
    shared = gpu_spec["containerEdits"]
    assert shared["deviceNodes"][0]["path"] == "/dev/nvidiactl"
    # the default capabilities (utility, compute) are shared; graphics is not
    assert [m["containerPath"] for m in shared["mounts"]] == [
        "/usr/bin/nvidia-smi", "/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15"]
    assert shared["mounts"][0]["options"] == ["ro", "nosuid", "nodev", "bind"]
    assert mig_spec["kind"] == KIND_MIG
    assert [n["path"] for n in mig_spec["devices"][0]["containerEdits"]["deviceNodes"]] == [
        "/dev/nvidia0", "/dev/nvidia-caps/nvidia-cap12"]


def test_generated_specs_define_the_composite_all_device() -> None:
    # For a runtime's own CDI injection `nvidia.com/gpu=all` (Docker's --gpus all, podman
    # --device nvidia.com/gpu=all) names a device called "all", which the spec must
    # define: nvidia-ctk and amd-ctk write it, merging every device's edits.
    gpu_spec, mig_spec = generate_specs(_nvidia_inventory())
    assert gpu_spec["devices"][-1] == {"name": "all", "containerEdits": {"deviceNodes": [
        {"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0},
        {"path": "/dev/nvidia1", "type": "c", "major": 195, "minor": 1}]}}
    # a MIG device's parent node appears once
    assert [n["path"] for n in mig_spec["devices"][-1]["containerEdits"]["deviceNodes"]] == [
        "/dev/nvidia0", "/dev/nvidia-caps/nvidia-cap12"]
    assert mig_spec["devices"][-1]["name"] == "all"


def test_generated_spec_reads_back_to_the_same_devices(tmp_path: Path) -> None:
    root = materialise("trn1", tmp_path / "trn1")
    inventory = Inventory(devices=tuple(d for d in discover_neuron(root).devices
                                        if d.kind == "aws.amazon.com/neuron"))
    (spec,) = generate_specs(inventory)
    assert (spec["kind"], spec["cdiVersion"]) == ("aws.amazon.com/neuron", "0.5.0")
    assert "containerEdits" not in spec  # the Neuron driver shares no files
    text = render_spec(spec)
    assert text == render_spec(generate_specs(inventory)[0])  # deterministic
    spec_path = tmp_path / "trn1" / "var/run/cdi" / spec_file_name(spec["kind"])
    spec_path.parent.mkdir(parents=True)
    spec_path.write_text(text)
    back = discover_cdi(root, DIRS)
    assert back.problems == ()
    assert [(d.name, d.edits) for d in back.devices] == [
        (d.name, d.edits) for d in inventory.devices]
    assert spec_file_name("aws.amazon.com/neuron") == "aws.amazon.com-neuron.yaml"


def test_generated_node_details_round_trip(tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    node = DeviceNode("/dev/accel0", 240, 0, host_path="/dev/npu0", permissions="rw",
                      file_mode=0o660, uid=0, gid=44)
    inventory = Inventory(devices=(Device(kind=KIND_GPU, name="0", vendor="nvidia",
                                          edits=ContainerEdits(device_nodes=(node,))),))
    (spec,) = generate_specs(inventory)
    tree.file("/etc/cdi/gen.yaml", render_spec(spec))
    (device,) = discover_cdi(tree.root, DIRS).devices
    assert device.edits.device_nodes == (node,)
