"""CDI spec reading under hostile input: bounded messages, paths, parse work and logs.

Each test builds its own spec files under tmp_path (HostTree stands for the node's
/etc/cdi and /var/run/cdi). Work is bounded by counting (events read, parses done,
walks made), never by timing.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from hosttree import HostTree
from structlog.testing import capture_logs

from nri_accel.app import App
from nri_accel.config import Config, DiscoveryConfig, StaticDevice
from nri_accel.discover.hostroot import HostRoot
from nri_accel.discover.watch import Refresher, watch_state
from nri_accel.edits import MAX_PATH_BYTES, MAX_PATH_COMPONENTS, UnsafeEdit, check_node_path
from nri_accel.inventory import ContainerEdits, Device, Inventory, Problem
from nri_accel.vendors.cdi import spec as cdi_spec
from nri_accel.vendors.cdi.spec import MAX_SPEC_NODES, discover_cdi
from nri_accel.vendors.cdi.static import discover_static

DIRS = ("/etc/cdi", "/var/run/cdi")
GOOD = ("cdiVersion: '0.6.0'\nkind: acme.example/good\ndevices:\n"
        "  - name: npu0\n    containerEdits:\n      deviceNodes:\n        - path: /dev/npu0\n")


def _bad(field_yaml: str) -> str:
    """A spec whose one device node carries `field_yaml` (e.g. "major: 1")."""
    return ("cdiVersion: '0.6.0'\nkind: acme.example/bad\ndevices:\n"
            "  - name: npu0\n    containerEdits:\n      deviceNodes:\n"
            f"        - path: /dev/npu0\n          {field_yaml}\n")


def _tree(tmp_path: Path) -> HostTree:
    tree = HostTree(tmp_path / "node")
    tree.chardev("/dev/npu0", 240, 0)
    tree.file("/etc/cdi/good.yaml", GOOD)
    return tree


def _only_bad_problem(tree: HostTree, name: str = "/etc/cdi/bad.yaml") -> str:
    found = discover_cdi(tree.root, DIRS)
    assert [d.qualified_name for d in found.devices] == ["acme.example/good=npu0"]
    assert [p.source for p in found.problems] == [name]
    return found.problems[0].message


# ---- 1. a value too large to print is one Problem, the other specs kept ---------------


def test_huge_hex_integer_is_one_problem_naming_file_and_field(tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    tree.file("/etc/cdi/bad.yaml", _bad("major: 0x" + "f" * 100_000))
    message = _only_bad_problem(tree)
    assert message.startswith("devices[0].containerEdits.deviceNodes[0].major:")
    assert "integer of 400000 bits" in message


@pytest.mark.parametrize("text", [
    _bad("major: " + "9" * 10_000),  # decimal: Python refuses to read it
    "cdiVersion: '0.6.0'\nkind: acme.example/bad\n0x" + "f" * 50_000 + ": 1\ndevices: []\n",
    "cdiVersion: '0.6.0'\nkind: " + "a" * 1_000_000 + "\ndevices: []\n",
    "cdiVersion: '" + "9" * 1_000_000 + "'\nkind: acme.example/bad\ndevices: []\n",
    _bad("type: " + "x" * 1_000_000),
    _bad("permissions: " + "x" * 1_000_000),
])
def test_messages_quote_values_cut_short(tmp_path: Path, text: str) -> None:
    tree = _tree(tmp_path)
    tree.file("/etc/cdi/bad.yaml", text)
    assert len(_only_bad_problem(tree)) < 400


def test_huge_integer_in_json_is_one_problem(tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    tree.file("/etc/cdi/bad.json", json.dumps({"cdiVersion": "0.6.0", "kind": "a.example/b"})
              .replace("}", ', "devices": ' + "9" * 5000 + "}"))
    assert "not valid JSON" in _only_bad_problem(tree, "/etc/cdi/bad.json")


# ---- 2. paths over PATH_MAX or with too many components, before any walk --------------


@pytest.mark.parametrize(("field", "path", "why"), [
    ("deviceNodes[0].path", "/dev" + "/a" * 8_000, f"longer than {MAX_PATH_BYTES} bytes"),
    ("deviceNodes[0].hostPath", "/dev/" + "x" * 16_384, f"longer than {MAX_PATH_BYTES} bytes"),
    ("mounts[0].hostPath", "/a" * 50_000, f"longer than {MAX_PATH_BYTES} bytes"),
    ("mounts[0].hostPath", "/a" * (MAX_PATH_COMPONENTS + 1), "components"),
    ("mounts[0].containerPath", "/a" * (MAX_PATH_COMPONENTS + 1), "components"),
])
def test_long_paths_are_refused_before_any_walk(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, field: str, path: str,
        why: str) -> None:
    walks: list[str] = []
    real_resolve = HostRoot.resolve

    def counting_resolve(self: HostRoot, host_path: str) -> str:
        walks.append(host_path)
        return real_resolve(self, host_path)

    monkeypatch.setattr(HostRoot, "resolve", counting_resolve)
    tree = _tree(tmp_path)
    edits: dict[str, Any] = {"deviceNodes": [{"path": "/dev/npu0"}]}
    key, _, attr = field.partition("[0].")
    if key == "mounts":
        edits["mounts"] = [{"hostPath": "/usr/lib/x", "containerPath": "/x"}]
    edits[key][0][attr] = path
    tree.file("/etc/cdi/bad.yaml", yaml.safe_dump({
        "cdiVersion": "0.6.0", "kind": "acme.example/bad",
        "devices": [{"name": "npu0", "containerEdits": edits}]}))
    message = _only_bad_problem(tree)
    assert message.startswith(f"devices[0].containerEdits.{field}: ")
    assert why in message and len(message) < 400
    assert not [w for w in walks if len(w) > MAX_PATH_BYTES or w.count("/") > 64]


def test_path_bounds_are_the_edits_rules_too(tmp_path: Path) -> None:
    for path in ("/dev/" + "x" * MAX_PATH_BYTES, "/dev" + "/a" * MAX_PATH_COMPONENTS):
        with pytest.raises(UnsafeEdit, match=r"longer than|components"):
            check_node_path(path)
    check_node_path("/dev" + "/a" * (MAX_PATH_COMPONENTS - 1))  # at the limit: accepted
    tree = _tree(tmp_path)
    found = discover_static(tree.root, (StaticDevice("acme.example/fpga", "f0",
                                                     ("/dev/" + "x" * 16_384,)),))
    assert not found.devices
    assert "longer than" in found.problems[0].message


# ---- 3. bounded parse: nodes, devices, files; unchanged files parsed once -------------


def test_yaml_parse_stops_at_the_node_limit(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    events = 0
    real_parse = yaml.parse

    def counting_parse(*args: Any, **kwargs: Any) -> Any:
        nonlocal events
        for event in real_parse(*args, **kwargs):
            events += 1
            yield event

    monkeypatch.setattr(yaml, "parse", counting_parse)
    tree = _tree(tmp_path)
    tree.file("/etc/cdi/bad.yaml", "devices: [" + "a," * (3 * MAX_SPEC_NODES) + "a]\n")
    assert f"more than {MAX_SPEC_NODES} values" in _only_bad_problem(tree)
    assert MAX_SPEC_NODES < events < MAX_SPEC_NODES + 100  # stopped there, not at 300,000


def test_json_over_the_node_limit_is_refused_before_it_is_built(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    loads: list[int] = []
    real_loads = json.loads
    monkeypatch.setattr(json, "loads", lambda text, **kw: loads.append(len(text))
                        or real_loads(text, **kw))
    tree = _tree(tmp_path)
    tree.file("/etc/cdi/bad.json", '{"devices": [' + "1," * MAX_SPEC_NODES + "1]}")
    assert f"more than {MAX_SPEC_NODES} values" in _only_bad_problem(tree, "/etc/cdi/bad.json")
    assert loads == []


def _nvidia_ctk_like() -> dict[str, Any]:
    """What `nvidia-ctk cdi generate` writes for 8 GPUs with 7 MIG instances each: per
    device its nodes, the driver's libraries and binaries as mounts, and hooks."""
    def device(name: str, nodes: int) -> dict[str, Any]:
        return {"name": name, "containerEdits": {"deviceNodes": [
            {"path": f"/dev/nvidia-caps/nvidia-cap{i}"} for i in range(nodes)]}}
    mount = {"hostPath": "/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15",
             "containerPath": "/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15",
             "options": ["ro", "nosuid", "nodev", "bind"]}
    return {"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu",
            "devices": [device(str(g), 1) for g in range(8)]
            + [device(f"{g}:{m}", 3) for g in range(8) for m in range(7)] + [device("all", 64)],
            "containerEdits": {
                "env": ["NVIDIA_VISIBLE_DEVICES=void"],
                "deviceNodes": [{"path": "/dev/nvidiactl"}, {"path": "/dev/nvidia-uvm"}],
                "hooks": [{"hookName": "createContainer", "path": "/usr/bin/nvidia-cdi-hook",
                           "args": ["nvidia-cdi-hook", "create-symlinks"]
                           + [f"--link=libcuda.so.{i}::/usr/lib/libcuda.so" for i in range(40)]}],
                "mounts": [dict(mount) for _ in range(80)]}}


