"""deploy/: what ships to nodes runs commands the CLI accepts, gets what those commands
read, and holds no privilege or host path that is not explained here.

- Kubernetes (deploy/kubernetes): the base's DaemonSets are checked as written, and every
  overlay as `kubectl kustomize` renders it. The kubectl is NRI_ACCEL_KUBECTL (CI sets
  it: tests/fetch-kubectl.sh), else one on PATH whose kustomize is v5 or later; with
  neither, the render tests are skipped, for that one reason. With NRI_ACCEL_KUBECTL set,
  a kubectl that does not render is a failure, never a skip.
- The example pods get what they ask for, through `nri-accel explain`.
- The systemd units and the image's Dockerfile.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml
from fakes.roots import materialise

from nri_accel import __version__
from nri_accel.cli import build_parser
from nri_accel.config import Config, parse_config
from nri_accel.deviceplugin.resources import resources_from_inventory
from nri_accel.inventory import Inventory

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "kubernetes"
BASE = K8S / "base"
OVERLAYS = K8S / "overlays"
EXAMPLES = K8S / "examples"
DEMO_INVENTORY = REPO / "nri_accel" / "demo" / "inventory.json"
MIXED_INVENTORY = REPO / "nri_accel" / "demo" / "mixed" / "inventory.json"  # Gaudi and AMD
KUBECTL_ENV = "NRI_ACCEL_KUBECTL"

# The annotation key the runtime drop-ins configure (tolerate_missing_plugins_annotation).
TOLERATE_MISSING_PLUGINS = "tolerate-missing-plugins.nri.io"


def parse_cli(argv: Sequence[str]) -> dict[str, Any]:
    """`argv` as `nri-accel` reads it: its options by dest."""
    argv = list(argv)
    try:
        args, unknown = build_parser().parse_known_args(argv)
    except SystemExit:
        pytest.fail(f"nri-accel refuses: {shlex.join(argv)}")
    assert not unknown, f"{unknown} are not arguments of {shlex.join(argv)}"
    return vars(args)


def load_config_text(text: str) -> Config:
    """A config.toml as the daemons read it."""
    return parse_config(tomllib.loads(text))


@pytest.mark.parametrize("verb", ["run", "device-plugin"])
def test_run_and_device_plugin_take_the_state_dir_and_metrics_flags(verb: str) -> None:
    argv = [verb, "--state-dir", "/run/nri-accel", "--metrics-address", "127.0.0.1:9479"]
    assert build_parser().parse_known_args(argv)[1] == []


# --- what may be granted, and why ----------------------------------------------------------

# Every host path a workload may mount, why, and the commands that may write to it.
HOST_PATHS: dict[str, tuple[str, frozenset[str]]] = {
    "/": ("discovery (--root /host): device nodes, sysfs, the driver's files, ld.so.cache, "
          "CDI specs; read only", frozenset()),
    "/var/run/nri": ("the runtime's NRI socket: connecting needs no write access",
                     frozenset()),
    "/var/lib/kubelet/device-plugins": ("kubelet's device-plugin directory: the plugin's "
                                        "sockets, kubelet.sock", frozenset({"device-plugin"})),
    "/run/nri-accel": ("--state-dir: the grants checkpoint and the NRI registration the "
                       "device plugin checks, kept across pod restarts", frozenset({"run"})),
}
# Commands whose container may be privileged, and why.
PRIVILEGED = {
    "run": "NVML opens /dev/nvidia*, which the device cgroup allows only to a privileged "
           "container, and nothing hands devices to the plugin that hands them out",
    "device-plugin": "NVML (discovery, XID health events) opens /dev/nvidia*, as for run",
}
# Commands whose container may run as root (the image's user is not), and why.
RUN_AS_ROOT = {
    "run": "the runtime's NRI socket is root's",
    "device-plugin": "kubelet.sock and kubelet's device-plugin directory are root's",
}
# The taints of accelerator node pools; the plugins serve the pods that tolerate them.
ACCELERATOR_TAINTS = {"nvidia.com/gpu", "aws.amazon.com/neuron", "habana.ai/gaudi",
                      "amd.com/gpu"}
# The commands each overlay runs.
OVERLAY_VERBS = {
    "default": {"run", "device-plugin"},
    "nvidia-migration": {"run", "device-plugin"},
    "standalone-nri": {"run"},
}
OVERLAY_POLICY = {"default": "kubernetes", "nvidia-migration": "kubernetes",
                  "standalone-nri": "standalone"}
NODE_SELECTOR = {"nri-accel.io/enabled": "true"}
NAMESPACE = "nri-accel"


def test_every_overlay_is_checked() -> None:
    assert sorted(p.name for p in OVERLAYS.iterdir()) == sorted(OVERLAY_VERBS)


# --- sources: the base as written, the overlays as kustomize renders them -----------------


def _kustomize_major(kubectl: str) -> int | None:
    done = subprocess.run([kubectl, "version", "--client", "-o", "json"], capture_output=True,
                          text=True, timeout=60, check=False)
    if done.returncode != 0:
        return None
    m = re.fullmatch(r"v(\d+)\..*", json.loads(done.stdout).get("kustomizeVersion", ""))
    return int(m.group(1)) if m else None


@pytest.fixture(scope="session")
def kubectl() -> str:
    given = os.environ.get(KUBECTL_ENV)
    if given:  # CI: it must work
        major = _kustomize_major(given)
        assert major is not None and major >= 5, (
            f"{KUBECTL_ENV}={given}: not a kubectl with kustomize v5+ (tests/fetch-kubectl.sh)")
        return given
    found = shutil.which("kubectl")
    if found and (_kustomize_major(found) or 0) >= 5:
        return found
    pytest.skip(f"no kubectl with kustomize v5+: export {KUBECTL_ENV}=\"$(tests/fetch-kubectl.sh "
                "CACHE_DIR)\" to render the overlays, as CI does")


def test_fetch_kubectl_fails_rather_than_printing_nothing(tmp_path) -> None:
    # CI exports what it prints: an empty NRI_ACCEL_KUBECTL would turn failures into skips.
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # the cache directory would have to be created inside a file
    done = subprocess.run([str(REPO / "tests" / "fetch-kubectl.sh"), str(blocker / "cache")],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode != 0 and done.stdout == ""


def rendered(kubectl: str, overlay: str) -> list[dict[str, Any]]:
    done = subprocess.run([kubectl, "kustomize", str(OVERLAYS / overlay)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, f"kubectl kustomize {overlay}: {done.stderr}"
    # kustomize warns on stderr about deprecated fields: none are used.
    assert done.stderr == "", f"kubectl kustomize {overlay}: {done.stderr}"
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def _raw_base() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    docs = []
    for name in kustomization["resources"]:
        docs += [d for d in yaml.safe_load_all((BASE / name).read_text()) if d]
    for gen in kustomization.get("configMapGenerator", []):  # as kustomize builds them
        data = {Path(f).name: (BASE / f).read_text() for f in gen["files"]}
        docs.append({"apiVersion": "v1", "kind": "ConfigMap",
                     "metadata": {"name": gen["name"]}, "data": data})
    return docs


def _daemonsets(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    found = [d for d in docs if d["kind"] == "DaemonSet"]
    assert found
    return found


def _containers(docs: list[dict[str, Any]]) -> list[tuple[dict, dict, dict[str, Any]]]:
    """(pod spec, container, parsed args) of every container of every DaemonSet."""
    return [(ds["spec"]["template"]["spec"], c, parse_cli(c["args"]))
            for ds in _daemonsets(docs) for c in ds["spec"]["template"]["spec"]["containers"]]


def _port(address: str) -> int:
    host, _, port = address.rpartition(":")
    assert host and port.isdigit(), address
    return int(port)


# --- the workloads: checked in the base as written and in every overlay as rendered -------


def check_placement(docs: list[dict[str, Any]]) -> None:
    """On opted-in accelerator nodes, node-critical, never two per node."""
    for ds in _daemonsets(docs):
        pod = ds["spec"]["template"]["spec"]
        name = ds["metadata"]["name"]
        assert pod["nodeSelector"] == NODE_SELECTOR, name
        assert pod["priorityClassName"] == "system-node-critical", name
        tolerated = {t["key"] for t in pod["tolerations"] if t.get("operator") == "Exists"
                     and "effect" not in t}
        assert tolerated >= ACCELERATOR_TAINTS, name
        # Two on one node would register twice with the runtime or kubelet.
        rolling = ds["spec"]["updateStrategy"]
        assert rolling["type"] == "RollingUpdate", name
        assert rolling["rollingUpdate"]["maxSurge"] == 0, name


def check_hardening(docs: list[dict[str, Any]]) -> None:
    """Pinned images, read-only root, and every privilege has its reason above."""
    for pod, c, args in _containers(docs):
        verb, sc = args["verb"], c["securityContext"]
        image = c["image"]
        assert "@sha256:" in image or image.rsplit(":", 1)[-1] == __version__, image
        assert c["imagePullPolicy"] == "IfNotPresent"
        assert sc["readOnlyRootFilesystem"] is True, verb
        if sc.get("privileged"):
            assert verb in PRIVILEGED, f"{verb}: privileged with no reason in PRIVILEGED"
        else:
            assert sc["allowPrivilegeEscalation"] is False, verb
            assert sc["capabilities"]["drop"] == ["ALL"], verb
        if sc.get("runAsUser") == 0:
            assert verb in RUN_AS_ROOT, f"{verb}: root with no reason in RUN_AS_ROOT"
        assert c["resources"]["requests"].keys() >= {"cpu", "memory"}, verb
        assert "memory" in c["resources"]["limits"], verb
        assert not any(pod.get(k) for k in ("hostNetwork", "hostPID", "hostIPC")), verb
        assert pod["automountServiceAccountToken"] is False, verb
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, verb


def check_metrics(docs: list[dict[str, Any]]) -> None:
    """Probes and Prometheus scrape annotations use the --metrics-address port."""
    for ds in _daemonsets(docs):
        template = ds["spec"]["template"]
        (c,) = template["spec"]["containers"]  # one metrics port per pod for Prometheus
        port = _port(parse_cli(c["args"])["metrics_address"])
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        probes = {}
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            get = c[kind]["httpGet"]
            assert ports.get(get["port"], get["port"]) == port, kind
            probes[kind] = get["path"]
        assert probes == {"startupProbe": "/healthz", "livenessProbe": "/healthz",
                          "readinessProbe": "/readyz"}
        assert template["metadata"]["annotations"] == {
            "prometheus.io/scrape": "true", "prometheus.io/port": str(port),
            "prometheus.io/path": "/metrics",
            # the runtime's NRI validator, with required_plugins, must let them start
            TOLERATE_MISSING_PLUGINS: "true"}


def check_host_paths(docs: list[dict[str, Any]]) -> None:
    """Every host path allowed, and mounted read-only unless HOST_PATHS says otherwise."""
    for pod, c, args in _containers(docs):
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounted = {m["name"] for m in c["volumeMounts"]}
        assert mounted == set(volumes), "a volume no container mounts, or a mount of none"
        for m in c["volumeMounts"]:
            host = volumes[m["name"]].get("hostPath")
            if host is None:
                assert m.get("readOnly") is True, m  # config
                continue
            assert host["path"] in HOST_PATHS, f"hostPath {host['path']} not in HOST_PATHS"
            writable = args["verb"] in HOST_PATHS[host["path"]][1]
            assert m.get("readOnly", False) is not writable, (args["verb"], host["path"])
            # Only the host root needs mounts made after start (a driver container's).
            expected = "HostToContainer" if host["path"] == "/" else None
            assert m.get("mountPropagation") == expected, (args["verb"], host["path"])


def check_command_inputs(docs: list[dict[str, Any]]) -> None:
    """Each command gets the host root, config, sockets and state dir its flags name."""
    configmaps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    state_dirs = set()
    for pod, c, args in _containers(docs):
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: volumes[m["name"]] for m in c["volumeMounts"]}

        def host_path(path: str, mounts: dict[str, Any] = mounts) -> str | None:
            return mounts.get(path, {}).get("hostPath", {}).get("path")

        verb = args["verb"]
        assert host_path(args["root"]) == "/", verb  # the host at --root
        configmap = configmaps[mounts[os.path.dirname(args["config"])]["configMap"]["name"]]
        config = load_config_text(configmap["data"][os.path.basename(args["config"])])
        if verb == "run":  # the NRI socket's directory, the host's own
            socket_dir = os.path.dirname(config.nri.socket)
            assert host_path(socket_dir) == socket_dir
        if verb == "device-plugin":  # kubelet's device-plugin directory
            assert host_path(args["kubelet_dir"]) == args["kubelet_dir"]
        assert host_path(args["state_dir"]) == args["state_dir"], verb
        state_dirs.add(args["state_dir"])
    assert len(state_dirs) == 1, f"run and device-plugin must share one state dir: {state_dirs}"


CHECKS = [check_placement, check_hardening, check_metrics, check_host_paths,
          check_command_inputs]


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_the_base_as_written(check) -> None:
    check(_raw_base())


@pytest.mark.parametrize("overlay", sorted(OVERLAY_VERBS))
def test_each_overlay_as_rendered(kubectl, overlay) -> None:
    """Every check of the base, and the overlay's own commands, namespace and policy."""
    docs = rendered(kubectl, overlay)
    for check in CHECKS:
        check(docs)
    assert {args["verb"] for _, _, args in _containers(docs)} == OVERLAY_VERBS[overlay]
    for d in docs:
        if d["kind"] == "Namespace":
            assert d["metadata"]["name"] == NAMESPACE
            assert d["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
        else:
            assert d["metadata"]["namespace"] == NAMESPACE, d["metadata"]["name"]
    (sa,) = [d for d in docs if d["kind"] == "ServiceAccount"]
    assert sa["automountServiceAccountToken"] is False
    for pod, _, _ in _containers(docs):
        assert pod["serviceAccountName"] == sa["metadata"]["name"]
    (configmap,) = [d for d in docs if d["kind"] == "ConfigMap"]
    assert load_config_text(configmap["data"]["config.toml"]).policy.mode == (
        OVERLAY_POLICY[overlay])


def test_kustomizations_name_only_files_that_exist() -> None:
    # What kustomize would refuse, caught where no kubectl is installed too.
    for path in K8S.rglob("kustomization.yaml"):
        k = yaml.safe_load(path.read_text())
        names = list(k.get("resources", []))
        names += [f for g in k.get("configMapGenerator", []) for f in g.get("files", [])]
        names += [p["path"] for p in k.get("patches", []) if "path" in p]
        for name in names:
            target = path.parent / name
            assert target.is_file() or (target / "kustomization.yaml").is_file(), (path, name)


def _host_paths(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [node["hostPath"]["path"]] if "hostPath" in node else []
        return found + [p for v in node.values() for p in _host_paths(v)]
    if isinstance(node, list):
        return [p for v in node for p in _host_paths(v)]
    return []


def test_no_file_under_deploy_kubernetes_mounts_a_host_path_not_allowed() -> None:
    # Patches and examples included: a hostPath anywhere is one a cluster may apply.
    for path in K8S.rglob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            for host_path in _host_paths(doc):
                assert host_path in HOST_PATHS, f"{path}: hostPath {host_path}"


def test_the_migration_overlay_advertises_no_nvidia_resource_name() -> None:
    text = (OVERLAYS / "nvidia-migration" / "config.toml").read_text()
    config = parse_config(tomllib.loads(text))  # every key, the [device_plugin] table too
    inventory = Inventory.from_json(DEMO_INVENTORY.read_text())
    names = {r.name for r in resources_from_inventory(inventory, config)[0]}
    assert "nri-accel.io/gpu" in names
    assert not {n for n in names if n.startswith("nvidia.com/")}, names


# --- the example pods ----------------------------------------------------------------------

# example -> (fake node, config, {container: the kind and number of devices granted})
EXAMPLE_GRANTS = {
    "gpu-pod.yaml": ("demo", BASE / "config.toml", {"cuda": ("nvidia.com/gpu", 1)}),
    "mig-pod.yaml": ("demo", BASE / "config.toml", {"cuda": ("nvidia.com/mig", 1)}),
    "neuron-pod.yaml": ("trn1", BASE / "config.toml", {"show": ("aws.amazon.com/neuron", 1)}),
    "gaudi-pod.yaml": ("mixed", BASE / "config.toml", {"show": ("habana.ai/gaudi", 2)}),
    "amd-pod.yaml": ("mixed", BASE / "config.toml", {"show": ("amd.com/gpu", 1)}),
    "standalone-annotation-pod.yaml": ("demo", OVERLAYS / "standalone-nri" / "config.toml",
                                       {"cuda": ("nvidia.com/gpu", 1)}),
}


def _explain(tmp_path: Path, node: str, config: Path, pod: Path,
             *extra: str) -> subprocess.CompletedProcess:
    if node == "trn1":  # mknod: needs root, as the discovery tests do
        source = ["--root", materialise("trn1", tmp_path / "trn1").root]
    else:
        source = ["--inventory", str(MIXED_INVENTORY if node == "mixed" else DEMO_INVENTORY)]
    return subprocess.run(
        [sys.executable, "-m", "nri_accel", "explain", *source, "--config", str(config),
         "--pod", str(pod), *extra],
        capture_output=True, text=True, timeout=120, check=False)


def test_every_example_is_checked() -> None:
    assert sorted(p.name for p in EXAMPLES.iterdir()) == sorted(EXAMPLE_GRANTS)


@pytest.mark.parametrize("example", sorted(EXAMPLE_GRANTS))
def test_each_example_pod_gets_what_it_asks_for(tmp_path, example) -> None:
    node, config, grants = EXAMPLE_GRANTS[example]
    pod = yaml.safe_load((EXAMPLES / example).read_text())
    for c in pod["spec"]["containers"]:
        tag = c["image"].rsplit("/", 1)[-1].partition(":")[2]
        assert tag and tag != "latest", c["image"]
    got = {}
    for c in pod["spec"]["containers"]:
        done = _explain(tmp_path / c["name"], node, config, EXAMPLES / example,
                        "--container", c["name"], "--json")
        assert done.returncode == 0, done.stderr
        granted = json.loads(done.stdout)["annotations"]["nri-accel.io/granted"].split(",")
        kinds = {g.partition("=")[0] for g in granted}
        assert len(kinds) == 1, granted
        got[c["name"]] = (kinds.pop(), len(granted))
    assert got == grants


def test_the_annotation_example_is_refused_under_the_kubernetes_policy(tmp_path) -> None:
    done = _explain(tmp_path, "demo", BASE / "config.toml",
                    EXAMPLES / "standalone-annotation-pod.yaml")
    assert done.returncode == 1
    assert "devices.nri-accel.io/pod" in done.stderr


# --- systemd -------------------------------------------------------------------------------

UNITS = DEPLOY / "systemd"
NRI_UNIT = "nri-accel.service"
DP_UNIT = "nri-accel-device-plugin.service"


def _unit(name: str) -> dict[str, list[str]]:
    """Key -> values of a unit file (continuation lines joined, comments dropped)."""
    keys: dict[str, list[str]] = {}
    text = re.sub(r"\\\n", " ", (UNITS / name).read_text())
    for line in text.splitlines():
        if "=" in line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            keys.setdefault(key.strip(), []).append(" ".join(value.split()))
    return keys


def _unit_argv(line: str) -> list[str]:
    program, *argv = shlex.split(line)
    assert os.path.basename(program) == "nri-accel"
    return argv


def test_the_systemd_units_run_commands_the_cli_accepts() -> None:
    nri, dp = _unit(NRI_UNIT), _unit(DP_UNIT)
    assert parse_cli(_unit_argv(nri["ExecStartPre"][0]))["verb"] == "check"
    assert [parse_cli(_unit_argv(x))["verb"] for x in nri["ExecStart"]] == ["run"]
    assert [parse_cli(_unit_argv(x))["verb"] for x in dp["ExecStart"]] == ["device-plugin"]


def test_the_units_share_a_state_dir_that_outlives_a_restart() -> None:
    nri, dp = _unit(NRI_UNIT), _unit(DP_UNIT)
    run = parse_cli(_unit_argv(nri["ExecStart"][0]))
    plugin = parse_cli(_unit_argv(dp["ExecStart"][0]))
    assert run["state_dir"] == plugin["state_dir"] == "/run/" + nri["RuntimeDirectory"][0]
    assert nri["RuntimeDirectoryPreserve"] == ["yes"]
    # The device plugin only reads it: not its RuntimeDirectory, which stopping it with
    # "Preserve=no" would remove from under the NRI plugin.
    assert "RuntimeDirectory" not in dp
    assert plugin["kubelet_dir"] in [p.lstrip("-") for p in dp["ReadWritePaths"]]


def test_the_device_plugin_unit_starts_the_nri_plugin_but_not_kubelet() -> None:
    dp = _unit(DP_UNIT)
    assert dp["Wants"] == [NRI_UNIT]
    assert set(dp["After"][0].split()) == {NRI_UNIT, "kubelet.service"}
    assert not {"Requires", "BindsTo", "PartOf", "Requisite"} & dp.keys()


def test_the_units_serve_metrics_on_the_loopback_on_ports_of_their_own() -> None:
    ports = set()
    for name in (NRI_UNIT, DP_UNIT):
        unit = _unit(name)
        address = parse_cli(_unit_argv(unit["ExecStart"][0]))["metrics_address"]
        host, _, port = address.rpartition(":")
        assert host == "127.0.0.1", name
        assert unit["IPAddressAllow"] == ["localhost"] and unit["IPAddressDeny"] == ["any"]
        ports.add(port)
    assert len(ports) == 2


def test_both_units_are_hardened_alike_and_keep_what_discovery_needs() -> None:
    own = {"Description", "ExecStart", "ExecStartPre", "RestartSec", "After", "Wants",
           "RuntimeDirectory", "RuntimeDirectoryMode", "RuntimeDirectoryPreserve",
           "ReadWritePaths"}
    nri, dp = _unit(NRI_UNIT), _unit(DP_UNIT)
    assert {k: v for k, v in nri.items() if k not in own} == {
        k: v for k, v in dp.items() if k not in own}
    assert nri["ProtectSystem"] == ["strict"] and nri["NoNewPrivileges"] == ["yes"]
    # NVML opens /dev/nvidia*; the NVIDIA MPS pipe directory is /tmp/nvidia-mps.
    assert not {"PrivateDevices", "PrivateTmp", "DevicePolicy"} & nri.keys()


def test_the_systemd_units_name_no_path_that_must_exist_at_start() -> None:
    # systemd fails a unit whose ReadWritePaths/ReadOnlyPaths/InaccessiblePaths name a
    # missing path unless it is prefixed with "-": /run/nri, for one, only exists once
    # the runtime has started NRI.
    for name in (NRI_UNIT, DP_UNIT):
        unit = _unit(name)
        for key in ("ReadWritePaths", "ReadOnlyPaths", "InaccessiblePaths"):
            for value in unit.get(key, []):
                for path in value.split():
                    assert path.startswith("-"), f"{name}: {key}={path}"


# --- the image -----------------------------------------------------------------------------


def _dockerfile() -> list[tuple[str, str]]:
    """(instruction, arguments) of deploy/image/Dockerfile, ARG defaults substituted."""
    text = re.sub(r"\\\n", " ", (DEPLOY / "image" / "Dockerfile").read_text())
    out, args = [], {}
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        instruction, _, rest = line.strip().partition(" ")
        rest = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), rest)
        if instruction == "ARG" and "=" in rest:
            name, _, default = rest.partition("=")
            args[name] = default
        out.append((instruction, rest))
    return out


