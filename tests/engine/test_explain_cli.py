"""`nri-accel explain`: golden outputs for the demo pods, and the manifest reader.

Golden files live in tests/golden/explain/, those of the default (a100) demo node at the
top and those of every other demo node (nri_accel.demo.NODES) in a directory named after
it (mixed/): <pod>.txt holds the exit status, stdout and stderr of `explain` for one
demo pod (readable form), <pod>.json the --json stdout of a pod that is granted,
demo-all.txt the node's whole demo file explained at once (one Engine, so later pods see
what earlier ones hold). Regenerate after an intended change with
`UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/engine/test_explain_cli.py` and review
the diff.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from engine_testing import (
    DEMO_CONFIG,
    DEMO_PODS,
    REPO,
    cli_logs_to_sink,
    demo_inventory,
)
from fakes.roots import materialise

from nri_accel.cli import main
from nri_accel.demo import DEFAULT_NODE, NODES

GOLDEN = REPO / "tests" / "golden" / "explain"
UPDATE = os.environ.get("UPDATE_GOLDEN") == "1"


@pytest.fixture(autouse=True)
def _logs(monkeypatch):
    with cli_logs_to_sink(monkeypatch):
        yield


def golden_dir(node: str) -> str:
    """Where a demo node's golden files live, relative to GOLDEN."""
    return "" if node == DEFAULT_NODE else f"{node}/"


DEMO_DOCS = [(node, d) for node, demo in NODES.items()
             for d in yaml.safe_load_all(demo.pods.read_text()) if d]


def explain(capsys, pod: Path, *extra: str, node: str = DEFAULT_NODE) -> tuple[int, str, str]:
    rc = main(["explain", "--inventory", str(NODES[node].inventory), "--config",
               str(DEMO_CONFIG), "--pod", str(pod), *extra])
    out, err = capsys.readouterr()
    return rc, out, err


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"{path} missing: run with UPDATE_GOLDEN=1 to create it"
    assert text == path.read_text(), f"{name} differs from its golden file"


def transcript(rc: int, out: str, err: str) -> str:
    return f"exit: {rc}\n--- stdout ---\n{out}--- stderr ---\n{err}"


@pytest.mark.parametrize(("node", "doc"), DEMO_DOCS,
                         ids=[f"{node}/{d['metadata']['name']}" for node, d in DEMO_DOCS])
def test_demo_pod_golden(capsys, tmp_path, node, doc):
    name = doc["metadata"]["name"]
    pod = tmp_path / f"{name}.yaml"
    pod.write_text(yaml.safe_dump(doc))
    rc, out, err = explain(capsys, pod, node=node)
    golden = golden_dir(node) + name
    check_golden(f"{golden}.txt", transcript(rc, out, err).replace(str(tmp_path), "<tmp>"))
    rc_json, out_json, _ = explain(capsys, pod, "--json", node=node)
    assert rc_json == rc
    if rc == 0:
        json.loads(out_json)
        check_golden(f"{golden}.json", out_json)


def test_demo_pods_expected_outcomes():
    """What the demo promises, independent of the golden files' exact text."""
    expected = {"cuda-one": 0, "train-two": 0, "env-visible": 0, "mig-inference": 0,
                "notebook": 0, "grab-all": 1, "malformed": 1}
    for name, rc in expected.items():
        text = (GOLDEN / f"{name}.txt").read_text()
        assert text.startswith(f"exit: {rc}\n"), name
    mig = (GOLDEN / "mig-inference.txt").read_text()
    assert "devices.nri-accel.io/resource.nvidia.com_mig-1g.10gb=nvidia.com/mig=MIG-" in mig
    assert "nvidia.com/mig=7:2 " in mig  # the demo node's one 1g.10gb MIG device
    assert "annotation devices.nri-accel.io/pod" in (GOLDEN / "grab-all.txt").read_text()
    assert "../../dev/mem" in (GOLDEN / "malformed.txt").read_text()


