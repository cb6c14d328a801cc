"""Hypothesis strategies shared by the fuzz targets: what a pod writer, an image author,
a runtime or a vendor's spec file can hand nri-accel.

Grammar-aware strategies build text that is almost right (real kinds, the demo node's
ids, real variable names, the separators each grammar uses) and mix in text that is
wrong in every way (control characters, lone surrogates, paths, huge numbers), so that
the fuzzer reaches the deep parts of each grammar as often as its error paths.
"""

from __future__ import annotations

import itertools
from types import MappingProxyType

from demo_node import demo_inventory
from hypothesis import strategies as st

from nri_accel.container import ContainerInfo
from nri_accel.inventory import ContainerEdits, Device, DeviceNode, Driver, Inventory, Mount
from nri_accel.request import (
    ANNOTATION_GRANTED,
    ANNOTATION_SHARED,
    CDI_PREFIXES,
    DEVICES_KEY,
    GRANT_KEY_PREFIX,
    INJECTOR_CDI_KEYS,
)
from nri_accel.vendors import PROFILES
from nri_accel.vendors.nvidia.requirements import OPERATORS

CONTAINER = "main"  # the container name the annotation strategies aim at

# ---- text ------------------------------------------------------------------------------

# Everything a str can hold: control characters, lone surrogates, non-BMP.
any_text = st.text(max_size=40)
_NASTY = ("", " ", ",", ";", "\n", "\t", "\x00", "\x1b", "\x85", "\u2028", "\ud800", "..",
          "../../dev/mem", "/dev/nvidia0", "=", ":", "-", "all", "ALL", "none", "void",
          "é" * 3000, "9" * 5000, "0" * 7, "[" * 2000, "{" * 2000, "- " * 2000,
          "%s%n", "$(id)", "\\", "*", "?")
nasty_text = st.sampled_from(_NASTY)


