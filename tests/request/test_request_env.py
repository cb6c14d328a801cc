"""Env syntax images already use, against nvidia-container-toolkit / libnvidia-container /
nvidia-docker / aws-neuron semantics. Standalone policy, so env requests grant."""

from __future__ import annotations

import pytest
from request_testing import (
    CUDA_IMAGE_ENV,
    KUBERNETES,
    MIG0,
    STANDALONE,
    UUID0,
    UUID1,
    claims,
    nv,
    nvidia_none,
    parse,
)

from nri_accel.errors import PolicyError, RequestError
from nri_accel.vendors.nvidia import ALL_CAPABILITIES, DEFAULT_CAPABILITIES

GPU, NEURON = "nvidia.com/gpu", "aws.amazon.com/neuron"
VIS = "env NVIDIA_VISIBLE_DEVICES"
LEGACY = "CUDA_VERSION=9.0.176"  # a CUDA image older than NVIDIA_REQUIRE_CUDA
LEGACY_SOURCE = "env NVIDIA_VISIBLE_DEVICES (unset in a legacy CUDA image)"


# NVIDIA/nvidia-container-toolkit internal/config/image/cuda_image.go devicesFromEnvvars
# and devices.go NewVisibleDevices ("The order of precedence for the special values is
# void > none > all"; other ids beside a special value are ignored), with the rows of
# cmd/nvidia-container-runtime-hook/container_config_test.go TestGetNvidiaConfig:
# comma split, blanks trimmed, empty tokens skipped; empty/unset/void -> nothing;
# none -> driver only; all -> every GPU; unset in a legacy image -> all.
VISIBLE = [
    (["NVIDIA_VISIBLE_DEVICES=all"], [(GPU, (), None, True, VIS)], False),
    (["NVIDIA_VISIBLE_DEVICES=none"], [], True),
    (["NVIDIA_VISIBLE_DEVICES=void"], [], False),
    (["NVIDIA_VISIBLE_DEVICES="], [], False),
    (["NVIDIA_VISIBLE_DEVICES= , ,"], [], False),
    ([], [], False),
    (["NVIDIA_VISIBLE_DEVICES=0,1"], [(GPU, ("0", "1"), None, False, VIS)], False),
    ([" NVIDIA_VISIBLE_DEVICES=0"], [], False),  # a different name: not read
    (["NVIDIA_VISIBLE_DEVICES= 0 , 1 ,"], [(GPU, ("0", "1"), None, False, VIS)], False),
    ([f"NVIDIA_VISIBLE_DEVICES={UUID0},{UUID1}"], [(GPU, (UUID0, UUID1), None, False, VIS)],
     False),
    ([f"NVIDIA_VISIBLE_DEVICES={MIG0}"], [(GPU, (MIG0,), None, False, VIS)], False),
    (["NVIDIA_VISIBLE_DEVICES=0:1,1:0"], [(GPU, ("0:1", "1:0"), None, False, VIS)], False),
    (["NVIDIA_VISIBLE_DEVICES=00000000:3B:00.0"],
     [(GPU, ("00000000:3B:00.0",), None, False, VIS)], False),
    (["NVIDIA_VISIBLE_DEVICES=0,void"], [], False),
    (["NVIDIA_VISIBLE_DEVICES=0,none"], [], True),
    (["NVIDIA_VISIBLE_DEVICES=all,none"], [], True),
    (["NVIDIA_VISIBLE_DEVICES=none,void"], [], False),
    (["NVIDIA_VISIBLE_DEVICES=1,all"], [(GPU, (), None, True, VIS)], False),
    # every order of the special values: void > none > all
    (["NVIDIA_VISIBLE_DEVICES=void,all"], [], False),
    (["NVIDIA_VISIBLE_DEVICES=all,void"], [], False),
    (["NVIDIA_VISIBLE_DEVICES=void,none"], [], False),
    (["NVIDIA_VISIBLE_DEVICES=none,all"], [], True),
    (["NVIDIA_VISIBLE_DEVICES=all,none,void"], [], False),
    (["NVIDIA_VISIBLE_DEVICES=void,none,all"], [], False),
    (["NVIDIA_VISIBLE_DEVICES= all , none "], [], True),
    (["NVIDIA_VISIBLE_DEVICES=0,all,1"], [(GPU, (), None, True, VIS)], False),
    ([f"NVIDIA_VISIBLE_DEVICES={UUID0},none,all"], [], True),
    (["NVIDIA_VISIBLE_DEVICES=,void,"], [], False),
    (["NVIDIA_VISIBLE_DEVICES=VOID"], [(GPU, ("VOID",), None, False, VIS)], False),  # exact
    (["NVIDIA_VISIBLE_DEVICES=None"], [(GPU, ("None",), None, False, VIS)], False),
    ([LEGACY, "NVIDIA_VISIBLE_DEVICES=none"], [], True),
    ([LEGACY, "NVIDIA_VISIBLE_DEVICES=all,void"], [], False),
    # the toolkit passes "ALL" on as a device, which libnvidia-container's select_devices
    # takes for all (str_case_equal); "VOID" and "None" it takes for device names
    (["NVIDIA_VISIBLE_DEVICES=ALL"], [(GPU, (), None, True, VIS)], False),
    (["NVIDIA_VISIBLE_DEVICES=0,All"], [(GPU, (), None, True, VIS)], False),
    (["NVIDIA_VISIBLE_DEVICES=0-3"], [(GPU, ("0-3",), None, False, VIS)], False),  # no ranges
    (["NVIDIA_VISIBLE_DEVICES=nvidia.com/gpu=1"], [(GPU, ("1",), None, False, VIS)], False),
    ([LEGACY], [(GPU, (), None, True, LEGACY_SOURCE)], False),
    ([LEGACY, "NVIDIA_VISIBLE_DEVICES="], [], False),
    ([LEGACY, "NVIDIA_VISIBLE_DEVICES=void"], [], False),
    ([LEGACY, "NVIDIA_VISIBLE_DEVICES=1"], [(GPU, ("1",), None, False, VIS)], False),
    (["CUDA_VERSION=12.4.1", "NVIDIA_REQUIRE_CUDA=cuda>=12.4"], [], False),  # not legacy
    # OCI env: the last definition of a name wins.
    (["NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_VISIBLE_DEVICES=1"],
     [(GPU, ("1",), None, False, VIS)], False),
    (["NVIDIA_VISIBLE_DEVICES=1", "NVIDIA_VISIBLE_DEVICES=void"], [], False),
]


