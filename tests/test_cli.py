"""The command line: help for every verb, version, and exit codes for bad input."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from nri_accel import __version__
from nri_accel.cli import build_parser, main

DEMO_INVENTORY = Path(__file__).resolve().parents[1] / "nri_accel" / "demo" / "inventory.json"
VERBS = ["run", "discover", "explain", "cdi", "device-plugin", "check", "demo", "version"]


def test_every_stable_verb_has_help(capsys) -> None:
    for verb in VERBS:
        with pytest.raises(SystemExit) as e:
            main([verb, "--help"])
        assert e.value.code == 0
        out = capsys.readouterr().out
        assert f"nri-accel {verb}" in out


def test_stable_flags_exist() -> None:
    p = build_parser()
    run = p.parse_args(["run", "--socket", "/s", "--name", "n", "--idx", "10",
                        "--config", "c", "--inventory", "i"])
    assert (run.socket, run.name, run.idx, run.config, run.inventory) == ("/s", "n", "10", "c", "i")
    exp = p.parse_args(["explain", "--root", "/r", "--pod", "p.yaml", "--container", "c", "--json"])
    assert (exp.root, exp.pod, exp.container, exp.json) == ("/r", "p.yaml", "c", True)
    gen = p.parse_args(["cdi", "generate", "--inventory", "i", "--output", "o"])
    assert gen.output == "o"
    dp = p.parse_args(["device-plugin", "--kubelet-dir", "/k", "--config", "c"])
    assert dp.kubelet_dir == "/k"


def test_inventory_and_root_are_exclusive(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["explain", "--inventory", "a", "--root", "/", "--pod", "p"])
    assert e.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


@pytest.mark.parametrize("module", ["nri_accel", "nri_accel.cli"])
def test_version(module: str) -> None:
    out = subprocess.run([sys.executable, "-m", module, "version"],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == f"nri-accel {__version__}"


def test_bad_config_exits_2_naming_the_key(tmp_path, capsys) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('[policy]\nmode = "open"\n')
    rc = main(["check", "--config", str(cfg), "--inventory", str(tmp_path / "x.json")])
    assert rc == 2
    assert "policy.mode" in capsys.readouterr().err


def _verb_parsers(parser: argparse.ArgumentParser, prefix: str = "", *,
                  inner: bool = True) -> dict[str, Any]:
    """{"run": parser, "cdi generate": parser, ...}: every verb's own parser (inner=False:
    the top level's, "cdi" included)."""
    out: dict[str, Any] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                verbs = _verb_parsers(sub, f"{prefix}{name} ") if inner else {}
                out.update(verbs or {f"{prefix}{name}": sub})
    return out


def test_the_readme_synopsis_names_exactly_the_flags_of_each_verb() -> None:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = readme.split("## Command line", 1)[1].split("```", 2)[1]
    synopsis: dict[str, set[str]] = {}
    verb = ""
    for line in block.splitlines():
        if line.startswith("nri-accel "):
            words = line.split()
            verb = " ".join(words[1:3] if words[1] == "cdi" else words[1:2])
            synopsis[verb] = set()
        if verb:
            synopsis[verb] |= set(re.findall(r"--[a-z][a-z-]*", line))
    parsers = _verb_parsers(build_parser())
    assert set(synopsis) == set(parsers)
    for name, sub in parsers.items():
        flags = {s for a in sub._actions for s in a.option_strings
                 if s.startswith("--") and s != "--help"}
        assert synopsis[name] == flags, name


