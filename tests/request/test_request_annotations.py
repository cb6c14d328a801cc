"""Annotation syntax: the devices.nri-accel.io grammar, NRI precedence, CDI annotations and
capabilities.nri-accel.io. Parsed under the standalone policy so every claim is a grant."""

from __future__ import annotations

import pytest
from request_testing import MIG0, UUID0, UUID1, claims, nv, parse

from nri_accel.errors import RequestError
from nri_accel.syntax import MAX_IDS
from nri_accel.vendors.nvidia import ALL_CAPABILITIES, DEFAULT_CAPABILITIES

POD = "devices.nri-accel.io/pod"
SRC = f"annotation {POD}"
GPU, MIG, NEURON = "nvidia.com/gpu", "nvidia.com/mig", "aws.amazon.com/neuron"
LEGACY_MIG = "MIG-GPU-b1028956-cfa2-0990-bf4a-5da9abb51763/3/0"


def ids(kind: str, *values: str) -> tuple[object, ...]:
    return (kind, values, None, False, SRC)


def count(kind: str, n: int) -> tuple[object, ...]:
    return (kind, (), n, False, SRC)


def every(kind: str) -> tuple[object, ...]:
    return (kind, (), None, True, SRC)


# Grammar (README.md, "Requesting devices"): entries split on ';' or newlines; an entry
# is KIND=ID[,ID...] where a comma token with '=' starts a new kind, or KIND: N. Claims
# come out sorted by kind.
VALID = [
    ("nvidia.com/gpu=0,1", [ids(GPU, "0", "1")]),
    ("nvidia.com/gpu=0,nvidia.com/gpu=1", [ids(GPU, "0", "1")]),
    ("nvidia.com/gpu=0-3", [ids(GPU, "0", "1", "2", "3")]),
    ("nvidia.com/gpu=2-2", [ids(GPU, "2")]),
    (f"nvidia.com/gpu={UUID0}", [ids(GPU, UUID0)]),
    (f"nvidia.com/gpu={UUID0},{UUID1}", [ids(GPU, UUID0, UUID1)]),
    ("nvidia.com/gpu=all", [every(GPU)]),
    ("nvidia.com/gpu=all;nvidia.com/gpu=all", [every(GPU)]),
    ("nvidia.com/mig=0:1", [ids(MIG, "0:1")]),
    (f"nvidia.com/gpu={MIG0}", [ids(GPU, MIG0)]),  # kind as written; select resolves MIG ids
    ("nvidia.com/gpu=0:1", [ids(GPU, "0:1")]),
    (f"nvidia.com/gpu={LEGACY_MIG}", [ids(GPU, LEGACY_MIG)]),
    ("nvidia.com/gpu=0000:3b:00.0", [ids(GPU, "0000:3b:00.0")]),
    ("aws.amazon.com/neuron=0-3", [ids(NEURON, "0", "1", "2", "3")]),
    ("acme.example/npu=npu0", [ids("acme.example/npu", "npu0")]),
    ("nvidia.com/gpu: 2", [count(GPU, 2)]),
    ("nvidia.com/gpu:2", [count(GPU, 2)]),
    ("nvidia.com/gpu: 1;nvidia.com/gpu: 1", [count(GPU, 1)]),
    ("nvidia.com/gpu=0; aws.amazon.com/neuron: 1", [count(NEURON, 1), ids(GPU, "0")]),
    ("nvidia.com/gpu=0\naws.amazon.com/neuron=1,2\n", [ids(NEURON, "1", "2"), ids(GPU, "0")]),
    ("nvidia.com/gpu=0,aws.amazon.com/neuron=1,2", [ids(NEURON, "1", "2"), ids(GPU, "0")]),
    ("  nvidia.com/gpu = 0 , 1 ;", [ids(GPU, "0", "1")]),
    ("nvidia.com/gpu=1,0,1", [ids(GPU, "1", "0")]),  # order kept, duplicates dropped
    ("nvidia.com/gpu=0-2,1", [ids(GPU, "0", "1", "2")]),
    ("", []),  # present but empty: this container asks for nothing
    (" ;\n; ", []),
]


@pytest.mark.parametrize(("value", "expected"), VALID)
def test_device_annotation_grammar(value: str, expected: list[tuple[object, ...]]) -> None:
    assert claims(parse(pod={POD: value})) == expected


