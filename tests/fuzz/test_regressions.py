"""What the fuzz targets found, each as a plain test with the exact input that failed
(tests/fuzz/README.md says how a crash becomes one). Each names the target that found it
and the fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import MappingProxyType

import pytest
from demo_node import demo_inventory
from steps import finished

from nri_accel.config import Config, PolicyConfig
from nri_accel.container import ContainerInfo
from nri_accel.discover.hostroot import HostRoot
from nri_accel.engine import ENV_SCOPE, Engine
from nri_accel.errors import AllocationError, InventoryError, RequestError
from nri_accel.inventory import (
    ContainerEdits,
    Device,
    DeviceNode,
    Driver,
    Inventory,
    Mount,
    natural_key,
)
from nri_accel.nri import nri_pb2 as pb
from nri_accel.nri.convert import container_info, decode_large, large_container_info
from nri_accel.plugin import CONTAINER_KEYS
from nri_accel.policy import Policy
from nri_accel.request import ANNOTATION_PREFIXES
from nri_accel.vendors.cdi.spec import discover_cdi

INJECTOR = "cdi-devices.noderesource.dev"
CRIO_METADATA = "io.kubernetes.cri-o.Metadata"


def pod(annotations: dict[str, str]) -> ContainerInfo:
    return ContainerInfo(namespace="default", pod_name="p", pod_uid="u", container_name="main",
                         container_id="c1", pod_annotations=MappingProxyType(annotations),
                         container_annotations=MappingProxyType({}), env=())


# ---- request grammars (test_fuzz_request, test_fuzz_nri) -----------------------------------

def test_injector_annotation_with_an_impossible_date() -> None:
    """test_fuzz_request: PyYAML raised ValueError (not a YAMLError) for a timestamp such as
    2001-02-30; request.py now turns it into the annotation's RequestError."""
    with pytest.raises(RequestError, match="not a YAML list of CDI device names") as err:
        Policy().request_for(pod({INJECTOR: "- 2001-02-30"}))
    assert err.value.source == f"annotation {INJECTOR}"


@pytest.mark.parametrize(("value", "message"), [
    ("[" * 2000, "more than 64 '\\[' and '{'"), ("[" * 4096, "more than 64"),
    ("{a: " * 1000, "more than 64"), ("- " * 2000, "nested too deeply")])
def test_injector_annotation_nested_too_deeply(value: str, message: str) -> None:
    """test_fuzz_request: 2000 '[' made PyYAML raise RecursionError, after over a second
    of CPU (its scanner is quadratic over open flow collections), on every create of the
    pod's containers. More than 64 '[' or '{' are now refused before parsing; block
    nesting, which runs out of recursion quickly, is refused when it does."""
    with pytest.raises(RequestError, match=message) as err:
        Policy().request_for(pod({INJECTOR: value}))
    assert err.value.source == f"annotation {INJECTOR}"
    assert str(err.value).startswith(f"annotation {INJECTOR}: not a YAML list of CDI")


def test_injector_annotation_flow_list_still_reads() -> None:
    request = Policy(mode="standalone").request_for(
        pod({INJECTOR: "[acme.example/npu=npu0, acme.example/npu=npu1]"}))
    assert request.cdi_names == ("acme.example/npu=npu0", "acme.example/npu=npu1")


def test_crio_metadata_nested_too_deeply() -> None:
    """test_fuzz_nri: a CRI-O Metadata annotation of 3000 '[' (within its 4096-character
    bound) made json.loads raise RecursionError out of nri.convert.container_info, before
    the plugin's error handling. The container is then unnamed, as for any unreadable
    metadata."""
    container = pb.Container(id="c1", annotations={CRIO_METADATA: "[" * 3000})
    assert container_info(pb.PodSandbox(), container).container_name == ""


@pytest.mark.parametrize("group", [b"s\x05\x00\x00\x00\x00t", b"s\x00\x00t",
                                   b"s\x03\x04t", b"s\x02\x01xt"])
