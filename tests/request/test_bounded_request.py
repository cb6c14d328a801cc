"""The bounds on one request (nri_accel.request: MAX_ANNOTATION_KEYS, MAX_SOURCES,
MAX_REQUEST_IDS, MAX_ENV_ENTRIES): a request at a limit is served, one past it is
refused with a RequestError naming the prefix, the number and the limit, and the
refusal comes before the per-key work it bounds (counted here through wrappers of the
per-key parsers, never by timing). Also: the names a message echoes are cut, and the
device-injector's YAML is parsed once per value, failures included."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from request_testing import KUBERNETES, STANDALONE, info

from nri_accel import policy as policy_module
from nri_accel import request as request_module
from nri_accel import syntax as syntax_module
from nri_accel.errors import PolicyError, RequestError
from nri_accel.request import (
    MAX_ANNOTATION_KEYS,
    MAX_ENV_ENTRIES,
    MAX_REQUEST_IDS,
    MAX_SOURCES,
    parse,
)
from nri_accel.syntax import MAX_IDS, MAX_NAME_CHARS, TOO_MANY_IDS
from nri_accel.vendors import amd

GPU0 = "nvidia.com/gpu=0"


def counted(monkeypatch: pytest.MonkeyPatch, name: str,
            module: Any = request_module) -> list[Any]:
    """Wrap <module>.<name> (a per-key parser or check, request's by default) so that its
    calls are recorded."""
    calls: list[Any] = []
    real: Callable[..., Any] = getattr(module, name)

    def wrapper(*args: Any) -> Any:
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(module, name, wrapper)
    return calls


@pytest.fixture(autouse=True)
def _fresh_memos() -> None:
    # The wrappers count parser calls: nothing may come from an earlier test's memo.
    policy_module._REQUESTS.clear()
    for f in (request_module._parse_devices, request_module._parse_cdi_value,
              request_module._parse_injector_cdi, request_module._read_env_part):
        f.memo.clear()


# ---- annotation keys ---------------------------------------------------------------------

def per_container_keys(n: int) -> dict[str, str]:
    return {f"devices.nri-accel.io/container.c{i}": GPU0 for i in range(n)}


def test_pod_keys_at_the_limit_are_read() -> None:
    pod = {**per_container_keys(MAX_ANNOTATION_KEYS - 1), "devices.nri-accel.io/pod": GPU0}
    request = STANDALONE.request_for(info(pod=pod))
    assert [c.ids for c in request.grants] == [("0",)]


def test_pod_keys_past_the_limit_are_refused_before_any_is_checked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    checked = counted(monkeypatch, "_check_plugin_key")
    pod = {**per_container_keys(MAX_ANNOTATION_KEYS), "devices.nri-accel.io/pod": GPU0,
           "unrelated.example/x": "y"}
    with pytest.raises(RequestError) as err:
        STANDALONE.request_for(info(pod=pod))
    assert type(err.value) is RequestError  # INVALID_ARGUMENT
    assert err.value.source == "pod annotations devices.nri-accel.io/container.*"
    assert (f"{MAX_ANNOTATION_KEYS + 2} annotations, more than {MAX_ANNOTATION_KEYS} of them "
            "under nri-accel's and CDI's prefixes") in err.value.message
    assert f"at most {MAX_ANNOTATION_KEYS} are read" in err.value.message
    assert checked == []


def test_container_keys_past_the_limit_are_refused_before_any_is_parsed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    parsed = counted(monkeypatch, "_parse_cdi_value")
    ctr = {f"cdi.k8s.io/k{i}": GPU0 for i in range(MAX_ANNOTATION_KEYS + 1)}
    with pytest.raises(RequestError, match=f"more than {MAX_ANNOTATION_KEYS}") as err:
        KUBERNETES.request_for(info(ctr=ctr))
    assert err.value.source == "container annotations cdi.k8s.io/*"
    assert parsed == []


def test_keys_kept_by_the_bare_prefix_count_too() -> None:
    # ANNOTATION_PREFIXES holds the bare key devices.nri-accel.io, which the runtime
    # adapter keeps by prefix: keys that merely start with it are counted.
    ctr = {f"devices.nri-accel.io.k{i}": "v" for i in range(MAX_ANNOTATION_KEYS + 1)}
    with pytest.raises(RequestError) as err:
        parse(info(ctr=ctr))
    assert err.value.source == "container annotations devices.nri-accel.io*"


def test_other_annotations_do_not_count() -> None:
    pod = {f"example.com/k{i}": "v" for i in range(5 * MAX_ANNOTATION_KEYS)}
    request = STANDALONE.request_for(info(pod={**pod, "devices.nri-accel.io/pod": GPU0}))
    assert [c.ids for c in request.grants] == [("0",)]


# ---- sources -----------------------------------------------------------------------------

def cdi_keys(n: int, value: str = GPU0) -> dict[str, str]:
    return {f"cdi.k8s.io/claim-{i:03}": value for i in range(n)}


def test_sources_at_the_limit_are_read() -> None:
    request = KUBERNETES.request_for(info(ctr=cdi_keys(MAX_SOURCES)))
    assert len(request.grants) == MAX_SOURCES
    assert request.cdi_names == (GPU0,)


def test_sources_past_the_limit_are_refused_before_any_is_parsed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    parsed = counted(monkeypatch, "_parse_cdi_value")
    # Pod and container sources count together; the runtime's copies of the pod's do not.
    pod = cdi_keys(MAX_SOURCES // 2)
    ctr = {**pod, **{f"nvidia.cdi.k8s.io/c{i}": GPU0 for i in range(MAX_SOURCES // 2 + 1)}}
    with pytest.raises(RequestError) as err:
        STANDALONE.request_for(info(pod=pod, ctr=ctr))
    assert type(err.value) is RequestError
    assert err.value.message == (f"{MAX_SOURCES + 1} annotations ask this container for "
                                 f"devices, most under nvidia.cdi.k8s.io/*: at most "
                                 f"{MAX_SOURCES} are read per container")
    assert err.value.source == "annotations nvidia.cdi.k8s.io/*"
    assert parsed == []
    # The copies alone are one source each, read with the pod's.
    assert len(STANDALONE.request_for(info(pod=pod, ctr=pod)).grants) == MAX_SOURCES // 2


def test_an_untrusted_pod_past_the_limit_is_refused_for_its_size() -> None:
    with pytest.raises(RequestError) as err:
        KUBERNETES.request_for(info(pod=cdi_keys(MAX_SOURCES + 1)))
    assert type(err.value) is RequestError  # not the PolicyError of its first key
    with pytest.raises(PolicyError):
        KUBERNETES.request_for(info(pod=cdi_keys(MAX_SOURCES)))


# ---- device ids --------------------------------------------------------------------------

def ids(first: int, n: int) -> str:
    return "nvidia.com/gpu=" + ",".join(str(i) for i in range(first, first + n))


def test_ids_at_the_limit_are_read() -> None:
    assert MAX_REQUEST_IDS == 2 * MAX_IDS
    parsed = parse(info(ctr={"devices.nri-accel.io/resource.a": ids(0, MAX_IDS),
                             "devices.nri-accel.io/resource.b": ids(MAX_IDS, MAX_IDS - 1)},
                        env=["NVIDIA_VISIBLE_DEVICES=all"]))
    assert sum(len(c.ids) or 1 for s in parsed.sources for c in s.claims) == MAX_REQUEST_IDS


def test_ids_past_the_limit_stop_the_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    parsed = counted(monkeypatch, "_parse_devices")
    ctr = {f"devices.nri-accel.io/resource.r{i:02}": "nvidia.com/gpu=0-255"
           for i in range(MAX_SOURCES)}
    with pytest.raises(RequestError) as err:
        parse(info(ctr=ctr))
    assert err.value.source == "container annotation devices.nri-accel.io/resource.r02"
    assert f"more than {MAX_REQUEST_IDS} device ids in all" in err.value.message
    # of 64: the third is refused before it is parsed (its one token is one id too many)
    assert len(parsed) == 2


def test_env_ids_count_with_the_annotations() -> None:
    with pytest.raises(RequestError, match=f"more than {MAX_REQUEST_IDS} device ids"):
        parse(info(ctr={"devices.nri-accel.io/resource.a": ids(0, MAX_IDS),
                        "devices.nri-accel.io/resource.b": ids(MAX_IDS, MAX_IDS - 1)},
                   env=["NVIDIA_VISIBLE_DEVICES=0,1"]))


# ---- repeats and ranges ------------------------------------------------------------------
# Every id a value names counts, repeats and each id of a range included: a value of 4 KiB
# repeating ids or ranges costs no more than one naming MAX_IDS different ids.

@pytest.mark.parametrize(("key", "value"), [
    ("devices.nri-accel.io/pod", "nvidia.com/gpu=" + ",".join(["0"] * 400)),
    ("cdi.k8s.io/x", ",".join(["x.y/z=0"] * 400)),
])
def test_repeated_ids_stop_the_parse_past_max_ids(monkeypatch: pytest.MonkeyPatch,
                                                  key: str, value: str) -> None:
    # check_id, where the devices grammar (syntax) and the CDI one (request) call it
    checked = [counted(monkeypatch, "check_id", m) for m in (syntax_module, request_module)]
    with pytest.raises(RequestError) as err:
        parse(info(pod={key: value}))
    assert (err.value.source, err.value.message) == (f"annotation {key}", TOO_MANY_IDS)
    assert sum(map(len, checked)) == MAX_IDS + 1  # of 400: the one past the limit is the last


@pytest.mark.parametrize(("kwargs", "source"), [
    ({"pod": {"devices.nri-accel.io/pod": "nvidia.com/gpu=0-199,0-99"}},
     "annotation devices.nri-accel.io/pod"),
    ({"pod": {"devices.nri-accel.io/pod": "nvidia.com/gpu=0-255,0"}},
     "annotation devices.nri-accel.io/pod"),
    ({"ctr": {"cdi.k8s.io/x": ",".join(["x.y/z=0"] * (MAX_IDS + 1))}},
     "container annotation cdi.k8s.io/x"),
    ({"env": ["AWS_NEURON_VISIBLE_DEVICES=0-199,0-99"]}, "env AWS_NEURON_VISIBLE_DEVICES"),
    ({"env": ["AMD_VISIBLE_DEVICES=0-199,0-99"]}, "env AMD_VISIBLE_DEVICES"),
    ({"env": ["AMD_VISIBLE_DEVICES=" + ",".join(["3"] * (MAX_IDS + 1))]},
     "env AMD_VISIBLE_DEVICES"),
    ({"env": ["NVIDIA_VISIBLE_DEVICES=" + ",".join(["0"] * (MAX_IDS + 1))]},
     "env NVIDIA_VISIBLE_DEVICES"),
])
def test_repeats_and_ranges_count_against_max_ids(kwargs: dict[str, Any], source: str) -> None:
    with pytest.raises(RequestError) as err:
        parse(info(**kwargs))
    assert (err.value.source, err.value.message) == (source, TOO_MANY_IDS)


@pytest.mark.parametrize(("kwargs", "ids"), [
    ({"pod": {"devices.nri-accel.io/pod": "nvidia.com/gpu=0-127,0-127"}},
     tuple(map(str, range(128)))),
    ({"env": ["AWS_NEURON_VISIBLE_DEVICES=0-254,0"]}, tuple(map(str, range(255)))),
    ({"env": ["AMD_VISIBLE_DEVICES=1,0-254"]}, ("1", "0", *map(str, range(2, 255)))),
])
def test_max_ids_named_with_repeats_are_read(kwargs: dict[str, Any],
                                             ids: tuple[str, ...]) -> None:
    assert [c.ids for s in parse(info(**kwargs)).sources for c in s.claims] == [ids]


class CountingPattern:
    """A compiled pattern whose fullmatch() calls are counted."""

    def __init__(self, pattern: Any) -> None:
        self.pattern = pattern
        self.calls = 0

    def fullmatch(self, text: str) -> Any:
        self.calls += 1
        return self.pattern.fullmatch(text)


def test_repeated_ranges_stop_the_parse_at_the_one_past_max_ids(
        monkeypatch: pytest.MonkeyPatch) -> None:
    ranges = CountingPattern(syntax_module._RANGE_RE)
    monkeypatch.setattr(syntax_module, "_RANGE_RE", ranges)
    value = "aws.amazon.com/neuron=" + ",".join(["0-255"] * 400)
    with pytest.raises(RequestError) as err:
        parse(info(pod={"devices.nri-accel.io/pod": value}))
    assert err.value.message == TOO_MANY_IDS
    assert ranges.calls == 2  # of 400 ranges: the second goes over
    tokens = counted(monkeypatch, "_token", amd)
    with pytest.raises(RequestError) as err:
        parse(info(env=["AMD_VISIBLE_DEVICES=" + ",".join(["0-1023"] * 500)]))
    assert (err.value.source, err.value.message) == ("env AMD_VISIBLE_DEVICES", TOO_MANY_IDS)
    assert len(tokens) == 1  # of 500: the first names 1024 GPUs


def test_repeats_count_toward_the_request_limit_before_the_parse(
        monkeypatch: pytest.MonkeyPatch) -> None:
    parsed = counted(monkeypatch, "_parse_cdi_value")
    value = ",".join(["x.y/z=0"] * 200)  # 200 ids named, one id
    ctr = {f"cdi.k8s.io/c{i}": value for i in range(3)}
    with pytest.raises(RequestError) as err:
        parse(info(ctr=ctr))
    assert err.value.source == "container annotation cdi.k8s.io/c2"
    assert err.value.message == (
        f"this container's annotations and env name more than {MAX_REQUEST_IDS} device ids "
        "in all (a count or 'all' counts one, repeats and each id of a range count)")
    assert len(parsed) == 2  # the third, 600 ids in all, is refused before it is parsed


def test_repeats_at_the_request_limit_are_read() -> None:
    # A YAML list ends with a newline: its names are counted, not the empty line after.
    parsed = parse(info(pod={"cdi-devices.noderesource.dev/pod": "- x.y/z=0\n" * MAX_IDS},
                        ctr={"cdi.k8s.io/a": ",".join(["x.y/z=1"] * MAX_IDS)}))
    assert [c.ids for s in parsed.sources for c in s.claims] == [("1",), ("0",)]
    with pytest.raises(RequestError, match=f"more than {MAX_REQUEST_IDS} device ids"):
        parse(info(pod={"cdi-devices.noderesource.dev/pod": "- x.y/z=0\n" * MAX_IDS},
                   ctr={"cdi.k8s.io/a": ",".join(["x.y/z=1"] * MAX_IDS)},
                   env=["NVIDIA_VISIBLE_DEVICES=0"]))


# ---- env ---------------------------------------------------------------------------------

def requirements(n: int) -> list[str]:
    return [f"NVIDIA_REQUIRE_R{i}=cuda>=1" for i in range(n)]


def test_env_entries_at_the_limit_are_read() -> None:
    env = ["PATH=/bin", *requirements(MAX_ENV_ENTRIES)]
    assert parse(info(env=env)).options  # the requirements were read


def test_env_entries_past_the_limit_are_refused_before_any_is_read(
        monkeypatch: pytest.MonkeyPatch) -> None:
    read = counted(monkeypatch, "_read_env_part")
    env = ["PATH=/bin", *requirements(MAX_ENV_ENTRIES), "NVIDIA_VISIBLE_DEVICES=0"]
    with pytest.raises(RequestError) as err:
        STANDALONE.request_for(info(env=env))
    assert type(err.value) is RequestError
    assert err.value.source == "env NVIDIA_REQUIRE_*"
    assert err.value.message == (
        f"{MAX_ENV_ENTRIES + 2} env entries, more than {MAX_ENV_ENTRIES} of them defining "
        f"variables nri-accel reads or rewrites, most NVIDIA_REQUIRE_*: at most "
        f"{MAX_ENV_ENTRIES} are read per container")
    assert read == []


def test_a_repeated_variable_counts_each_definition() -> None:
    env = [f"NVIDIA_VISIBLE_DEVICES={i % 8}" for i in range(MAX_ENV_ENTRIES + 1)]
    with pytest.raises(RequestError) as err:
        parse(info(env=env))
    assert err.value.source == "env NVIDIA_VISIBLE_DEVICES"


def test_variables_not_read_do_not_count() -> None:
    env = [*(f"FOO_{i}=x" for i in range(10 * MAX_ENV_ENTRIES)), "NVIDIA_VISIBLE_DEVICES=0"]
    assert [c.ids for s in parse(info(env=env)).sources for c in s.claims] == [("0",)]


# ---- what messages echo ------------------------------------------------------------------

def test_a_huge_namespace_is_cut_in_refusals_and_notes_and_not_remembered() -> None:
    namespace = "n" * 1_000_000
    with pytest.raises(PolicyError) as err:
        KUBERNETES.request_for(info(pod={"devices.nri-accel.io/pod": GPU0},
                                    namespace=namespace))
    assert len(str(err.value)) < 2 * MAX_NAME_CHARS + 200
    request = KUBERNETES.request_for(info(env=["NVIDIA_VISIBLE_DEVICES=all"],
                                          namespace=namespace))
    assert request.grants == () and len(request.notes) == 1
    assert len(request.notes[0]) < 2 * MAX_NAME_CHARS + 200
    assert len(policy_module._REQUESTS) == 0  # its key is over a sixteenth of the memo
    # A namespace of that length is still compared with the trusted ones.
    trusting = policy_module.Policy(trusted_namespaces=frozenset({namespace}))
    granted = trusting.request_for(info(pod={"devices.nri-accel.io/pod": GPU0},
                                        namespace="n" * 1_000_000))
    assert [c.ids for c in granted.grants] == [("0",)]


def test_a_huge_container_name_has_no_per_container_key() -> None:
    name = "c" * (MAX_NAME_CHARS + 1)
    request = STANDALONE.request_for(info(pod={"devices.nri-accel.io/pod": GPU0},
                                          container=name))
    assert [c.ids for c in request.grants] == [("0",)]
    with pytest.raises(RequestError, match="container name longer than") as err:
        STANDALONE.request_for(info(pod={f"devices.nri-accel.io/container.{name}": GPU0},
                                    container=name))
    assert len(err.value.source) < 100
    # At the limit, it is still a name.
    name = "c" * MAX_NAME_CHARS
    request = STANDALONE.request_for(info(pod={f"devices.nri-accel.io/container.{name}": GPU0},
                                          container=name))
    assert [c.ids for c in request.grants] == [("0",)]


# ---- the device-injector's YAML ----------------------------------------------------------

def test_injector_yaml_is_parsed_once_per_value_failures_included(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import yaml

    loads: list[Any] = []
    real = yaml.load

    def load(stream: str, Loader: Any) -> Any:  # PyYAML names it Loader
        loads.append(Loader)
        return real(stream, Loader=Loader)

    monkeypatch.setattr(yaml, "load", load)
    bad = {"cdi-devices.noderesource.dev/pod": "- nvidia.com/gpu=0\n- nvidia.com/gp"}
    errors = []
    for _ in range(3):
        with pytest.raises(RequestError, match="invalid CDI device name") as err:
            parse(info(pod=bad))
        errors.append(err.value)
    assert errors[0] is not errors[1] and str(errors[0]) == str(errors[2])
    good = {"cdi-devices.noderesource.dev/pod": "- nvidia.com/gpu=0\n- nvidia.com/gpu=1"}
    for _ in range(2):
        assert [c.ids for s in parse(info(pod=good)).sources for c in s.claims] == [("0", "1")]
    assert len(loads) == 2
    assert loads[0] is getattr(yaml, "CSafeLoader", yaml.SafeLoader)