INVALID = [
    ("nvidia.com=0", "invalid device kind 'nvidia.com'"),
    ("gpu=0", "invalid device kind 'gpu'"),
    ("nvidia.com/gpu/x=0", "invalid device kind"),
    ("1vendor.com/gpu=0", "invalid device kind"),
    ("nvidia.com/gpu=", "empty device id"),
    ("nvidia.com/gpu=0,,1", "empty device id"),
    ("=0", "invalid device kind ''"),
    ("nvidia.com/gpu=3-1", "reversed range '3-1'"),
    ("nvidia.com/gpu=0-100000", "names more than 256 devices"),
    ("nvidia.com/gpu=0-9999999", "is too large"),
    ("nvidia.com/gpu=all,0", "conflicting forms"),
    ("nvidia.com/gpu=0,all", "conflicting forms"),
    ("nvidia.com/gpu=0;nvidia.com/gpu: 2", "conflicting forms"),
    ("nvidia.com/gpu: 2;nvidia.com/gpu=all", "conflicting forms"),
    ("nvidia.com/gpu: 1;nvidia.com/gpu: 2", "conflicting forms"),
    ("nvidia.com/gpu: 0", "invalid count '0'"),
    ("nvidia.com/gpu: -1", "invalid count '-1'"),
    ("nvidia.com/gpu: two", "invalid count 'two'"),
    ("nvidia.com/gpu: 257", "invalid count '257'"),
    ("nvidia.com/gpu:", "invalid count ''"),
    ("0,nvidia.com/gpu=1", "id '0' has no kind"),
    ("nvidia.com/gpu", "invalid entry 'nvidia.com/gpu'"),
    ("give me a gpu", "invalid entry"),
    (": 2", "invalid device kind ''"),
    ("nvidia.com/gpu=gpu 0", "invalid device id 'gpu 0'"),
    ("nvidia.com/gpu=-1", "invalid device id '-1'"),
]


@pytest.mark.parametrize(("value", "message"), INVALID)
def test_device_annotation_rejects(value: str, message: str) -> None:
    with pytest.raises(RequestError) as err:
        parse(pod={POD: value})
    assert err.value.source == SRC
    assert message in err.value.message


def test_more_than_max_ids_rejected() -> None:
    value = "nvidia.com/gpu=" + ",".join(f"GPU-{i}" for i in range(MAX_IDS + 1))
    with pytest.raises(RequestError, match=f"more than {MAX_IDS} device ids"):
        parse(pod={POD: value})
    ok = "nvidia.com/gpu=" + ",".join(str(i) for i in range(MAX_IDS))
    assert len(parse(pod={POD: ok}).grants[0].ids) == MAX_IDS


def test_ranges_count_against_max_ids() -> None:
    with pytest.raises(RequestError, match="more than 256 device ids"):
        parse(pod={POD: "nvidia.com/gpu=0-200;aws.amazon.com/neuron=0-100"})


# ---- precedence (containerd/nri plugins/device-injector getAnnotation) --------------------

@pytest.mark.parametrize(("present", "used"), [
    ({"devices.nri-accel.io/container.main": "a.b/c=1", POD: "a.b/c=2",
      "devices.nri-accel.io": "a.b/c=3"}, "devices.nri-accel.io/container.main"),
    ({POD: "a.b/c=2", "devices.nri-accel.io": "a.b/c=3"}, POD),
    ({"devices.nri-accel.io": "a.b/c=3"}, "devices.nri-accel.io"),
    ({"devices.nri-accel.io/container.other": "a.b/c=9", "devices.nri-accel.io": "a.b/c=3"},
     "devices.nri-accel.io"),
])
def test_precedence_first_present_wins(present: dict[str, str], used: str) -> None:
    grants = parse(pod=present).grants
    assert [(c.source, c.ids) for c in grants] == [(f"annotation {used}", (present[used][-1],))]


def test_empty_container_key_opts_out_of_pod_request() -> None:
    pod = {"devices.nri-accel.io/container.sidecar": "", POD: "nvidia.com/gpu=0"}
    assert parse(pod=pod, container="sidecar").grants == ()
    assert len(parse(pod=pod, container="main").grants) == 1


@pytest.mark.parametrize("key", [
    "devices.nri-accel.io/containr.main", "devices.nri-accel.io/container.",
    "devices.nri-accel.io/pods", "capabilities.nri-accel.io/podd",
])
def test_misspelt_plugin_key_rejected(key: str) -> None:
    with pytest.raises(RequestError, match="unknown key") as err:
        parse(pod={key: "nvidia.com/gpu=0"})
    assert err.value.source == f"annotation {key}"


def test_unrelated_annotations_ignored() -> None:
    pod = {"devices.nri-accel.io.example/x": "junk", "example.com/devices.nri-accel.io": "x",
           "devices.noderesource.dev/pod": "- path: /dev/null"}
    assert parse(pod=pod).grants == ()


# ---- CDI annotations (tags.cncf.io/container-device-interface pkg/cdi annotations) --------

def test_cdi_container_annotation_is_a_cdi_grant() -> None:
    key = "cdi.k8s.io/nvidia-device-plugin_GPU-0"
    req = parse(ctr={key: "nvidia.com/gpu=0,vendor.com/dev=a"})
    assert [(c.kind, c.ids, c.cdi, c.source) for c in req.grants] == [
        ("nvidia.com/gpu", ("0",), True, f"container annotation {key}"),
        ("vendor.com/dev", ("a",), True, f"container annotation {key}"),
    ]
    assert req.cdi_names == ("nvidia.com/gpu=0", "vendor.com/dev=a")


def test_nvidia_cdi_prefix_and_all_name() -> None:
    req = parse(ctr={"nvidia.cdi.k8s.io/gpu": "nvidia.com/gpu=all"})
    assert [(c.kind, c.all, c.cdi) for c in req.grants] == [("nvidia.com/gpu", True, True)]
    assert req.cdi_names == ("nvidia.com/gpu=all",)