def json_paths(node: object, at: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
    """Every path (keys and indices, from the root `at`) into a JSON-like document, the
    root's own first: where a fuzz target swaps a value for a hostile one."""
    out = [at]
    if isinstance(node, dict):
        for k, v in node.items():
            out += json_paths(v, (*at, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += json_paths(v, (*at, i))
    return out


def mixed(*strategies: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    """One of `strategies`, or hostile text."""
    return st.one_of(*strategies, nasty_text, any_text)


def joined(parts: st.SearchStrategy[str], seps: tuple[str, ...] = (",",),
           max_size: int = 4) -> st.SearchStrategy[str]:
    """`parts` joined by separators drawn from `seps`, with blanks around them."""
    @st.composite
    def build(draw: st.DrawFn) -> str:
        items = draw(st.lists(parts, max_size=max_size))
        out = ""
        for i, item in enumerate(items):
            if i:
                out += draw(st.sampled_from(seps))
            out += draw(st.sampled_from(("", "", " ", "  "))) + item
        return out
    return build()


@st.composite
def chunked(draw: st.DrawFn, data: bytes) -> list[bytes]:
    """`data` cut at arbitrary offsets (as reads from a socket cut a byte stream)."""
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=8)))
    bounds = [0, *cuts, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


# ---- device names ------------------------------------------------------------------------

def _demo_ids() -> tuple[str, ...]:
    inv = demo_inventory()
    return tuple(sorted({i for d in inv.devices for i in d.ids}))


DEMO_IDS = _demo_ids()
KINDS = ("nvidia.com/gpu", "nvidia.com/mig", "aws.amazon.com/neuron", "acme.example/npu",
         "vendor.com/dev", "nvidia.com/other")
kind = mixed(st.sampled_from(KINDS),
             st.from_regex(r"[a-z][a-z0-9.-]{0,8}[a-z0-9]/[a-z][a-z0-9_.-]{0,6}", fullmatch=True))
ident = mixed(
    st.sampled_from(DEMO_IDS),
    st.sampled_from(("all", "none", "npu0", "npu1", "0-3", "3-0", "0-999999", "00", "7:9",
                     "MIG-GPU-2e8b6f4a-5c3d-4b1e-9f7a-6c2d8e4b0a87/2/0", "GPU-x")),
    st.integers(0, 300).map(str),
    st.builds(lambda a, b: f"{a}-{b}", st.integers(0, 300), st.integers(0, 300)),
    st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,20}", fullmatch=True),
)

# ---- annotations ---------------------------------------------------------------------------

_entry = st.one_of(
    st.builds(lambda k, ids: f"{k}={ids}", kind, joined(ident, max_size=3)),
    st.builds(lambda k, n: f"{k}: {n}", kind, st.one_of(st.integers(-2, 300).map(str),
                                                       nasty_text)),
    joined(ident, max_size=3),
)
devices_value = mixed(joined(_entry, (";", "\n", "; ")))
cdi_value = mixed(joined(st.builds(lambda k, i: f"{k}={i}", kind, ident), (",",)))
injector_value = mixed(
    st.lists(st.builds(lambda k, i: f"{k}={i}", kind, ident), max_size=4)
    .map(lambda names: "".join(f"- {n}\n" for n in names)),
    st.sampled_from(("[]", "- 2001-02-30", "- !!binary '@@'", "- !!python/name:os.system",
                     "a: b", "- [a]", "- &a [*a]", "- *x", "--- \n...", "- 0x1F",
                     "- 1:2:3", "- .nan", "- 1_000", "- ? a", "!!set {a}")),
)
capability_names = ("utility", "compute", "video", "graphics", "display", "ngx", "compat32",
                    "all", "mig-config", "bogus", "")
capabilities_value = mixed(joined(st.sampled_from(capability_names)))

_KEY_SUFFIXES = ("", "/pod", f"/container.{CONTAINER}", "/container.other", "/container.",
                 "/bogus", "/resource.nvidia.com_gpu", "/resource.x")
_OPTION_KEYS = tuple(p.option_key for p in PROFILES if p.option_key)
annotation_key = st.one_of(
    st.builds(lambda p, s: p + s, st.sampled_from((DEVICES_KEY, *_OPTION_KEYS,
                                                   *INJECTOR_CDI_KEYS)),
              st.sampled_from(_KEY_SUFFIXES)),
    st.builds(lambda p, s: p + s, st.sampled_from(CDI_PREFIXES), any_text),
    st.sampled_from((GRANT_KEY_PREFIX + "nvidia.com_gpu", ANNOTATION_GRANTED, ANNOTATION_SHARED,
                     "io.kubernetes.cri-o.Metadata", "io.kubernetes.container.name")),
    any_text,
)


@st.composite
def annotation(draw: st.DrawFn) -> tuple[str, str]:
    """A (key, value), the value usually in the grammar the key reads."""
    key = draw(annotation_key)
    if key.startswith(INJECTOR_CDI_KEYS):
        value = draw(injector_value)
    elif key.startswith(CDI_PREFIXES):
        value = draw(cdi_value)
    elif key.startswith(_OPTION_KEYS):
        value = draw(capabilities_value)
    elif key in (ANNOTATION_GRANTED, ANNOTATION_SHARED):
        value = draw(mixed(joined(st.builds(lambda k, i: f"{k}={i}", kind, ident))))
    elif key == "io.kubernetes.cri-o.Metadata":
        value = draw(mixed(st.sampled_from(('{"name": "main"}', '{"name": 1}', "[]", "null",
                                            '{"name": "' + "x" * 5000 + '"}', "[" * 3000,
                                            '{"a":' * 3000, "1" * 4400))))
    else:
        value = draw(devices_value)
    return key, value


annotations = st.lists(annotation(), max_size=4).map(dict)

# ---- env ----------------------------------------------------------------------------------

ENV_NAMES = tuple(sorted({n for p in PROFILES for n in p.env_names}))
ENV_PREFIXES = tuple(x for p in PROFILES for x in p.env_prefixes)

_version = st.one_of(st.from_regex(r"[0-9]{1,3}(\.[0-9]{1,3}){0,3}", fullmatch=True),
                     st.sampled_from(("12.4", "470", "550.54.15", "8.0", "9" * 30, "1.", ".1",
                                      "v12.4.1", "12.4.1-rc1+b", "01.2", "")))
_constraint = st.builds(
    lambda k, op, v: f"{k}{op}{v}",
    st.sampled_from(("cuda", "driver", "arch", "brand", "CUDA", "Brand", "bogus", "")),
    st.sampled_from((*OPERATORS, "", "==", "=<", "!", "<>", "=!")),
    st.one_of(_version, st.sampled_from(("tesla", "nvidia", "unknown", "Tesla", "a b", "x/y"))),
)
requirement_value = mixed(joined(joined(_constraint, (",",), 4), (" ", "  "), 4))


_ENV_VALUES = {
    "NVIDIA_VISIBLE_DEVICES": mixed(joined(st.one_of(ident, st.builds(
        lambda k, i: f"{k}={i}", kind, ident)))),
    "NV_GPU": mixed(joined(ident, (",", " "))),
    "AWS_NEURON_VISIBLE_DEVICES": mixed(joined(ident)),
    "NVIDIA_DRIVER_CAPABILITIES": capabilities_value,
    "CUDA_VERSION": mixed(_version),
    "NVIDIA_DISABLE_REQUIRE": mixed(st.sampled_from(("1", "true", "T", "0", "yes"))),
    "NVIDIA_MIG_CONFIG_DEVICES": mixed(st.sampled_from(("all", "", "0"))),
    "NVIDIA_MIG_MONITOR_DEVICES": mixed(st.sampled_from(("all", "", "0"))),
}
_ANY_VALUE = mixed()


def _env_value(name: str) -> st.SearchStrategy[str]:
    if name.startswith("NVIDIA_REQUIRE_"):
        return requirement_value
    return _ENV_VALUES.get(name, _ANY_VALUE)


env_name = st.one_of(
    st.sampled_from(ENV_NAMES),
    st.builds(lambda p, s: p + s, st.sampled_from(ENV_PREFIXES),
              st.sampled_from(("CUDA", "DRIVER", "ARCH", "JETPACK", "X", "", "\x00", "é"))),
    st.sampled_from(("LD_PRELOAD", "PATH", "NVIDIA_VISIBLE_DEVICESX", "NVIDIA_VISIBLE_DEVICES ")),
    any_text,
)


@st.composite
def env_entry(draw: st.DrawFn) -> str:
    """One OCI env entry: NAME=VALUE in the variable's grammar, or something else."""
    if draw(st.integers(0, 15)) == 0:
        return draw(any_text)  # no '=': not a variable
    name = draw(env_name)
    return f"{name}={draw(_env_value(name))}"


env = st.lists(env_entry(), max_size=6).map(tuple)


# ---- containers -----------------------------------------------------------------------------

namespace = st.sampled_from(("default", "gpu-operator", "sandbox", ""))


@st.composite
def container_info(draw: st.DrawFn, text: st.SearchStrategy[str] = any_text) -> ContainerInfo:
    """A ContainerInfo as nri.convert builds it: pod and container annotations, env."""
    pod = draw(annotations)
    ctr = draw(annotations)
    for key in sorted(pod):  # CRI-O copies the pod's annotations; a pod may set others
        copy = draw(st.sampled_from(("none", "same", "other")))
        if copy == "same":
            ctr[key] = pod[key]
        elif copy == "other":
            ctr[key] = draw(devices_value)
    return ContainerInfo(
        namespace=draw(namespace),
        pod_name=draw(text),
        pod_uid=draw(text),
        container_name=draw(st.sampled_from((CONTAINER, CONTAINER, "other", ""))),
        container_id=draw(st.sampled_from(("c1", "c2", "c3", ""))),
        pod_annotations=MappingProxyType(pod),
        container_annotations=MappingProxyType(ctr),
        env=draw(env),
        spec_devices=MappingProxyType(dict(draw(st.lists(st.sampled_from((
            ("/dev/nvidia0", ("c", 195, 0)), ("/dev/nvidia0", ("c", 195, 5)),
            ("/dev/fuse", ("c", 10, 229)))), max_size=2)))),
        mount_destinations=frozenset(draw(st.lists(st.sampled_from(
            ("/usr/bin/nvidia-smi", "/tmp")), max_size=2))),
    )


# ---- nodes -------------------------------------------------------------------------------

def mixed_inventory() -> Inventory:
    """The demo node plus 4 Neuron devices (2 cores each) and 2 CDI devices of a vendor
    spec with spec-level edits: every family's request path has devices to find."""
    demo = demo_inventory()
    neuron = tuple(
        Device(kind="aws.amazon.com/neuron", name=str(i), aliases=(f"neuron{i}",),
               edits=ContainerEdits(device_nodes=(DeviceNode(f"/dev/neuron{i}", 240, i),)),
               attributes=MappingProxyType({"cores": "2"}), vendor="neuron")
        for i in range(4))
    acme = tuple(
        Device(kind="acme.example/npu", name=f"npu{i}",
               edits=ContainerEdits(device_nodes=(DeviceNode(f"/dev/acme{i}", 300, i),)),
               vendor="cdi:/etc/cdi/acme.yaml")
        for i in range(2))
    drivers = dict(demo.drivers)
    drivers["neuron"] = Driver("neuron", "2.19.64.0")
    drivers["cdi:/etc/cdi/acme.yaml"] = Driver(
        "cdi:/etc/cdi/acme.yaml", capabilities=MappingProxyType({"": ContainerEdits(
            env=("ACME_RUNTIME=1",), mounts=(Mount("/opt/acme/lib/libacme.so.1",
                                                   "/opt/acme/lib/libacme.so.1"),))}))
    return Inventory(devices=(*demo.devices, *neuron, *acme),
                     drivers=MappingProxyType(drivers))