@pytest.mark.parametrize(("env", "expected", "none"), VISIBLE)
def test_nvidia_visible_devices(env: list[str], expected: list[tuple[object, ...]],
                                none: bool) -> None:
    req = parse(env=env)
    assert claims(req) == expected
    assert nvidia_none(req) is none


# nvidia-docker 2's wrapper: NV_GPU (if non-empty) became -e NVIDIA_VISIBLE_DEVICES with
# blanks turned into commas. Read only when NVIDIA_VISIBLE_DEVICES is unset.
@pytest.mark.parametrize(("env", "expected"), [
    (["NV_GPU=0 1"], [(GPU, ("0", "1"), None, False, "env NV_GPU")]),
    (["NV_GPU=0,1"], [(GPU, ("0", "1"), None, False, "env NV_GPU")]),
    ([f"NV_GPU={UUID0}"], [(GPU, (UUID0,), None, False, "env NV_GPU")]),
    (["NV_GPU=all"], [(GPU, (), None, True, "env NV_GPU")]),
    (["NV_GPU="], []),
    (["NV_GPU= "], []),
    (["NV_GPU=0", "NVIDIA_VISIBLE_DEVICES=1"], [(GPU, ("1",), None, False, VIS)]),
    (["NV_GPU=0", "NVIDIA_VISIBLE_DEVICES="], []),
    (["NV_GPU=0", LEGACY], [(GPU, ("0",), None, False, "env NV_GPU")]),
])
def test_nv_gpu_alias(env: list[str], expected: list[tuple[object, ...]]) -> None:
    assert claims(parse(env=env)) == expected


