"""Config file parsing: defaults, every key, and errors that name file and key."""

from __future__ import annotations

import pytest

from nri_accel.config import (
    MAX_INTERVAL,
    UNIX_PATH_MAX,
    Config,
    DevicePluginConfig,
    HealthConfig,
    load_config,
    parse_config,
    unix_socket_path_problem,
)
from nri_accel.errors import ConfigError


def test_defaults_when_no_file(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr("nri_accel.config.DEFAULT_CONFIG_PATH", str(tmp_path / "absent.toml"))
    cfg = load_config(None)
    assert cfg == Config()
    assert cfg.policy.mode == "kubernetes"
    assert cfg.devices.hooks is False  # no hook by default (DESIGN.md, CVE notes)
    assert cfg.health == HealthConfig(True, frozenset(), 60.0)
    assert cfg.nri.socket == "/var/run/nri/nri.sock"
    assert cfg.nri.event_loop == "auto"  # uvloop where it imports (App.run_loop)


def test_full_file(tmp_path) -> None:
    p = tmp_path / "c.toml"
    p.write_text("""
[policy]
mode = "standalone"
trusted_namespaces = ["ml-team", "ci"]
[nri]
socket = "/run/x.sock"
idx = "07"
event_loop = "asyncio"
[devices]
cdi_passthrough = true
[discovery]
cdi_spec_dirs = ["/etc/cdi"]
refresh_interval = 0
create_device_nodes = true
[health]
enabled = false
ignored_xids = [48, 63]
recheck_interval = 5
[log]
level = "DEBUG"
[device_plugin]
mig_strategy = "single"
[device_plugin.resource_names]
"nvidia.com/gpu" = "nri-accel.io/gpu"
"aws.amazon.com/neuroncore" = ""
[device_plugin.replicas]
"nri-accel.io/gpu" = 4
[[static.devices]]
kind = "acme.example/npu"
name = "npu0"
device_nodes = ["/dev/npu0"]
env = ["ACME=1"]
""")
    cfg = load_config(str(p))
    assert cfg.policy.mode == "standalone"
    assert cfg.policy.trusted_namespaces == frozenset({"ml-team", "ci"})
    assert (cfg.nri.socket, cfg.nri.idx, cfg.nri.event_loop) == ("/run/x.sock", "07",
                                                                  "asyncio")
    assert cfg.devices.cdi_passthrough is True
    assert cfg.discovery.refresh_interval == 0.0
    assert cfg.discovery.create_device_nodes is True
    assert cfg.health == HealthConfig(False, frozenset({48, 63}), 5.0)
    assert cfg.log.level == "debug"
    assert cfg.static_devices[0].device_nodes == ("/dev/npu0",)
    assert cfg.device_plugin == DevicePluginConfig(
        "single", (("aws.amazon.com/neuroncore", ""), ("nvidia.com/gpu", "nri-accel.io/gpu")),
        (("nri-accel.io/gpu", 4),))
    dp = cfg.device_plugin
    assert (dp.resource_name("nvidia.com/gpu"), dp.resource_name("nvidia.com/mig"),
            dp.resource_name("aws.amazon.com/neuroncore")) == ("nri-accel.io/gpu",
                                                                "nvidia.com/mig", "")
    assert (dp.replicas_of("nri-accel.io/gpu"), dp.replicas_of("nvidia.com/gpu")) == (4, 1)
    assert cfg.path == str(p)


def test_device_plugin_defaults() -> None:
    assert parse_config({"device_plugin": {}}).device_plugin == DevicePluginConfig()
    assert DevicePluginConfig().mig_strategy == "mixed"


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        ({"polcy": {}}, "polcy: unknown key"),
        ({"policy": {"mode": "yolo"}}, "policy.mode"),
        ({"policy": {"trusted_namespaces": "default"}}, "array of strings"),
        ({"policy": {"trusted_namespaces": ["Bad_NS"]}}, "not a Kubernetes namespace"),
        ({"nri": {"idx": "7"}}, "nri.idx: must be two digits"),
        ({"nri": {"event_loop": "libuv"}},
         "nri.event_loop: must be one of 'auto', 'uvloop', 'asyncio', not 'libuv'"),
        ({"devices": {"hooks": "yes"}}, "devices.hooks: expected a boolean"),
        ({"devices": {"hook_path": "../hook"}}, "devices.hook_path"),
        ({"discovery": {"refresh_interval": -1}},
         "discovery.refresh_interval: expected a number of seconds from 0 (off) up to"),
        ({"discovery": {"cdi_spec_dirs": ["cdi"]}}, "must be absolute"),
        ({"discovery": {"create_device_nodes": 1}},
         "discovery.create_device_nodes: expected a boolean"),
        ({"health": {"ignored_xids": [79, "48"]}}, "health.ignored_xids: expected an array"),
        ({"health": {"ignored_xids": [0]}}, "health.ignored_xids: expected an array"),
        ({"health": {"recheck_interval": 0}},
         "health.recheck_interval: expected a number of seconds over 0"),
        ({"health": {"enable": True}}, "health.enable: unknown key"),
        ({"static": {"devices": [{"kind": "npu", "name": "x"}]}}, "static.devices[0].kind"),
        ({"static": {"devices": [{"kind": "a.b/c", "name": "x",
                                  "device_nodes": ["/dev/../etc/shadow"]}]}},
         "must be an absolute path without '..'"),
        ({"static": {"devices": [{"kind": "a.b/c", "name": "x",
                                  "device_nodes": ["dev/npu0"]}]}},
         "static.devices[0].device_nodes: 'dev/npu0' must be an absolute path"),
        ({"static": {"devices": [{"kind": "a.b/c", "name": "x", "env": ["NOVALUE"]}]}},
         "KEY=VALUE"),
        ({"device_plugin": {"mig_strategy": "auto"}},
         "device_plugin.mig_strategy: must be one of none, single, mixed"),
        ({"device_plugin": {"migStrategy": "none"}}, "device_plugin.migStrategy: unknown key"),
        ({"device_plugin": {"resource_names": {"gpu": "a.io/gpu"}}},
         "device_plugin.resource_names.gpu: the key must be a device kind"),
        ({"device_plugin": {"resource_names": {"nvidia.com/gpu": "gpu"}}},
         "has no domain prefix"),
        ({"device_plugin": {"resource_names": {"nvidia.com/gpu": "kubernetes.io/gpu"}}},
         "in the kubernetes.io domain"),
        ({"device_plugin": {"resource_names": {"nvidia.com/gpu": 1}}}, "expected a string"),
        ({"device_plugin": {"resource_names": {"nvidia.com/gpu": "a.io/x",
                                               "acme.example/npu": "a.io/x"}}},
         "one resource per kind"),
        ({"device_plugin": {"resource_names": "nvidia.com/gpu"}},
         "device_plugin.resource_names: must be a table"),
        ({"device_plugin": {"replicas": {"nvidia.com/gpu": 1}}},
         "device_plugin.replicas.nvidia.com/gpu: expected a number of replicas from 2"),
        ({"device_plugin": {"replicas": {"nvidia.com/gpu": True}}}, "number of replicas"),
        ({"device_plugin": {"replicas": {"nvidia.com/gpu": 5000}}}, "from 2 to 1024"),
        ({"device_plugin": {"replicas": {"Nvidia/gpu": 2}}}, "not a DNS subdomain"),
    ],
)
def test_errors_name_the_key(data, fragment) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(data, path="/etc/nri-accel/config.toml")
    assert str(err.value).startswith("/etc/nri-accel/config.toml: ")
    assert fragment in str(err.value)