def test_a_field_number_0_inside_a_group_is_skipped_by_both_views(group: bytes) -> None:
    """test_fuzz_nri: a flipped byte made a pod's `sandbox-1` the start of a group (field
    14) holding a field number 0. protobuf skips it inside a group (it refuses it only
    where a message's field starts), and so accepted the request under
    convert.LARGE_REQUEST; over it, the walk of nri/fields.py refused it as an invalid
    tag: a request taken or refused by its size. Both now skip it."""
    found = (b'\n\x1b\x08\tsandbox-1\x12\x05pod-a"\x07default'
             b"\x12\x15\n\x02c1\x12\tsandbox-1\x1a\x04main")
    pod = pb.PodSandbox(name="pod-a").SerializeToString() + group
    built = pb.CreateContainerRequest(container=pb.Container(id="c1")).SerializeToString()
    for data in (found, b"\n" + bytes([len(pod)]) + pod + built):
        whole = pb.CreateContainerRequest.FromString(data)
        large = decode_large(data)
        info = finished(large_container_info(large.pod, large.container, ENV_SCOPE,
                                             ANNOTATION_PREFIXES, CONTAINER_KEYS))
        assert info.container_id == whole.container.id == "c1"


# ---- the inventory loader (test_fuzz_inventory) ----------------------------------------------

@pytest.mark.parametrize("text", ["[" * 100_000, '{"a":' * 5000, "7" * 5000,
                                  '{"schema_version": 1, "devices": [{"numa_node": ' + "7" * 5000
                                  + "}]}"],
                         ids=["deep-list", "deep-object", "huge-number", "huge-field"])
def test_inventory_text_json_cannot_read(text: str) -> None:
    """test_fuzz_inventory: json.loads raised RecursionError for deep nesting and ValueError
    (not JSONDecodeError) for an integer of more than 4300 digits."""
    with pytest.raises(InventoryError, match="not valid JSON") as err:
        Inventory.from_json(text, origin="saved.json")
    assert err.value.source == "saved.json"


@pytest.mark.parametrize("name", ["7" * 5000, "\u00b2", "gpu\u00b2"])
def test_inventory_device_names_any_digits(name: str) -> None:
    """test_fuzz_inventory: sorting the devices (natural_key) ran int() over digit runs:
    ValueError for 4301 digits and for "²" (isdigit() yet not a number int() reads)."""
    doc = {"schema_version": 1, "devices": [{"kind": "a/b", "name": name},
                                            {"kind": "a/b", "name": "10"}]}
    inv = Inventory.from_json(json.dumps(doc))
    assert {d.name for d in inv.devices} == {name, "10"}


def test_natural_key_still_orders_numbers_by_value() -> None:
    names = ["10", "9", "007", "0:10", "0:9", "x" + "9" * 5000, "x10"]
    assert sorted(names, key=natural_key) == ["0:9", "0:10", "007", "9", "10", "x10",
                                              "x" + "9" * 5000]


def test_inventory_empty_values_survive_a_round_trip() -> None:
    """test_fuzz_inventory: to_json left out every empty value, so a mount with no options
    came back with the default ro,nosuid,nodev,bind and a device node with permissions ""
    came back "rwm": a saved inventory did not load as what was saved."""
    inv = Inventory(devices=(Device(
        kind="a/b", name="0", edits=ContainerEdits(
            device_nodes=(DeviceNode("/dev/x0", 1, 2, type="", permissions=""),),
            mounts=(Mount("/opt/x", "/opt/x", type="", options=()),))),))
    assert Inventory.from_json(inv.to_json()) == inv
    assert Inventory.from_json(demo_inventory().to_json()) == demo_inventory()


def test_inventory_edits_that_protobuf_cannot_carry_are_refused() -> None:
    """test_fuzz_cdi: a JSON "\\ud800" escape gives a lone surrogate, which the adjustment's
    protobuf refuses with UnicodeEncodeError: every container granted the device failed
    with an internal error. nri_accel.edits now refuses such edits like any unsafe one."""
    mount = Mount("/opt/acme/lib", "/opt/\ud800")
    inv = Inventory(devices=(Device(kind="acme.example/npu", name="npu0", vendor="cdi:x",
                                    edits=ContainerEdits(device_nodes=(
                                        DeviceNode("/dev/acme0", 300, 0),))),),
                    drivers=MappingProxyType({"cdi:x": Driver("cdi:x", capabilities=(
                        MappingProxyType({"": ContainerEdits(mounts=(mount,))})))}))
    engine = Engine(inv, Config(policy=PolicyConfig(mode="standalone")))
    with pytest.raises(AllocationError, match="not valid UTF-8"):
        engine.plan(pod({"devices.nri-accel.io": "acme.example/npu=npu0"}))