def test_a_real_sized_spec_is_far_below_the_node_limit() -> None:
    nodes = cdi_spec._check_yaml(yaml.safe_dump(_nvidia_ctk_like()))
    assert 1000 < nodes < MAX_SPEC_NODES // 20


def test_devices_past_the_cap_are_left_out_with_a_problem(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cdi_spec, "MAX_SPEC_DEVICES", 3)
    tree = _tree(tmp_path)
    tree.file("/etc/cdi/many.yaml", yaml.safe_dump({
        "cdiVersion": "0.6.0", "kind": "acme.example/many",
        "devices": [{"name": f"d{i}", "containerEdits": {"env": [f"I={i}"]}}
                    for i in range(5)]}))
    found = discover_cdi(tree.root, DIRS)
    assert [d.name for d in found.devices if d.kind == "acme.example/many"] == ["d0", "d1", "d2"]
    assert [(p.source, "2 devices left out" in p.message) for p in found.problems] == [
        ("/etc/cdi/many.yaml", True)]


@pytest.mark.parametrize("where", [0, 2, 3])
def test_the_composite_all_is_not_counted_against_the_cap(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: int) -> None:
    # `cdi generate` writes a kind's devices and `all` beside them: a kind of exactly
    # MAX_SPEC_DEVICES devices reads back whole, wherever its `all` stands among them;
    # one device more is left out with a problem.
    monkeypatch.setattr(cdi_spec, "MAX_SPEC_DEVICES", 3)
    tree = _tree(tmp_path)
    devices: list[dict[str, Any]] = [{"name": f"d{i}", "containerEdits": {"env": [f"I={i}"]}}
                                     for i in range(4)]
    devices.insert(where, {"name": "all", "containerEdits": {"env": ["I=all"]}})
    tree.file("/etc/cdi/three.yaml", yaml.safe_dump({
        "cdiVersion": "0.6.0", "kind": "acme.example/three",
        "devices": [d for d in devices if d["name"] != "d3"]}))
    tree.file("/etc/cdi/four.yaml", yaml.safe_dump({
        "cdiVersion": "0.6.0", "kind": "acme.example/four", "devices": devices}))
    found = discover_cdi(tree.root, DIRS)
    names = {kind: [d.name for d in found.devices if d.kind == f"acme.example/{kind}"]
             for kind in ("three", "four")}
    assert names == {"three": ["d0", "d1", "d2"], "four": ["d0", "d1", "d2"]}
    assert [(p.source, "1 devices left out" in p.message) for p in found.problems] == [
        ("/etc/cdi/four.yaml", True)]