@pytest.mark.parametrize(("kind", "name", "bad_key"), [
    ("1acme.example/npu", "npu0", "kind"),  # a CDI vendor starts with a letter
    ("acme.example/npu", "npu0.", "name"),  # a device name ends with a letter or digit
    ("acme.example/npu", "npu/0", "name"),
    ("acme.example/npu", "npu::1", "name"),  # a kubelet replica id's separator
])
def test_static_kinds_and_names_follow_the_request_syntax(kind, name, bad_key) -> None:
    # A static device that requests could not name would be discovered but never granted.
    with pytest.raises(ConfigError, match=rf"static\.devices\[0\]\.{bad_key}"):
        parse_config({"static": {"devices": [{"kind": kind, "name": name}]}})


def test_static_kind_may_use_every_cdi_vendor_character() -> None:
    config = parse_config({"static": {"devices": [{"kind": "Acme_Corp.example/npu-2",
                                                   "name": "0:a_b"}]}})
    assert [(d.kind, d.name) for d in config.static_devices] == [("Acme_Corp.example/npu-2",
                                                                   "0:a_b")]


def test_explicit_missing_file_and_bad_toml(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"missing\.toml"):
        load_config(str(tmp_path / "missing.toml"))
    bad = tmp_path / "bad.toml"
    bad.write_text("[policy\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(str(bad))


def test_shipped_example_config_is_valid() -> None:
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "deploy" / "config.toml"
    assert load_config(str(example)) == Config(path=str(example))



@pytest.mark.parametrize("key", ["discovery.refresh_interval", "health.recheck_interval"])
@pytest.mark.parametrize("text", ["nan", "+nan", "inf", "-inf", "86401", "1e400",
                                  "99999999999999999999"])
def test_intervals_are_finite_and_bounded(tmp_path, key, text) -> None:
    # asyncio.sleep(nan) never returns: `run` would log refresh_started and never refresh.
    table, name = key.split(".")
    p = tmp_path / "c.toml"
    p.write_text(f"[{table}]\n{name} = {text}\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(p))
    assert str(err.value).startswith(f"{p}: {key}: expected a number of seconds")


def test_intervals_at_their_bounds_are_accepted() -> None:
    cfg = parse_config({"discovery": {"refresh_interval": MAX_INTERVAL},
                        "health": {"recheck_interval": 0.001}})
    assert (cfg.discovery.refresh_interval, cfg.health.recheck_interval) == (MAX_INTERVAL,
                                                                               0.001)
    assert parse_config({"discovery": {"refresh_interval": 0}}).discovery.refresh_interval == 0


@pytest.mark.parametrize(("socket", "fragment"), [
    ("", "nri.socket: is empty"),
    ("nri.sock", "nri.socket: 'nri.sock' must be an absolute path"),
    ("run/nri/nri.sock", "must be an absolute path"),
    ("/" + "s" * UNIX_PATH_MAX, f"nri.socket: is {UNIX_PATH_MAX + 1} bytes long, over the "
                                f"{UNIX_PATH_MAX}-byte limit"),
])
def test_the_nri_socket_must_be_an_absolute_unix_socket_path(socket, fragment) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({"nri": {"socket": socket}}, path="/c.toml")
    assert str(err.value).startswith("/c.toml: nri.socket: ")
    assert fragment in str(err.value)
    longest = "/" + "s" * (UNIX_PATH_MAX - 1)
    assert parse_config({"nri": {"socket": longest}}).nri.socket == longest


def test_unix_socket_path_problem_counts_bytes_not_characters() -> None:
    assert unix_socket_path_problem("/run/nri/nri.sock") is None
    assert unix_socket_path_problem("relative.sock") is None  # absolute is the caller's rule
    assert unix_socket_path_problem("/" + "s" * (UNIX_PATH_MAX - 1)) is None
    assert "108 bytes long" in unix_socket_path_problem("/" + "s" * UNIX_PATH_MAX)
    assert "over the 107-byte limit" in unix_socket_path_problem("/" + "é" * 60)  # 121 bytes
    assert "empty" in unix_socket_path_problem("")
    assert "NUL" in unix_socket_path_problem("/run/a\x00b")


def test_a_file_nested_too_deeply_is_an_error_naming_the_file(tmp_path) -> None:
    # tomllib reads nested arrays recursively: 100,000 levels raise RecursionError.
    p = tmp_path / "deep.toml"
    p.write_text("a = " + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(p))
    assert str(err.value) == f"{p}: not readable TOML: arrays or tables nested too deeply"


def test_a_file_that_is_not_utf8_is_an_error_naming_the_file(tmp_path) -> None:
    p = tmp_path / "latin1.toml"
    p.write_bytes('[policy]\nmode = "kubernetes" # \u00e9t\u00e9\n'.encode("latin-1"))
    with pytest.raises(ConfigError) as err:
        load_config(str(p))
    assert str(err.value).startswith(f"{p}: not UTF-8 text (byte 0xe9 at offset 31)")