def test_the_image_runs_the_daemon_on_the_host_root() -> None:
    lines = dict(_dockerfile())
    assert json.loads(lines["ENTRYPOINT"]) == ["nri-accel"]
    args = parse_cli(json.loads(lines["CMD"]))
    assert (args["verb"], args["root"]) == ("run", "/host")


def test_the_image_is_built_in_stages_from_a_base_pinned_by_digest() -> None:
    lines = _dockerfile()
    froms = [rest.split() for instruction, rest in lines if instruction == "FROM"]
    stages = {f[2] for f in froms if len(f) == 3 and f[1].upper() == "AS"}
    assert len(froms) >= 2
    for f in froms:
        assert f[0] in stages or re.search(r"@sha256:[0-9a-f]{64}$", f[0]), f[0]
    last = max(i for i, (instruction, _) in enumerate(lines) if instruction == "FROM")
    final = [instruction for instruction, _ in lines[last:]]
    assert "RUN" not in final, "the final stage copies the built environment, nothing else"
    (user,) = [rest for instruction, rest in lines[last:] if instruction == "USER"]
    assert user.split(":")[0] not in ("0", "root")


def _commented_table(path: Path, header: str) -> dict[str, Any]:
    """The TOML table a drop-in shows commented out, from `# <header>` on, uncommented."""
    lines = path.read_text().splitlines()
    start = lines.index(f"# {header}")
    return tomllib.loads("\n".join(line.removeprefix("#").strip() for line in lines[start:]))


def test_the_runtime_drop_ins_show_the_validator_that_requires_nri_accel() -> None:
    # The keys are upstream's: containerd's [plugins."io.containerd.nri.v1.nri"]
    # default_validator (nri plugins/default-validator DefaultValidatorConfig), CRI-O's
    # [crio.nri.default_validator]; the toleration key is the one the DaemonSets carry.
    containerd = _commented_table(DEPLOY / "containerd" / "nri-accel.toml",
                                  '[plugins."io.containerd.nri.v1.nri".default_validator]')
    assert containerd == {"plugins": {"io.containerd.nri.v1.nri": {"default_validator": {
        "enable": True, "required_plugins": ["nri-accel"],
        "tolerate_missing_plugins_annotation": TOLERATE_MISSING_PLUGINS}}}}
    crio = _commented_table(DEPLOY / "crio" / "10-nri-accel.conf", "[crio.nri.default_validator]")
    assert crio == {"crio": {"nri": {"default_validator": {
        "nri_enable_default_validator": True, "nri_validator_required_plugins": ["nri-accel"],
        "nri_validator_tolerate_missing_plugins_annotation": TOLERATE_MISSING_PLUGINS}}}}
