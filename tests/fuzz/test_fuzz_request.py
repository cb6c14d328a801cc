"""Fuzz target: every annotation and env grammar, through request.parse and the trust
policy (Policy.request_for), and the NVIDIA_REQUIRE_* language on its own.

Properties:
- a container's request is either a Request or a RequestError (PolicyError included);
  nothing else ever comes out;
- the error's `source` names an annotation key or variable the container carries (as
  syntax.named() shows it), and its text starts with that source;
- the same container gives the same answer twice (the memos keep no wrong answer);
- a requirement that parses evaluates against any facts without raising, and its
  constraints written back (str) parse to the same requirement.
"""

from __future__ import annotations

from types import MappingProxyType

import pytest
from fuzz_inputs import annotations, container_info, env, requirement_value
from hypothesis import given
from hypothesis import strategies as st

from nri_accel.container import ContainerInfo
from nri_accel.errors import RequestError
from nri_accel.policy import Policy
from nri_accel.syntax import named
from nri_accel.vendors.nvidia import ALL_CAPABILITIES, parse_capabilities
from nri_accel.vendors.nvidia.requirements import (
    parse_requirement,
    requirements_from_env,
)

POLICIES = (Policy(), Policy(mode="standalone"),
            Policy(trusted_namespaces=frozenset({"gpu-operator"})))
policy = st.sampled_from(POLICIES)


def assert_refused_well(err: RequestError, info: ContainerInfo) -> None:
    """`err` names one of `info`'s annotations or variables, and its text starts so."""
    candidates = [named(what, key) for what, carried in (
        ("annotation", info.pod_annotations), ("container annotation",
                                               info.container_annotations))
        for key in carried]
    candidates += [named("env", kv.partition("=")[0]) for kv in info.env if "=" in kv]
    assert err.source, f"no source: {err!r}"
    assert any(err.source == c or err.source.startswith(c + " ") for c in candidates), (
        f"source {err.source!r} names nothing the container carries")
    assert str(err).startswith(err.source + ": ")


def check(policy: Policy, info: ContainerInfo) -> None:
    try:
        first = policy.request_for(info)
    except RequestError as err:
        assert_refused_well(err, info)
        with pytest.raises(RequestError) as again:
            policy.request_for(info)
        assert (type(again.value), str(again.value)) == (type(err), str(err))
        return
    assert policy.request_for(info) == first


def only(pod: dict[str, str] | None = None, ctr: dict[str, str] | None = None,
         env: tuple[str, ...] = (), namespace: str = "default") -> ContainerInfo:
    return ContainerInfo(namespace=namespace, pod_name="p", pod_uid="u", container_name="main",
                         container_id="c1", pod_annotations=MappingProxyType(pod or {}),
                         container_annotations=MappingProxyType(ctr or {}), env=env)


@given(policy, annotations, annotations)
def test_annotations(policy: Policy, pod: dict[str, str], ctr: dict[str, str]) -> None:
    check(policy, only(pod=pod, ctr=ctr))


@given(policy, env)
def test_env(policy: Policy, entries: tuple[str, ...]) -> None:
    check(policy, only(env=entries))


@given(policy, container_info())
def test_whole_container(policy: Policy, info: ContainerInfo) -> None:
    check(policy, info)


FACT_VALUES = st.one_of(st.sampled_from(("", "12.4", "550.54.15", "8.0", "tesla", "x", "1.")),
                        st.text(max_size=12))
facts = st.fixed_dictionaries({}, optional={k: FACT_VALUES for k in
                                            ("cuda", "driver", "arch", "brand")})


@given(requirement_value, facts)
def test_requirement_language(text: str, facts: dict[str, str]) -> None:
    source = "env NVIDIA_REQUIRE_FUZZ"
    try:
        req = parse_requirement(source, text)
    except RequestError as err:
        assert err.source == source
        assert str(err).startswith(source + ": ")
        return
    if not req.holds(facts):
        assert req.explain(facts)
    rewritten = " ".join(",".join(str(c) for c in group) for group in req.alternatives)
    assert parse_requirement(source, rewritten).alternatives == req.alternatives


@given(env)
def test_requirements_from_env(entries: tuple[str, ...]) -> None:
    values = {k: v for k, eq, v in (e.partition("=") for e in entries) if eq}
    try:
        requirements_from_env(values)
    except RequestError as err:
        assert err.source.removeprefix("env ") in values


@given(st.text(max_size=40))
def test_capabilities(value: str) -> None:
    try:
        caps, source = parse_capabilities(value, "env NVIDIA_DRIVER_CAPABILITIES")
    except RequestError as err:
        assert err.source == "env NVIDIA_DRIVER_CAPABILITIES"
        return
    assert source == "env NVIDIA_DRIVER_CAPABILITIES" and caps <= ALL_CAPABILITIES
    # No capability only for a value of blanks and commas alone, as the toolkit reads it
    # ("" is the default, utility,compute): tests/request/test_request_env.py pins both.
    assert bool(caps) == (value == "" or bool(value.replace(",", "").strip()))
