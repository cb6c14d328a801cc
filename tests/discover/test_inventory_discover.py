"""The discover() orchestrator: precedence between sources, failures, the CLI helper."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from types import MappingProxyType

import pytest
import yaml
from fakes.roots import materialise
from hosttree import HostTree

from nri_accel.app import App
from nri_accel.cli import main as cli_main
from nri_accel.config import Config, DiscoveryConfig, StaticDevice, load_config
from nri_accel.discover import assemble, discover, host_root
from nri_accel.discover.base import Found
from nri_accel.inventory import ContainerEdits, Device, DeviceNode, Driver, Inventory, Problem
from nri_accel.vendors import neuron
from nri_accel.vendors.neuron import KIND as KIND_NEURON
from nri_accel.vendors.neuron import KIND_CORE
from nri_accel.vendors.nvidia import KIND_GPU

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "discover"


def _dev(kind: str, name: str, *, origin: str = "", vendor: str = "") -> Device:
    attrs = MappingProxyType({"origin": origin} if origin else {})
    return Device(kind=kind, name=name, attributes=attrs, vendor=vendor,
                  edits=ContainerEdits(env=(f"FROM={origin or kind}",)))


def test_native_kind_shadows_cdi_and_static_of_that_kind() -> None:
    cdi_driver = Driver(vendor="cdi:/etc/cdi/nvidia.yaml")
    inv = assemble([
        ("nvidia", True, Found(devices=(_dev(KIND_GPU, "0", vendor="nvidia"),),
                         drivers=(Driver(vendor="nvidia", version="550.54.15"),))),
        ("neuron", True, Found()),
        ("static", False, Found(devices=(_dev(KIND_GPU, "9", origin="config"),))),
        ("cdi", False, Found(devices=(
            _dev(KIND_GPU, "0", origin="/etc/cdi/nvidia.yaml", vendor=cdi_driver.vendor),
            _dev(KIND_GPU, "GPU-1234", origin="/etc/cdi/nvidia.yaml", vendor=cdi_driver.vendor),
            _dev("amd.com/gpu", "0", origin="/etc/cdi/amd.json"),
        ), drivers=(cdi_driver,))),
    ])
    assert [d.qualified_name for d in inv.devices] == ["amd.com/gpu=0", "nvidia.com/gpu=0"]
    assert inv.find(KIND_GPU, "0").vendor == "nvidia"
    assert list(inv.drivers) == ["nvidia"]  # the shadowed spec's driver entry goes too
    assert [(p.source, p.message) for p in inv.problems] == [
        ("static device nvidia.com/gpu=9",
         "nvidia.com/gpu devices are discovered by nvidia; the 1 defined here are ignored"),
        ("/etc/cdi/nvidia.yaml",
         "nvidia.com/gpu devices are discovered by nvidia; the 2 defined here are ignored"),
    ]


def test_without_native_devices_cdi_serves_the_kind() -> None:
    inv = assemble([
        ("nvidia", True, Found(problems=(Problem("nvidia", "NVML not found"),))),
        ("cdi", False, Found(devices=(_dev(KIND_GPU, "0", origin="/etc/cdi/nvidia.yaml"),))),
    ])
    assert [d.qualified_name for d in inv.devices] == ["nvidia.com/gpu=0"]
    assert [p.source for p in inv.problems] == ["nvidia"]


def test_static_wins_over_cdi_for_the_same_name() -> None:
    inv = assemble([
        ("static", False, Found(devices=(_dev("acme.example/npu", "0", origin="config"),))),
        ("cdi", False, Found(devices=(_dev("acme.example/npu", "0", origin="/etc/cdi/acme.yaml"),
                               _dev("acme.example/npu", "1", origin="/etc/cdi/acme.yaml")))),
    ])
    assert [d.edits.env for d in inv.devices] == [("FROM=config",), ("FROM=/etc/cdi/acme.yaml",)]
    assert [(p.source, p.message) for p in inv.problems] == [
        ("/etc/cdi/acme.yaml", "acme.example/npu=0 is already provided by static device "
                               "acme.example/npu=0; this definition is ignored")]


def test_identical_problems_are_reported_once() -> None:
    p = Problem("/dev/char/195:0", "missing")
    inv = assemble([("nvidia", True, Found(problems=(p, p))),
                    ("neuron", True, Found(problems=(p,)))])
    assert inv.problems == (p,)


def _node(tmp_path: Path) -> HostTree:
    tree = HostTree(tmp_path / "node")
    tree.file("/sys/module/neuron/version", "2.21.37.0\n")
    tree.file("/proc/devices", "Character devices:\n240 npu\n241 neuron\n")
    tree.chardev("/dev/neuron0", 241, 0)
    tree.file("/sys/class/neuron_device/neuron0/core_count", "8")
    tree.chardev("/dev/npu0", 240, 0)
    tree.file("/etc/cdi/acme.yaml", yaml.safe_dump({
        "cdiVersion": "0.6.0", "kind": "acme.example/npu",
        "devices": [{"name": "npu0", "containerEdits": {"deviceNodes": [{"path": "/dev/npu0"}]}}],
    }))
    return tree


def test_a_failing_discoverer_is_a_problem_and_the_others_still_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: object, root: object, config: object) -> Found:
        raise RuntimeError("boom")

    monkeypatch.setattr(neuron.NeuronProfile, "discover", broken)
    inv = discover(_node(tmp_path).root, Config())
    assert [d.qualified_name for d in inv.devices] == ["acme.example/npu=npu0"]
    assert Problem("neuron", "discovery failed: RuntimeError: boom") in inv.problems


def test_discover_uses_every_source_and_the_configured_spec_dirs(tmp_path: Path) -> None:
    tree = _node(tmp_path)
    tree.chardev("/dev/fpga0", 250, 0)
    config = Config(discovery=DiscoveryConfig(cdi_spec_dirs=("/etc/cdi",)),
                    static_devices=(StaticDevice("xilinx.com/fpga", "fpga0", ("/dev/fpga0",)),))
    inv = discover(tree.root, config)
    assert [d.qualified_name for d in inv.devices if d.kind != KIND_CORE] == [
        "acme.example/npu=npu0", "aws.amazon.com/neuron=0", "xilinx.com/fpga=fpga0"]
    assert [d.parent for d in inv.of_kind(KIND_CORE)] == ["0"] * 8  # neuron0's cores
    assert inv.find(KIND_NEURON, "neuron0").attributes["cores"] == "8"
    assert set(inv.drivers) == {"neuron"}  # the acme spec has no spec-level edits
    # the node has no NVIDIA driver: that is said, and nothing else is wrong
    assert {p.source for p in inv.problems} == {"nvidia"}
    config = Config(discovery=DiscoveryConfig(cdi_spec_dirs=("/var/run/cdi",)))
    assert [d.kind for d in discover(tree.root, config).devices] == [KIND_NEURON] + [
        KIND_CORE] * 8


def test_the_app_reads_a_saved_inventory_or_discovers(tmp_path: Path) -> None:
    tree = _node(tmp_path)
    live = App(Config(), root_dir=str(tree.base)).load_inventory()
    saved = tmp_path / "node.json"
    saved.write_text(live.to_json())
    assert App(Config(), inventory_path=str(saved)).load_inventory() == live
    assert len(live.devices) == 2 + 8  # npu0, neuron0 and its 8 NeuronCores


def test_host_root_takes_the_driver_root_from_the_config(tmp_path: Path) -> None:
    config = Config(discovery=DiscoveryConfig(driver_root="/run/nvidia/driver"))
    root = host_root(str(tmp_path), config)
    assert (root.root, root.driver_root) == (str(tmp_path), "/run/nvidia/driver")
    assert host_root(None, Config()).root == "/"


def test_fake_roots_discover_deterministically(tmp_path: Path) -> None:
    a = discover(materialise("trn1", tmp_path / "a"), Config())
    b = discover(materialise("trn1", tmp_path / "b"), Config())
    assert a == b and a.to_json() == b.to_json()
    assert isinstance(a, Inventory) and len(a.of_kind(KIND_NEURON)) == 16
    node = a.find(KIND_NEURON, "15").edits.device_nodes[0]
    assert node == DeviceNode("/dev/neuron15", 241, 15)


# ---- two devices with one identity ---------------------------------------------------

def test_a_uuid_reported_twice_keeps_the_first_device() -> None:
    """A driver bug (one UUID for two GPUs) would have the Engine grant one device twice:
    the later GPU is left out, with a Problem naming both and where each comes from."""
    gpu = partial(Device, KIND_GPU, vendor="nvidia")
    inv = assemble([
        ("nvidia", True, Found(devices=(gpu("0", uuid="GPU-1"), gpu("1", uuid="GPU-1"),
                                        gpu("2", uuid="GPU-2")))),
        ("cdi", False, Found(devices=(_dev("acme.example/npu", "npu0", origin="/etc/cdi/a.yaml"),
                                      _dev("acme.example/npu", "NPU0", origin="/etc/cdi/b.yaml")))),
    ])
    assert [d.qualified_name for d in inv.devices] == [
        "acme.example/npu=npu0", "nvidia.com/gpu=0", "nvidia.com/gpu=2"]
    assert [(p.source, p.message) for p in inv.problems] == [
        ("nvidia", "nvidia.com/gpu=1 is ignored: its UUID 'GPU-1' is also the UUID of "
                   "nvidia.com/gpu=0 (from nvidia): two devices with one identity"),
        ("/etc/cdi/b.yaml", "acme.example/npu=NPU0 is ignored: its name 'NPU0' is also the "
                            "name of acme.example/npu=npu0 (from /etc/cdi/a.yaml): two "
                            "devices with one identity"),
    ]
    assert Inventory.from_json(inv.to_json()) == inv  # what discovery keeps loads


def _spec(kind: str, *devices: tuple[str, str]) -> str:
    return yaml.safe_dump({"cdiVersion": "0.5.0", "kind": kind, "devices": [
        {"name": name, "containerEdits": {"deviceNodes": [{"path": node}]}}
        for name, node in devices]})


def test_cdi_specs_naming_one_device_twice_end_to_end(tmp_path: Path, capsys) -> None:
    """The cdi-only node (its golden config: static FPGA fpga0) with two more spec files
    that name devices already named: FPGA0 (the static fpga0 in another case, which
    find() and requests match alike), and one PCI function in two spellings, across
    files and within one. Discovery keeps the first of each (static before CDI,
    /etc/cdi before /var/run/cdi, file order), `discover` and `check` report the rest,
    and what it keeps is a valid inventory."""
    root = materialise("cdi-only", tmp_path / "node")
    config = GOLDEN / "cdi-only.config.toml"
    (Path(root.root) / "etc/cdi/xilinx-a.yaml").write_text(
        _spec("xilinx.com/fpga", ("0000:3b:00.0", "/dev/xdma1_user")))
    (Path(root.root) / "var/run/cdi/xilinx-b.yaml").write_text(_spec(
        "xilinx.com/fpga", ("0:3B:0.0", "/dev/xdma1_user"), ("FPGA0", "/dev/xdma0_user"),
        ("fpga9", "/dev/xdma0_control")))
    inv = discover(root, load_config(str(config)))
    assert [d.name for d in inv.of_kind("xilinx.com/fpga")] == [
        "0000:3b:00.0", "fpga0", "fpga9"]
    assert inv.find("xilinx.com/fpga", "FPGA0").attributes["origin"] == "config"
    ignored = [(p.source, p.message) for p in inv.problems if "is ignored" in p.message]
    assert ignored == [
        ("/var/run/cdi/xilinx-b.yaml",
         "xilinx.com/fpga=0:3B:0.0 is ignored: its name '0:3B:0.0' is also the name of "
         "xilinx.com/fpga=0000:3b:00.0 (from /etc/cdi/xilinx-a.yaml): two devices with one "
         "identity"),
        ("/var/run/cdi/xilinx-b.yaml",
         "xilinx.com/fpga=FPGA0 is ignored: its name 'FPGA0' is also the name of "
         "xilinx.com/fpga=fpga0 (from static device xilinx.com/fpga=fpga0): two devices "
         "with one identity"),
    ]
    assert Inventory.from_json(inv.to_json()) == inv

    args = ["--root", root.root, "--config", str(config)]
    assert cli_main(["discover", *args]) == 0
    out = capsys.readouterr().out
    assert all(f"  {source}: {message}" in out for source, message in ignored)
    cli_main(["check", *args, "--socket", str(tmp_path / "nri.sock"), "--timeout", "0.1"])
    out = capsys.readouterr().out
    assert all(f"warn: {source}: {message}" in out for source, message in ignored)