# Fully qualified CDI names (NVIDIA/nvidia-container-toolkit's CDI mode:
# internal/modifier/cdi.go hands them to
# CDI, which injects their union) and the just-in-time CDI kind runtime.nvidia.com/gpu
# (internal/modifier/cdi.go automaticDeviceKind; its ids are those pkg/nvcdi/lib-nvml.go
# GetDeviceSpecsBy takes: "all", a GPU index, a MIG index, a GPU or MIG UUID, as in
# pkg/nvcdi/identifier_test.go), mapped onto this node's nvidia.com/gpu ids.
JIT_UUID = "GPU-ebd34bdf-1083-eaac-2aff-4b71a022f9bd"
JIT_MIG = "MIG-ebd34bdf-1083-eaac-2aff-4b71a022f9bd"
ALL = [(GPU, (), None, True, VIS)]


@pytest.mark.parametrize(("value", "expected"), [
    ("nvidia.com/gpu=all", ALL),
    ("nvidia.com/gpu=0,nvidia.com/gpu=GPU-x", [(GPU, ("0", "GPU-x"), None, False, VIS)]),
    ("nvidia.com/gpu=all,nvidia.com/gpu=1", ALL),  # the union of all and 1
    ("1,nvidia.com/gpu=all", ALL),
    ("example.com/class=device,0", [("example.com/class", ("device",), None, False, VIS),
                                    (GPU, ("0",), None, False, VIS)]),
    ("runtime.nvidia.com/gpu=all", ALL),
    ("runtime.nvidia.com/gpu=0", [(GPU, ("0",), None, False, VIS)]),
    ("runtime.nvidia.com/gpu=01", [(GPU, ("1",), None, False, VIS)]),  # NVML index 1
    ("runtime.nvidia.com/gpu=0:1", [(GPU, ("0:1",), None, False, VIS)]),
    (f"runtime.nvidia.com/gpu={JIT_UUID}", [(GPU, (JIT_UUID,), None, False, VIS)]),
    (f"runtime.nvidia.com/gpu={JIT_MIG}", [(GPU, (JIT_MIG,), None, False, VIS)]),
    (f"runtime.nvidia.com/gpu=MIG-{JIT_UUID}/3/0",
     [(GPU, (f"MIG-{JIT_UUID}/3/0",), None, False, VIS)]),
    ("runtime.nvidia.com/gpu=0,runtime.nvidia.com/gpu=1:0",
     [(GPU, ("0", "1:0"), None, False, VIS)]),
    ("2,runtime.nvidia.com/gpu=0,nvidia.com/gpu=1", [(GPU, ("2", "0", "1"), None, False, VIS)]),
    ("runtime.nvidia.com/gpu=1,runtime.nvidia.com/gpu=all", ALL),
    ("runtime.nvidia.com/gpu=0,none", []),  # the special values still win
])
def test_cdi_names_in_nvidia_visible_devices(value: str,
                                             expected: list[tuple[object, ...]]) -> None:
    assert claims(parse(env=[f"NVIDIA_VISIBLE_DEVICES={value}"])) == expected


@pytest.mark.parametrize("ident", [
    "0000:07:00.0",  # a PCI bus id: nri-accel's plain syntax takes it, jit-CDI does not
    "mode=gds", "none", "void", "GPU-foo", "MIG-foo", "0:0:0", "0:foo", "foo:0", "",
    "ebd34bdf-1083-eaac-2aff-4b71a022f9bd", "gpu0", "99999999999",
])
def test_jit_cdi_ids_nvidia_would_not_generate_are_refused(ident: str) -> None:
    with pytest.raises(RequestError) as err:
        parse(env=[f"NVIDIA_VISIBLE_DEVICES=0,runtime.nvidia.com/gpu={ident}"])
    assert err.value.source == VIS
    assert "runtime.nvidia.com/gpu takes what the NVIDIA Container Toolkit's just-in-time " \
        "CDI mode accepts" in err.value.message