def test_spec_files_past_the_cap_are_not_read(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cdi_spec, "MAX_SPEC_FILES", 2)
    tree = _tree(tmp_path)
    tree.file("/etc/cdi/more.yaml", GOOD.replace("good", "more"))
    tree.file("/var/run/cdi/late.yaml", GOOD.replace("good", "late"))
    tree.file("/var/run/cdi/later.yaml", GOOD.replace("good", "later"))
    found = discover_cdi(tree.root, DIRS)
    assert sorted(d.kind for d in found.devices) == ["acme.example/good", "acme.example/more"]
    assert [p.source for p in found.problems] == ["/var/run/cdi"]
    assert "2 spec file(s) not read" in found.problems[0].message


def test_unchanged_specs_are_not_parsed_again(tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    tree.file("/etc/cdi/bad.yaml", _bad("major: -1"))
    cache = cdi_spec._CACHE
    first = discover_cdi(tree.root, DIRS)
    parses = cache.parses
    assert discover_cdi(tree.root, DIRS) == first
    assert cache.parses == parses  # neither the valid nor the invalid file again
    tree.file("/etc/cdi/good.yaml", GOOD.replace("npu0", "npu1"))
    tree.chardev("/dev/npu1", 240, 1)
    assert [d.name for d in discover_cdi(tree.root, DIRS).devices] == ["npu1"]
    assert cache.parses == parses + 1  # only the changed file
    entries = len(cache)
    tree.remove("/etc/cdi/bad.yaml")
    assert not discover_cdi(tree.root, DIRS).problems
    assert len(cache) == entries - 1  # the vanished file's entry is dropped


def test_the_cache_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cdi_spec, "CACHE_NODES", 60)  # GOOD is 19 nodes: 3 fit
    monkeypatch.setattr(cdi_spec, "_CACHE", cdi_spec._ParseCache())
    tree = _tree(tmp_path)
    for i in range(6):
        tree.file(f"/etc/cdi/s{i}.yaml", GOOD.replace("good", f"s{i}"))
    assert len(discover_cdi(tree.root, DIRS).devices) == 7
    assert len(cdi_spec._CACHE) == 3