def test_mixed_demo_pods_expected_outcomes():
    """What the mixed node's pods promise, independent of the golden files' exact text:
    each family's env names the granted devices (HABANA_VISIBLE_MODULES their module
    ids in the same order), AMD GPUs come with /dev/kfd, the untrusted env is rewritten
    to grant nothing, and the refusals name the variable."""
    expected = {"gaudi-train": 0, "gaudi-env": 0, "rocm-one": 0, "rocm-env": 0,
                "grab-env": 0, "gaudi-reset": 1, "rocm-uuid": 1}
    text = {name: (GOLDEN / "mixed" / f"{name}.txt").read_text() for name in expected}
    for name, rc in expected.items():
        assert text[name].startswith(f"exit: {rc}\n"), name
    assert "HABANA_VISIBLE_DEVICES=4,6\n    HABANA_VISIBLE_MODULES=7,4\n" in text["gaudi-train"]
    assert "HABANA_VISIBLE_DEVICES=0,3\n    HABANA_VISIBLE_MODULES=3,2\n" in text["gaudi-env"]
    assert "/dev/dri/renderD129 c 226:129\n    /dev/kfd c 235:0\n" in text["rocm-one"]
    assert "AMD_VISIBLE_DEVICES=2,3\n" in text["rocm-env"]
    assert "AMD_VISIBLE_DEVICES=none\n    HABANA_VISIBLE_DEVICES=none\n" in text["grab-env"]
    assert "devices: none" in text["grab-env"]
    assert "env HABANA_VISIBLE_DEVICES: habana.ai/gaudi=5 is unhealthy (Needs reset)" \
        in text["gaudi-reset"]
    assert "env AMD_VISIBLE_DEVICES: 'GPU-3a5c4e1f2b7d9086' is ROCm's UUID form" \
        in text["rocm-uuid"]


@pytest.mark.parametrize("node", NODES)
def test_whole_demo_file_golden(capsys, node):
    rc, out, err = explain(capsys, NODES[node].pods, node=node)
    assert rc == 1  # two demo pods are refused
    check_golden(f"{golden_dir(node)}demo-all.txt", transcript(rc, out, err))


def test_whole_demo_file_hands_counted_devices_out_once(capsys):
    _, out, _ = explain(capsys, DEMO_PODS, "--json")
    doc = json.loads(out)
    granted = [doc[k]["annotations"]["nri-accel.io/granted"] for k in
               ("ml/cuda-one/main", "research/train-two/trainer", "ml/mig-inference/server")]
    names = [n for g in granted for n in g.split(",")]
    assert len(names) == len(set(names)) == 4


# ---- the manifest reader ---------------------------------------------------------------------

def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "pod.yaml"
    p.write_text(text)
    return p


POD_TWO = """
apiVersion: v1
kind: Pod
metadata: {name: two, namespace: research}
spec:
  initContainers:
    - name: init
      env: [{name: NVIDIA_VISIBLE_DEVICES, value: "0"}]
  containers:
    - name: app
      env:
        - {name: NVIDIA_VISIBLE_DEVICES, value: "1"}
        - name: FROM_SECRET
          valueFrom: {secretKeyRef: {name: s, key: k}}
      resources: {limits: {cpu: "1", example.com/fpga: 1}}
"""


def test_every_container_in_creation_order_and_notes(capsys, tmp_path):
    rc, out, err = explain(capsys, write(tmp_path, POD_TWO))
    assert rc == 0 and err == ""
    assert out.index("container init") < out.index("container app")
    assert "env FROM_SECRET: valueFrom cannot be resolved offline" in out
    assert "resource example.com/fpga: not advertised by nri-accel's device plugin" in out


def test_container_flag_picks_one_and_json_is_the_bare_adjustment(capsys, tmp_path):
    rc, out, _ = explain(capsys, write(tmp_path, POD_TWO), "--container", "app", "--json")
    assert rc == 0
    doc = json.loads(out)
    gpu1 = demo_inventory().find("nvidia.com/gpu", "1")
    assert doc["annotations"] == {"nri-accel.io/granted": f"nvidia.com/gpu={gpu1.uuid}"}
    env = {e["key"]: e["value"] for e in doc["env"]}
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"
    assert "/dev/nvidia1" in [d["path"] for d in doc["linux"]["devices"]]


def test_several_containers_json_is_keyed_by_namespace_pod_and_container(capsys, tmp_path):
    rc, out, _ = explain(capsys, write(tmp_path, POD_TWO), "--json")
    assert rc == 0
    assert sorted(json.loads(out)) == ["research/two/app", "research/two/init"]


def test_pods_of_one_name_in_two_namespaces_stay_apart(capsys, tmp_path):
    pods = POD_TWO + "---\n" + POD_TWO.replace("namespace: research", "namespace: other")
    rc, out, _ = explain(capsys, write(tmp_path, pods), "--json")
    assert rc == 0
    assert sorted(json.loads(out)) == ["other/two/app", "other/two/init",
                                       "research/two/app", "research/two/init"]


