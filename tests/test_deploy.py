"""deploy/: the shipped service files run commands the CLI accepts and give them what
they need (the DaemonSet's mounts, a systemd unit that can start before the runtime)."""

from __future__ import annotations

import json
import os
import shlex
import tomllib
from pathlib import Path
from typing import Any

import yaml

from nri_accel.cli import build_parser
from nri_accel.config import parse_config

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


def _unit_lines(key: str) -> list[str]:
    text = (DEPLOY / "systemd" / "nri-accel.service").read_text()
    return [line.split("=", 1)[1] for line in text.splitlines() if line.startswith(key + "=")]


def test_the_systemd_unit_runs_check_then_run_with_flags_the_cli_accepts() -> None:
    (pre,), (start,) = _unit_lines("ExecStartPre"), _unit_lines("ExecStart")
    parser = build_parser()
    for line, verb in ((pre, "check"), (start, "run")):
        program, *argv = shlex.split(line)
        assert os.path.basename(program) == "nri-accel"
        assert parser.parse_args(argv).verb == verb


def test_the_systemd_unit_names_no_path_that_must_exist_at_start() -> None:
    # systemd fails a unit whose ReadWritePaths/ReadOnlyPaths/InaccessiblePaths name a
    # missing path unless it is prefixed with "-": /run/nri, for one, only exists once
    # the runtime has started NRI.
    for key in ("ReadWritePaths", "ReadOnlyPaths", "InaccessiblePaths"):
        for value in _unit_lines(key):
            for path in value.split():
                assert path.startswith("-"), f"{key}={path}"


def _daemonset() -> tuple[dict[str, Any], dict[str, Any]]:
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "daemonset.yaml").read_text()))
    by_kind = {d["kind"]: d for d in docs}
    return by_kind["DaemonSet"], by_kind["ConfigMap"]


def test_every_daemonset_container_gets_what_its_command_reads() -> None:
    daemonset, configmap = _daemonset()
    pod = daemonset["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    config = parse_config(tomllib.loads(configmap["data"]["config.toml"]))
    parser = build_parser()
    verbs = []
    for container in pod["containers"]:
        args = parser.parse_args(container["args"])
        verbs.append(args.verb)
        mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}

        def host_path(path: str, mounts: dict[str, Any] = mounts) -> str | None:
            volume = mounts.get(path)
            return None if volume is None else volume.get("hostPath", {}).get("path")

        assert host_path(args.root) == "/", container["name"]  # the host at --root
        config_dir = mounts[os.path.dirname(args.config)]
        assert config_dir["configMap"]["name"] == configmap["metadata"]["name"]
        if args.verb == "run":  # the NRI socket's directory, the host's own
            socket_dir = os.path.dirname(config.nri.socket)
            assert host_path(socket_dir) == socket_dir
        if args.verb == "device-plugin":  # kubelet's device-plugin directory
            assert host_path(args.kubelet_dir) == args.kubelet_dir
    assert sorted(verbs) == ["device-plugin", "run"]


def test_the_image_runs_the_daemon_on_the_host_root() -> None:
    lines = (DEPLOY / "image" / "Dockerfile").read_text().splitlines()
    entry = json.loads(next(x for x in lines if x.startswith("ENTRYPOINT")).split(None, 1)[1])
    cmd = json.loads(next(x for x in lines if x.startswith("CMD")).split(None, 1)[1])
    assert entry == ["nri-accel"]
    args = build_parser().parse_args(cmd)
    assert (args.verb, args.root) == ("run", "/host")
