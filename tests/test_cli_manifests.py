"""`nri-accel explain --pod`: a manifest that is no Pod manifest at all (not UTF-8, nested
past what the parser can walk, keys of the wrong type) is a usage error, exit 2, naming
the file and the key, never a traceback; and a saved inventory that cannot be read is one
too (README, "Command line": exit status 2 is a usage, configuration or manifest error).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from nri_accel.cli import main

INVENTORY = Path(__file__).resolve().parent / "golden" / "discover" / "a100-mig.json"
POD = "kind: Pod\nmetadata: {name: p}\nspec: {containers: [{name: c}]}\n"


def explain(capsys: pytest.CaptureFixture[str], pod: Path,
            inventory: Path = INVENTORY) -> tuple[int, str, str]:
    rc = main(["explain", "--inventory", str(inventory), "--pod", str(pod)])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize(("data", "message"), [
    (b"\xff", "not UTF-8 text (byte 0xff at offset 0)"),
    (POD.encode() + b"# caf\xe9\n", "not UTF-8 text (byte 0xe9 at offset"),
    (b"[" * 5000, "nested too deeply"),
    (b"a: " + b"{b: " * 5000 + b"}" * 5000, "nested too deeply"),
])
def test_an_unparsable_manifest_is_a_usage_error_naming_the_file(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, data: bytes, message: str) -> None:
    pod = tmp_path / "pod.yaml"
    pod.write_bytes(data)
    rc, out, err = explain(capsys, pod)
    assert (rc, out) == (2, "")
    assert err.startswith(f"nri-accel: {pod}: ") and message in err
    assert "Traceback" not in err


@pytest.mark.parametrize(("text", "message"), [
    ("kind: [x]\n", "document 1.kind: expected a string, got list"),
    ("kind: {a: 1}\n", "document 1.kind: expected a string, got dict"),
    ("kind: List\nitems: [{kind: [Pod]}]\n", "document 1.items[0].kind: expected a string"),
    ("kind: Pod\nmetadata: [x]\nspec: {containers: [{name: c}]}\n",
     "metadata: expected a mapping, got list"),
    ("kind: Pod\nmetadata: {name: {a: 1}}\nspec: {containers: [{name: c}]}\n",
     "metadata.name: expected a string, got dict"),
    ("kind: Pod\nmetadata: {name: p}\nspec: [x]\n", "pod p: spec: expected a mapping"),
    ("kind: Deployment\nmetadata: [x]\nspec: {template: {spec: {}}}\n",
     "document 1.metadata: expected a mapping"),
    ("kind: Job\nspec: {template: {metadata: 7}}\n", "template metadata: expected a mapping"),
    ("kind: CronJob\nspec: {jobTemplate: [x]}\n", "spec.jobTemplate: expected a mapping"),
])
def test_a_key_of_the_wrong_type_is_named(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                          text: str, message: str) -> None:
    pod = tmp_path / "pod.yaml"
    pod.write_text(text)
    rc, out, err = explain(capsys, pod)
    assert (rc, out) == (2, "")
    assert str(pod) in err and message in err, err


def test_a_list_that_holds_itself_is_refused(capsys: pytest.CaptureFixture[str],
                                             tmp_path: Path) -> None:
    # a YAML alias to an enclosing node: without a bound, the walk would recurse forever
    pod = tmp_path / "pod.yaml"
    pod.write_text("&self {kind: List, items: [*self]}\n")
    rc, _, err = explain(capsys, pod)
    assert rc == 2 and str(pod) in err and "Lists nested more than 8 deep" in err


def test_a_valid_manifest_still_works(capsys: pytest.CaptureFixture[str],
                                      tmp_path: Path) -> None:
    pod = tmp_path / "pod.yaml"
    pod.write_text("# café: UTF-8 comments are fine\n" + POD)
    rc, out, err = explain(capsys, pod)
    assert (rc, err) == (0, "")
    assert "pod default/p, container c" in out


@pytest.mark.parametrize("text", ['{"schema_version": 1', '{"schema_version": 99}', "[]"])
def test_an_unreadable_inventory_is_a_usage_error(capsys: pytest.CaptureFixture[str],
                                                  tmp_path: Path, text: str) -> None:
    inventory = tmp_path / "node.json"
    inventory.write_text(text)
    pod = tmp_path / "pod.yaml"
    pod.write_text(POD)
    rc, out, err = explain(capsys, pod, inventory)
    assert (rc, out) == (2, "")
    assert err.startswith(f"nri-accel: {inventory}: ")
    assert main(["cdi", "generate", "--inventory", str(inventory)]) == 2
    assert str(inventory) in capsys.readouterr().err