def test_cdi_names_sorted_and_deduplicated_across_keys() -> None:
    req = parse(ctr={"cdi.k8s.io/b": "vendor.com/dev=b,vendor.com/dev=a",
                     "cdi.k8s.io/a": "vendor.com/dev=a"})
    assert req.cdi_names == ("vendor.com/dev=a", "vendor.com/dev=b")


@pytest.mark.parametrize(("value", "message"), [
    ("", "invalid CDI device name ''"),
    ("nvidia.com/gpu", "invalid CDI device name 'nvidia.com/gpu'"),
    ("nvidia.com/gpu=0, vendor.com/dev=a", "invalid device kind ' vendor.com/dev'"),
    ("nvidia.com/gpu=0,", "invalid CDI device name ''"),
    ("nvidia.com/gpu=0:", "invalid device id '0:'"),
    ("vendor.com/dev=a/b", "invalid device id 'a/b'"),
])
def test_cdi_annotation_rejects(value: str, message: str) -> None:
    key = "cdi.k8s.io/x"
    with pytest.raises(RequestError) as err:
        parse(ctr={key: value})
    assert err.value.source == f"container annotation {key}"
    assert message in err.value.message


INJECTOR = "cdi-devices.noderesource.dev"


@pytest.mark.parametrize(("value", "expected"), [
    ("- vendor.com/dev=a\n- vendor.com/dev=b\n", ("vendor.com/dev=a", "vendor.com/dev=b")),
    ("[vendor.com/dev=a, nvidia.com/gpu=all]", ("nvidia.com/gpu=all", "vendor.com/dev=a")),
    ("", ()),
])
def test_device_injector_cdi_yaml_list(value: str, expected: tuple[str, ...]) -> None:
    assert parse(pod={f"{INJECTOR}/pod": value}).cdi_names == expected


@pytest.mark.parametrize(("present", "used"), [
    ({f"{INJECTOR}/container.main": "[a.b/c=1]", "cdi-devices.nri.io/container.main":
      "[a.b/c=2]", f"{INJECTOR}/pod": "[a.b/c=3]"}, f"{INJECTOR}/container.main"),
    ({"cdi-devices.nri.io/container.main": "[a.b/c=2]", f"{INJECTOR}/pod": "[a.b/c=3]"},
     "cdi-devices.nri.io/container.main"),
    ({f"{INJECTOR}/pod": "[a.b/c=3]", INJECTOR: "[a.b/c=4]"}, f"{INJECTOR}/pod"),
    ({"cdi-devices.nri.io": "[a.b/c=5]"}, "cdi-devices.nri.io"),
])
def test_device_injector_precedence(present: dict[str, str], used: str) -> None:
    [claim] = parse(pod=present).grants
    assert claim.source == f"annotation {used}"
    assert claim.ids == (present[used][-2],)


@pytest.mark.parametrize(("value", "message"), [
    ("vendor.com/dev=a", "expected a YAML list"),
    ("- [nested]", "expected a YAML list"),
    ("- 1", "expected a YAML list"),
    ("[unclosed", "not a YAML list"),
    ("- not-qualified", "invalid CDI device name"),
])
def test_device_injector_rejects(value: str, message: str) -> None:
    with pytest.raises(RequestError, match=message) as err:
        parse(pod={f"{INJECTOR}/pod": value})
    assert err.value.source == f"annotation {INJECTOR}/pod"


# ---- capabilities.nri-accel.io (same values as NVIDIA_DRIVER_CAPABILITIES) ------------------

CAPS = "capabilities.nri-accel.io"


@pytest.mark.parametrize(("pod", "env", "caps", "source"), [
    ({}, [], DEFAULT_CAPABILITIES, ""),
    ({f"{CAPS}/pod": "graphics,display"}, [], {"graphics", "display"}, f"annotation {CAPS}/pod"),
    ({f"{CAPS}/container.main": "video", f"{CAPS}/pod": "graphics", CAPS: "ngx"}, [],
     {"video"}, f"annotation {CAPS}/container.main"),
    ({CAPS: "all"}, [], ALL_CAPABILITIES, f"annotation {CAPS}"),
    ({f"{CAPS}/pod": "video"}, ["NVIDIA_DRIVER_CAPABILITIES=graphics"], {"video"},
     f"annotation {CAPS}/pod"),
    ({f"{CAPS}/pod": ""}, ["NVIDIA_DRIVER_CAPABILITIES=graphics"], DEFAULT_CAPABILITIES,
     f"annotation {CAPS}/pod"),
])
def test_capability_annotations(pod: dict[str, str], env: list[str], caps: set[str],
                                source: str) -> None:
    req = parse(pod=pod, env=env)
    assert nv(req).capabilities == caps
    assert nv(req).capabilities_source == source


def test_capability_annotation_unknown_rejected() -> None:
    with pytest.raises(RequestError, match="unknown driver capabilities gpu") as err:
        parse(pod={f"{CAPS}/pod": "compute,gpu"})
    assert err.value.source == f"annotation {CAPS}/pod"