def test_run_imports_none_of_what_it_does_not_use() -> None:
    # `run` starts before the runtime registers it (issue #10: start to registered):
    # grpc (the device plugin), PyYAML (an injector CDI annotation: imported when one
    # comes), prometheus_client (--metrics-address), pynvml (discovery) and protobuf's
    # JSON rendering (explain) load only where used. The discoverers (nri_accel.discover)
    # are still imported by the vendor profiles. Through the process's entry, asyncio
    # comes without ssl (nri_accel.__main__): no TLS is spoken.
    unused = ("grpc", "yaml", "prometheus_client", "pynvml", "nri_accel.deviceplugin",
              "google.protobuf.json_format", "tempfile", "ssl")
    code = ("import sys, nri_accel.__main__, nri_accel.plugin; "
            f"print(','.join(m for m in {unused!r} if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                            text=True)
    assert result.stdout.strip() == ""


def test_the_entry_turns_the_collector_on_again_and_leaves_ssl_importable() -> None:
    # nri_accel.__main__ holds the collector off while the modules load, then freezes
    # what they built; asyncio came without ssl, which any later import still gets.
    code = """
import gc, sys
from nri_accel.__main__ import main
import asyncio.base_events
loading = gc.isenabled()
sys.argv = ["nri-accel", "version"]
main()
import ssl
print(loading, gc.isenabled(), gc.get_freeze_count() > 10_000,
      asyncio.base_events.ssl is None, bool(ssl.OPENSSL_VERSION))
"""
    result = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                            text=True)
    assert result.stdout.split() == ["nri-accel", __version__,
                                     "False", "True", "True", "True", "True"]


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """stderr of a command line argparse refuses (exit status 2)."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["run", "--socket", ""], ["check", "--socket", ""], ["run", "--config", ""],
    ["run", "--state-dir", ""], ["run", "--log-file", ""], ["discover", "--root", ""],
    ["explain", "--inventory", "", "--pod", "p"], ["explain", "--root", "/", "--pod", ""],
    ["cdi", "generate", "--output", ""], ["device-plugin", "--kubelet-dir", ""],
])
def test_an_empty_path_is_refused_naming_the_flag(capsys, argv: list[str]) -> None:
    # an empty --socket or --state-dir used to mean the default, an empty --config or
    # --pod an error naming no file
    flag = argv[argv.index("") - 1]
    err = _refused(capsys, argv)
    assert f"argument {flag}: " in err and "empty" in err


@pytest.mark.parametrize("verb", ["run", "check"])
def test_a_socket_path_over_the_unix_limit_is_refused(capsys, verb: str) -> None:
    fits = "/" + "s" * 106  # 107 bytes: the most a unix socket path holds on Linux
    assert build_parser().parse_args([verb, "--socket", fits]).socket == fits
    err = _refused(capsys, [verb, "--socket", fits + "s"])
    assert "argument --socket: " in err
    assert "is 108 bytes long, over the 107-byte limit of a unix socket path" in err
    assert "at most 107 bytes" in _verb_parsers(build_parser())[verb].format_help()


@pytest.mark.parametrize(("argv", "why"), [
    (["run", "--socket", "nri.sock"], "'nri.sock' must be an absolute path"),
    (["check", "--socket", "run/nri.sock"], "'run/nri.sock' must be an absolute path"),
    (["run", "--state-dir", "state"], "'state' must be an absolute path without '..'"),
    (["device-plugin", "--state-dir", "/var/../tmp"],
     "'/var/../tmp' must be an absolute path without '..'"),
])
def test_relative_socket_and_state_dir_are_refused_as_in_the_config(
        capsys, argv: list[str], why: str) -> None:
    # relative, they would follow the working directory: `run` and `device-plugin`
    # could share nothing (nri.socket and state_dir refuse the same)
    err = _refused(capsys, argv)
    assert f"argument {argv[1]}: {why}" in err


def test_a_log_file_that_cannot_be_opened_stops_run(tmp_path, capsys) -> None:
    missing = tmp_path / "no" / "dir" / "nri-accel.log"
    code = main(["run", "--log-file", str(missing), "--inventory", str(DEMO_INVENTORY),
                 "--socket", str(tmp_path / "nri.sock"), "--state-dir", str(tmp_path)])
    assert code == 2
    err = capsys.readouterr().err
    assert f"--log-file {missing}: cannot open: No such file or directory" in err
    assert "fatal_error" not in err  # said once, before logging is set up


def test_a_kubelet_dir_whose_socket_path_is_too_long_is_refused(capsys) -> None:
    fits = "/" + "k" * (107 - len("/kubelet.sock") - 1)
    assert build_parser().parse_args(["device-plugin", "--kubelet-dir", fits]).kubelet_dir == fits
    err = _refused(capsys, ["device-plugin", "--kubelet-dir", fits + "k"])
    assert "argument --kubelet-dir: " in err
    assert "its kubelet.sock path is 108 bytes long, over the 107-byte limit" in err


def test_help_says_what_each_verb_does_and_explain_its_exit_statuses() -> None:
    parsers = _verb_parsers(build_parser())
    top = _verb_parsers(build_parser(), inner=False)
    for name, sub in [*parsers.items(), ("cdi", top["cdi"])]:
        assert sub.description, f"`nri-accel {name} --help` has no description"
    explain = parsers["explain"].format_help()
    assert "exit 1" in explain and "exit 2" in explain  # as README's "Command line"
    root = next(a for a in parsers["explain"]._actions if "--root" in a.option_strings)
    assert "default" not in root.help  # one of --inventory and --root is required
    root = next(a for a in parsers["run"]._actions if "--root" in a.option_strings)
    assert "default /" in root.help
    assert "2 usage or" in build_parser().format_help()