@pytest.mark.parametrize(("value", "message"), [
    ("../../dev/nvidia0", "invalid device id '../../dev/nvidia0'"),
    ("0,/proc/1/root", "invalid device id '/proc/1/root'"),
    ("nvidia.com=0", "invalid device kind 'nvidia.com'"),
    ("GPU-x/y", "invalid device id 'GPU-x/y'"),
])
def test_nvidia_visible_devices_rejects(value: str, message: str) -> None:
    with pytest.raises(RequestError) as err:
        parse(env=[f"NVIDIA_VISIBLE_DEVICES={value}"])
    assert err.value.source == VIS
    assert message in err.value.message


# NVIDIA_DRIVER_CAPABILITIES: NVIDIA/nvidia-container-toolkit
# cmd/nvidia-container-runtime-hook getDriverCapabilities (unset -> utility,compute, or
# every capability in a legacy image; set and non-empty -> its own value, even when that
# holds no name) and internal/config/image NewDriverCapabilities with its
# capabilities_test.go TestDriverCapabilitiesList ("", "  ", "," -> no capability;
# ",cap", "cap,", "cap0,,cap1" -> the names), and the hook's container_config_test.go
# rows "capabilities 'empty'" (-> the default, in legacy and modern images alike).
# Unsupported names fail the container (the hook's "unsupported capabilities found").
NOCAPS: frozenset[str] = frozenset()


@pytest.mark.parametrize(("env", "caps", "source"), [
    ([], DEFAULT_CAPABILITIES, ""),
    (["NVIDIA_DRIVER_CAPABILITIES="], DEFAULT_CAPABILITIES, "env NVIDIA_DRIVER_CAPABILITIES"),
    (["NVIDIA_DRIVER_CAPABILITIES=,"], NOCAPS, "env NVIDIA_DRIVER_CAPABILITIES"),
    (["NVIDIA_DRIVER_CAPABILITIES=  "], NOCAPS, "env NVIDIA_DRIVER_CAPABILITIES"),
    (["NVIDIA_DRIVER_CAPABILITIES= , ,"], NOCAPS, "env NVIDIA_DRIVER_CAPABILITIES"),
    (["NVIDIA_DRIVER_CAPABILITIES=,compute"], {"compute"}, "env NVIDIA_DRIVER_CAPABILITIES"),
    (["NVIDIA_DRIVER_CAPABILITIES=compute,"], {"compute"}, "env NVIDIA_DRIVER_CAPABILITIES"),
    (["NVIDIA_DRIVER_CAPABILITIES=compute,,utility"], {"compute", "utility"},
     "env NVIDIA_DRIVER_CAPABILITIES"),
    ([LEGACY, "NVIDIA_DRIVER_CAPABILITIES=,"], NOCAPS, "env NVIDIA_DRIVER_CAPABILITIES"),
    (["NVIDIA_DRIVER_CAPABILITIES=all"], ALL_CAPABILITIES, "env NVIDIA_DRIVER_CAPABILITIES"),
    (["NVIDIA_DRIVER_CAPABILITIES=compute,all"], ALL_CAPABILITIES,
     "env NVIDIA_DRIVER_CAPABILITIES"),
    # the toolkit asks IsAll() before it looks at the names: what else is listed is moot
    (["NVIDIA_DRIVER_CAPABILITIES=all,bogus"], ALL_CAPABILITIES,
     "env NVIDIA_DRIVER_CAPABILITIES"),
    (["NVIDIA_DRIVER_CAPABILITIES=compute,compat32,graphics,utility,video,display,ngx"],
     ALL_CAPABILITIES, "env NVIDIA_DRIVER_CAPABILITIES"),
    (["NVIDIA_DRIVER_CAPABILITIES= video , ,utility"], {"video", "utility"},
     "env NVIDIA_DRIVER_CAPABILITIES"),
    (["NVIDIA_DRIVER_CAPABILITIES=graphics"], {"graphics"}, "env NVIDIA_DRIVER_CAPABILITIES"),
    ([LEGACY], ALL_CAPABILITIES, "env CUDA_VERSION (legacy image: all capabilities)"),
    ([LEGACY, "NVIDIA_DRIVER_CAPABILITIES="], DEFAULT_CAPABILITIES,
     "env NVIDIA_DRIVER_CAPABILITIES"),
    ([LEGACY, "NVIDIA_DRIVER_CAPABILITIES=utility"], {"utility"},
     "env NVIDIA_DRIVER_CAPABILITIES"),
])
def test_driver_capabilities(env: list[str], caps: set[str], source: str) -> None:
    req = parse(env=env)
    assert nv(req).capabilities == caps
    assert nv(req).capabilities_source == source