def test_unknown_container_is_a_usage_error(capsys, tmp_path):
    rc, _, err = explain(capsys, write(tmp_path, POD_TWO), "--container", "nope")
    assert rc == 2
    assert "no container named 'nope'" in err


def test_workload_templates_and_lists(capsys, tmp_path):
    text = """
kind: List
items:
  - kind: Deployment
    metadata: {name: web, namespace: ml}
    spec:
      template:
        metadata: {annotations: {a: b}}
        spec:
          containers: [{name: srv, resources: {limits: {nvidia.com/gpu: 2}}}]
  - kind: CronJob
    metadata: {name: nightly, namespace: ml}
    spec:
      jobTemplate:
        spec:
          template:
            spec:
              containers: [{name: job, resources: {limits: {nvidia.com/gpu: "1"}}}]
"""
    rc, out, err = explain(capsys, write(tmp_path, text))
    assert (rc, err) == (0, "")
    assert "pod ml/web, container srv" in out and "pod ml/nightly, container job" in out
    assert out.count("nvidia.com/gpu=") >= 3


@pytest.mark.parametrize(("text", "message"), [
    ("kind: Service\nmetadata: {name: x}\n",
     "no Pod in this file ("),
    ("{not yaml", "not valid YAML"),
    ("kind: Pod\nmetadata: {name: x}\nspec: {containers: []}\n", "the pod has no containers"),
    ("kind: Pod\nmetadata: {name: x, annotations: {a: 1}}\nspec: {containers: [{name: c}]}\n",
     "quote numbers"),
    ("kind: Pod\nspec: {containers: [{name: c, resources: {limits: {nvidia.com/gpu: 1.5}}}]}\n",
     "whole number"),
    ("", "no Pod in this file"),
])
def test_bad_manifests_are_usage_errors_naming_the_file(capsys, tmp_path, text, message):
    pod = write(tmp_path, text)
    rc, out, err = explain(capsys, pod)
    assert rc == 2 and out == ""
    assert str(pod) in err and message in err


def test_objects_beside_the_pod_are_skipped_and_said(capsys, tmp_path):
    pod = write(tmp_path, "kind: ConfigMap\nmetadata: {name: cfg}\ndata: {a: b}\n---\n"
                          "kind: Pod\nmetadata: {name: p}\nspec: {containers: [{name: c}]}\n")
    rc, out, err = explain(capsys, pod)
    assert rc == 0 and "pod default/p, container c" in out
    assert err == (f"nri-accel: skipped {pod}: document 1: kind 'ConfigMap' is not a Pod "
                   "(nor a List or workload of Pods)\n")


def test_missing_manifest(capsys, tmp_path):
    rc, _, err = explain(capsys, tmp_path / "absent.yaml")
    assert rc == 2 and "absent.yaml" in err


def test_explain_against_a_live_root(capsys, tmp_path):
    """--root runs discovery: here the checked-in trn1 fake root (16 Trainium devices of
    2 NeuronCores each on a NeuronLink torus)."""
    root = materialise("trn1", tmp_path / "trn1")
    pod = write(tmp_path, """
kind: Pod
metadata: {name: neuron, namespace: research}
spec:
  containers:
    - name: train
      env: [{name: AWS_NEURON_VISIBLE_DEVICES, value: "2-3"}]
    - name: plugin
      resources: {limits: {aws.amazon.com/neuron: 2}}
""")
    rc = main(["explain", "--root", root.root, "--config", str(DEMO_CONFIG), "--pod", str(pod),
               "--json"])
    out, err = capsys.readouterr()
    assert (rc, err) == (0, "")
    doc = json.loads(out)
    env = {e["key"]: e["value"] for e in doc["research/neuron/train"]["env"]}
    assert env == {"AWS_NEURON_VISIBLE_DEVICES": "2,3", "NEURON_RT_VISIBLE_CORES": "4-7"}
    assert [d["path"] for d in doc["research/neuron/train"]["linux"]["devices"]] == [
        "/dev/neuron2", "/dev/neuron3"]
    # The device-plugin container gets two by count, never the ones "train" holds.
    picked = doc["research/neuron/plugin"]["annotations"]["nri-accel.io/granted"].split(",")
    assert len(picked) == 2 and not {"aws.amazon.com/neuron=2", "aws.amazon.com/neuron=3"} & set(
        picked)