# ---- 4. problems are logged when they appear and when they go away -------------------


def test_discovery_itself_does_not_log_spec_problems(tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    tree.file("/etc/cdi/bad.yaml", _bad("major: -1"))
    config = Config(discovery=DiscoveryConfig(cdi_spec_dirs=DIRS))
    with capture_logs() as logs:
        App(config, root_dir=str(tree.base)).load_inventory()
    bad = [e for e in logs if e["log_level"] == "warning" and "bad.yaml" in str(e)]
    assert [e["event"] for e in bad] == ["discovery_problem"]  # once, not twice


def _inventory(n: int, *problems: str) -> Inventory:
    return Inventory(devices=(Device(kind="acme.example/npu", name=str(n),
                                     edits=ContainerEdits(env=("A=1",))),),
                     problems=tuple(Problem(p, "bad") for p in problems))


def test_refresh_logs_only_the_problems_that_change(tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    config = Config(discovery=DiscoveryConfig(cdi_spec_dirs=DIRS))
    results = [_inventory(1, "a", "b"), _inventory(2, "a", "b"), _inventory(3, "b"),
               _inventory(3, "b")]
    r = Refresher(tree.root, config, _inventory(0, "a"), lambda inv: None,
                  discover_fn=lambda root, cfg: results.pop(0))
    logged: list[list[tuple[str, str]]] = []
    for i in range(4):
        tree.file("/etc/cdi/touch.json", str(i))  # the probe moves: rediscovery
        os.utime(tree.path("/etc/cdi/touch.json"), ns=(i, i))
        with capture_logs() as logs:
            asyncio.run(r.check())
        logged.append([(e["event"], e["source"]) for e in logs
                       if e["event"].startswith("discovery_problem")])
    assert logged == [[("discovery_problem", "b")], [],
                      [("discovery_problem_resolved", "a")], []]
    assert r._state == watch_state(tree.root, config)


# ---- 5. a spec directory that cannot be listed ---------------------------------------


def test_spec_directory_symlink_loop_is_a_problem(tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    tree.symlink("/var/run/cdi", "/var/run/cdi2")
    tree.symlink("/var/run/cdi2", "/var/run/cdi")
    found = discover_cdi(tree.root, DIRS)
    assert [d.kind for d in found.devices] == ["acme.example/good"]
    assert [p.source for p in found.problems] == ["/var/run/cdi"]
    assert "symbolic links" in found.problems[0].message


def test_missing_spec_directory_is_no_problem(tmp_path: Path) -> None:
    assert not discover_cdi(_tree(tmp_path).root, DIRS).problems