@pytest.mark.parametrize("value", ["compute,gpu", "COMPUTE", "compute;utility", "none"])
def test_driver_capabilities_unknown_rejected(value: str) -> None:
    with pytest.raises(RequestError, match="unknown driver capabilities") as err:
        parse(env=[f"NVIDIA_DRIVER_CAPABILITIES={value}", "NVIDIA_VISIBLE_DEVICES=0"])
    assert err.value.source == "env NVIDIA_DRIVER_CAPABILITIES"


# NVIDIA_MIG_CONFIG_DEVICES / NVIDIA_MIG_MONITOR_DEVICES (toolkit migCapsDevices.Validate):
# "" asks nothing, "all" asks for the capability, anything else fails.
@pytest.mark.parametrize(("env", "config", "monitor"), [
    ([], False, False),
    (["NVIDIA_MIG_CONFIG_DEVICES=all"], True, False),
    (["NVIDIA_MIG_MONITOR_DEVICES=all"], False, True),
    (["NVIDIA_MIG_CONFIG_DEVICES=all", "NVIDIA_MIG_MONITOR_DEVICES=all"], True, True),
    (["NVIDIA_MIG_MONITOR_DEVICES="], False, False),
])
def test_mig_caps(env: list[str], config: bool, monitor: bool) -> None:
    req = parse(env=env)
    assert (nv(req).mig_config, nv(req).mig_monitor) == (config, monitor)


@pytest.mark.parametrize("value", ["0", "0,1", "ALL", " all"])
def test_mig_caps_other_values_rejected(value: str) -> None:
    with pytest.raises(RequestError, match="only 'all' is supported") as err:
        parse(env=[f"NVIDIA_MIG_MONITOR_DEVICES={value}", "NVIDIA_VISIBLE_DEVICES=all"])
    assert err.value.source == "env NVIDIA_MIG_MONITOR_DEVICES"
    assert not isinstance(err.value, PolicyError)


# AWS_NEURON_VISIBLE_DEVICES (aws-neuron-sdk container docs): ALL, lists, ranges.
NSRC = "env AWS_NEURON_VISIBLE_DEVICES"


@pytest.mark.parametrize(("value", "expected"), [
    ("ALL", [(NEURON, (), None, True, NSRC)]),
    ("all", [(NEURON, (), None, True, NSRC)]),
    ("0,1", [(NEURON, ("0", "1"), None, False, NSRC)]),
    ("2,3", [(NEURON, ("2", "3"), None, False, NSRC)]),
    ("0-3", [(NEURON, ("0", "1", "2", "3"), None, False, NSRC)]),
    ("0-1, 4", [(NEURON, ("0", "1", "4"), None, False, NSRC)]),
    ("1,ALL", [(NEURON, (), None, True, NSRC)]),
    ("", []),
    (" , ", []),
])
def test_neuron_visible_devices(value: str, expected: list[tuple[object, ...]]) -> None:
    assert claims(parse(env=[f"AWS_NEURON_VISIBLE_DEVICES={value}"])) == expected