# ---- CDI specs (test_fuzz_cdi) ------------------------------------------------------------------

@pytest.fixture
def spec_root(tmp_path: Path) -> HostRoot:
    (tmp_path / "etc/cdi").mkdir(parents=True)
    (tmp_path / "dev").mkdir()
    try:
        os.mknod(tmp_path / "dev/fuzz0", 0o20600, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("creating a device node needs root (CI runs as root)")
    return HostRoot.at(tmp_path)


def _problems(root: HostRoot, name: str, content: str) -> list[str]:
    Path(root.local("/etc/cdi"), name).write_text(content)
    found = discover_cdi(root, ["/etc/cdi"])
    assert not found.devices
    assert {p.source for p in found.problems} == {f"/etc/cdi/{name}"}
    return [p.message for p in found.problems]


@pytest.mark.parametrize("content", ["[" * 100_000, "- " * 100_000, "a:\n" + "".join(
    " " * i + "a:\n" for i in range(1, 200))], ids=["flow", "block", "indented"])
def test_cdi_yaml_nested_too_deeply(tmp_path: Path, content: str) -> None:
    """test_fuzz_cdi: libyaml's composer (CSafeLoader) recurses in C once per nesting level;
    a spec file of 100,000 '[' overflowed the stack and killed the daemon with SIGSEGV.
    spec.py now refuses YAML nested deeper than 32 levels before composing it. Run in a
    child process, so that a regression fails this test instead of killing the suite.
    (PyYAML 6.0.4's libyaml refuses the flow file itself, at 1,000 levels, before spec.py
    sees an event: spec.py reports that refusal as its own.)"""
    spec = tmp_path / "etc/cdi/deep.yaml"
    spec.parent.mkdir(parents=True)
    spec.write_text(content)
    script = ("import sys; from nri_accel.discover.hostroot import HostRoot; "
              "from nri_accel.vendors.cdi.spec import discover_cdi; "
              "found = discover_cdi(HostRoot.at(sys.argv[1]), ['/etc/cdi']); "
              "print(*['problem: ' + p.message for p in found.problems], sep='\\n')")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    problems = [line for line in done.stdout.splitlines() if line.startswith("problem: ")]
    assert problems == ["problem: nested deeper than 32 levels"]


def test_cdi_json_nested_too_deeply(spec_root: HostRoot) -> None:
    """test_fuzz_cdi: json.loads raised RecursionError out of discover_cdi (50,000 deep:
    under the spec's value limit, which refuses 100,000 before json.loads runs)."""
    assert _problems(spec_root, "deep.json", "[" * 50_000) == ["not valid JSON: nested too "
                                                               "deeply"]


SPEC = {"cdiVersion": "1.0.0", "kind": "acme.example/npu", "devices": [{
    "name": "npu0", "containerEdits": {"deviceNodes": [{"path": "/dev/fuzz0"}]}}]}


@pytest.mark.parametrize(("field", "value"), [("hostPath", "/\ud800"),
                                              ("containerPath", "/\ud800")])
def test_cdi_mount_path_with_a_lone_surrogate(spec_root: HostRoot, field: str,
                                              value: str) -> None:
    """test_fuzz_cdi, the exact specs: a bind source of "/\\ud800" raised UnicodeEncodeError
    out of discover_cdi (resolving it); a destination of "/\\ud800" was kept, and granting
    the device then failed inside the protobuf encoder."""
    mount = {"hostPath": "/dev/fuzz0", "containerPath": "/dev/fuzz0", field: value}
    spec = json.loads(json.dumps(SPEC))
    spec["devices"][0]["containerEdits"]["mounts"] = [mount]
    [message] = _problems(spec_root, "s.json", json.dumps(spec))
    assert message.startswith("device acme.example/npu=npu0 left out: devices[0]."
                              "containerEdits.mounts[0]")
    assert "not valid UTF-8" in message
