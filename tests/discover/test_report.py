"""`discover` and `cdi generate` output: golden files for every fake root, CLI behaviour.

Regenerate the goldens after an intended change with
``UPDATE_GOLDEN=1 python -m pytest tests/discover/test_report.py`` and review the diff.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import MappingProxyType

import pytest
import yaml
from fakes.roots import materialise, names

from nri_accel.cli import main as cli_main
from nri_accel.config import Config, load_config
from nri_accel.discover import discover
from nri_accel.discover.report import render_table
from nri_accel.inventory import ContainerEdits, Device, Driver, Inventory, Problem
from nri_accel.vendors.cdi.spec import discover_cdi

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "discover"
UPDATE = os.environ.get("UPDATE_GOLDEN") == "1"


def _config(name: str) -> Config:
    path = GOLDEN / f"{name}.config.toml"
    return load_config(str(path)) if path.exists() else Config()


def _check_golden(path: Path, text: str) -> None:
    if UPDATE:
        path.write_text(text)
        return
    assert path.exists(), f"{path} is missing: run with UPDATE_GOLDEN=1 to create it"
    assert text == path.read_text(), f"{path} differs (UPDATE_GOLDEN=1 regenerates it)"


@pytest.mark.parametrize("name", names())
def test_discover_output_is_pinned_for_every_fake_root(tmp_path: Path, name: str) -> None:
    inventory = discover(materialise(name, tmp_path / "node"), _config(name))
    table, js = render_table(inventory), inventory.to_json()
    assert str(tmp_path) not in table + js  # only host paths: goldens are machine-independent
    _check_golden(GOLDEN / f"{name}.txt", table)
    _check_golden(GOLDEN / f"{name}.json", js)
    assert Inventory.from_json(js) == inventory


def test_table_marks_unhealthy_devices_and_capabilities_without_files() -> None:
    inv = Inventory(
        devices=(Device(kind="nvidia.com/gpu", name="3", uuid="GPU-3", healthy=False,
                        numa_node=1, pci_bus_id="0000:4e:00.0", vendor="nvidia",
                        attributes=MappingProxyType({"name": "NVIDIA H100", "mig_mode":
                                                     "disabled"})),),
        drivers=MappingProxyType({"nvidia": Driver("nvidia", "550.54.15", "12.4",
                                                   MappingProxyType({"video": ContainerEdits()}))}),
        problems=(Problem("/dev/char/195:3", "missing (a link to /dev/nvidia3)"),),
    )
    lines = render_table(inv).splitlines()
    assert lines[2].split() == ["nvidia.com/gpu", "3", "GPU-3", "0000:4e:00.0", "1",
                                "UNHEALTHY", "disabled", "NVIDIA", "H100"]
    assert "    video  nothing found" in lines
    assert lines[-1] == "  /dev/char/195:3: missing (a link to /dev/nvidia3)"


def test_cli_discover_prints_the_table_or_json(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    materialise("trn1", tmp_path / "node")
    assert cli_main(["discover", "--root", str(tmp_path / "node")]) == 0
    out = capsys.readouterr().out
    assert out == (GOLDEN / "trn1.txt").read_text()
    assert cli_main(["discover", "--root", str(tmp_path / "node"), "--json"]) == 0
    # stdout is exactly the JSON document: logs go to stderr
    assert Inventory.from_json(capsys.readouterr().out) == Inventory.from_json(
        (GOLDEN / "trn1.json").read_text())


def test_cdi_generate_to_stdout_a_directory_or_a_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    saved = GOLDEN / "a100-mig.json"
    assert cli_main(["cdi", "generate", "--inventory", str(saved)]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert [(d["kind"], d["cdiVersion"], len(d["devices"])) for d in docs] == [
        ("nvidia.com/gpu", "0.5.0", 9), ("nvidia.com/mig", "0.5.0", 8)]  # and "all"

    out_dir = tmp_path / "var/run/cdi"
    out_dir.mkdir(parents=True)
    assert cli_main(["cdi", "generate", "--inventory", str(saved),
                     "--output", str(out_dir)]) == 0
    assert sorted(p.name for p in out_dir.iterdir()) == ["nvidia.com-gpu.yaml",
                                                         "nvidia.com-mig.yaml"]
    assert "wrote" in capsys.readouterr().out

    assert cli_main(["cdi", "generate", "--inventory", str(saved),
                     "--output", str(tmp_path / "one.yaml")]) == 2
    assert "--output: the inventory has 2 device kinds" in capsys.readouterr().err

    root = materialise("trn1", tmp_path / "node")
    (tmp_path / "node/etc/cdi").mkdir(parents=True)
    assert cli_main(["cdi", "generate", "--root", str(tmp_path / "node"),
                     "--output", str(tmp_path / "node/etc/cdi")]) == 0
    again = discover_cdi(root, ("/etc/cdi",))
    assert again.problems == ()
    assert [(k, len(again_of(again, k))) for k in ("aws.amazon.com/neuron",
                                                   "aws.amazon.com/neuroncore")] == [
        ("aws.amazon.com/neuron", 16), ("aws.amazon.com/neuroncore", 32)]


def again_of(found, kind: str) -> list:  # type: ignore[no-untyped-def]
    return [d for d in found.devices if d.kind == kind]


def test_cdi_generate_without_devices_fails_with_a_reason(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    materialise("cdi-only", tmp_path / "node")
    assert cli_main(["cdi", "generate", "--root", str(tmp_path / "node")]) == 1
    err = capsys.readouterr().err
    assert "no devices of a native family (NVIDIA, Neuron, ...): no CDI spec to write" in err