@pytest.mark.parametrize(("value", "message"), [
    ("3-1", "reversed range"),
    ("0-1000", "names more than 256 devices"),
    ("/dev/neuron0", "invalid device id"),
])
def test_neuron_visible_devices_rejects(value: str, message: str) -> None:
    with pytest.raises(RequestError, match=message) as err:
        parse(env=[f"AWS_NEURON_VISIBLE_DEVICES={value}"])
    assert err.value.source == NSRC


def test_cuda_image_in_standalone_gets_all_gpus_and_its_requirements() -> None:
    req = parse(env=CUDA_IMAGE_ENV)
    assert claims(req) == [(GPU, (), None, True, VIS)]
    assert nv(req).capabilities == {"compute", "utility"}
    assert nv(req).requirements is not None
    assert [r.source for r in nv(req).requirements.items] == ["env NVIDIA_REQUIRE_CUDA"]


def test_entries_without_equals_are_not_variables() -> None:
    assert parse(env=["NVIDIA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES=2"]).grants[0].ids == (
        "2",)


# What only qualifies a GPU grant is read for a container granted one: the toolkit's hook
# returns "not a GPU container" before it reads capabilities, requirements or the MIG
# variables (getNvidiaConfig), so such a container starts with plain runc today, and a
# node's non-GPU containers all come through nri-accel.
QUALIFIERS = [
    ("NVIDIA_DRIVER_CAPABILITIES=compute,rootkit", "env NVIDIA_DRIVER_CAPABILITIES"),
    ("NVIDIA_REQUIRE_CUDA=cuda>=1.0 foo=bar", "env NVIDIA_REQUIRE_CUDA"),
    ("NVIDIA_MIG_CONFIG_DEVICES=0", "env NVIDIA_MIG_CONFIG_DEVICES"),
]


@pytest.mark.parametrize(("entry", "source"), [*QUALIFIERS, ("CUDA_VERSION=cpu",
                                                              "env CUDA_VERSION")])
@pytest.mark.parametrize("visible", ["NVIDIA_VISIBLE_DEVICES=void", "NVIDIA_VISIBLE_DEVICES="])
def test_a_malformed_qualifier_of_no_grant_is_noted_not_refused(entry: str, source: str,
                                                                visible: str) -> None:
    request = parse(env=[entry, visible])
    assert request.grants == ()
    assert any(n.startswith(f"{source} not read (") and n.endswith(
        "no nvidia.com device is granted") for n in request.notes), request.notes


@pytest.mark.parametrize(("entry", "source"), QUALIFIERS)
def test_a_malformed_qualifier_refuses_a_container_granted_a_gpu_whatever_grants_it(
        entry: str, source: str) -> None:
    for policy, kwargs in (
            (STANDALONE, {"env": [entry, "NVIDIA_VISIBLE_DEVICES=0"]}),
            (STANDALONE, {"env": [entry, "NVIDIA_VISIBLE_DEVICES=none"]}),  # the driver
            (KUBERNETES, {"env": [entry], "ctr": {"devices.nri-accel.io": "nvidia.com/gpu=0"}})):
        with pytest.raises(RequestError) as err:
            parse(policy, **kwargs)
        assert err.value.source == source


def test_a_kubernetes_container_not_granted_a_gpu_is_not_refused_for_its_nvidia_env() -> None:
    # An untrusted namespace's env grants nothing: neither its MIG capabilities, which
    # only a granting source may ask, nor a malformed qualifier refuse a container that
    # gets no GPU; granted one by the device plugin, it is refused for either.
    for env in (["NVIDIA_MIG_CONFIG_DEVICES=all"], ["NVIDIA_DRIVER_CAPABILITIES=bogus"],
                ["CUDA_VERSION=cpu"]):
        assert parse(KUBERNETES, env=env).grants == ()
        with pytest.raises(RequestError):
            parse(KUBERNETES, env=env, ctr={"devices.nri-accel.io": "nvidia.com/gpu=0"})
