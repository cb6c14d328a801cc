"""NVIDIA_REQUIRE_* against libnvidia-container's src/cli/dsl.c and configure.c, and the
toolkit's cuda_image.go (legacy CUDA_VERSION, NVIDIA_DISABLE_REQUIRE, JETPACK skipped)."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import pytest
from request_testing import nv, parse

from nri_accel.errors import RequestError
from nri_accel.inventory import Device, Driver, Inventory
from nri_accel.select import DeviceIndex
from nri_accel.vendors.nvidia import KIND_GPU, PROFILE, Options
from nri_accel.vendors.nvidia import requirements as requirements_module
from nri_accel.vendors.nvidia.requirements import (
    MAX_CONSTRAINTS,
    Constraint,
    Requirements,
    parse_requirement,
    requirements_from_env,
)

SRC = "env NVIDIA_REQUIRE_CUDA"


# dsl_compare_version: numeric components, trailing zero components ignored.
@pytest.mark.parametrize(("fact", "op", "value", "holds"), [
    ("12.4", ">=", "12.4", True),
    ("12.4", ">=", "12", True),
    ("12.4", ">", "12", True),
    ("12", "=", "12.0", True),
    ("12.0.0", "=", "12", True),
    ("12", "!=", "12.0.0", False),
    ("12.1", "<", "12.10", True),
    ("12.10", ">", "12.9", True),
    ("12.2", ">=", "12.4", False),
    ("535.104.05", ">=", "535.104", True),
    ("535.104.05", "<", "535.104.5", False),  # 05 == 5
    ("470.57.02", "<", "471", True),
    ("470.57.02", ">=", "470", True),
    ("470", "<=", "470.0", True),
    ("8.0", ">=", "7.5", True),
    ("8.6", "!=", "8.6", False),
    ("9.0", "<", "10.0", True),
])
def test_version_comparison(fact: str, op: str, value: str, holds: bool) -> None:
    assert Constraint("cuda", op, value).holds({"cuda": fact}) is holds


@pytest.mark.parametrize(("fact", "op", "value", "holds"), [
    ("tesla", "=", "tesla", True),
    ("Tesla", "=", "TESLA", True),  # str_case_equal
    ("geforce", "=", "tesla", False),
    ("geforce", "!=", "tesla", True),
    ("tesla", "!=", "Tesla", False),
])
def test_brand_comparison(fact: str, op: str, value: str, holds: bool) -> None:
    assert Constraint("brand", op, value).holds({"brand": fact}) is holds


def test_unknown_facts_satisfy_constraints() -> None:
    # configure.c: no device -> arch and brand hold; no CUDA/driver version -> holds.
    req = parse_requirement(SRC, "arch>=9.0,brand=tesla,cuda>=99,driver>=999")
    assert req.holds({})
    assert req.holds({"cuda": "", "driver": ""})
    assert not req.holds({"arch": "8.0"})


def test_unparseable_fact_fails() -> None:
    assert not Constraint("driver", ">=", "1").holds({"driver": "unknown"})


# Space-separated alternatives are ORed; comma-separated constraints are ANDed.
CUDA_12_4 = ("cuda>=12.4 brand=tesla,driver>=470,driver<471 "
             "brand=unknown,driver>=470,driver<471 brand=tesla,driver>=535,driver<536")


@pytest.mark.parametrize(("facts", "holds"), [
    ({"cuda": "12.4", "driver": "550.54.15", "brand": "tesla"}, True),
    ({"cuda": "12.2", "driver": "535.104.05", "brand": "tesla"}, True),  # 3rd alternative
    ({"cuda": "12.2", "driver": "535.104.05", "brand": "geforce"}, False),
    ({"cuda": "11.4", "driver": "470.57.02", "brand": "Unknown"}, True),
    ({"cuda": "12.0", "driver": "525.60.13", "brand": "tesla"}, False),
])
def test_or_of_ands(facts: dict[str, str], holds: bool) -> None:
    assert parse_requirement(SRC, CUDA_12_4).holds(facts) is holds


def test_empty_groups_and_tokens_are_skipped() -> None:
    req = parse_requirement(SRC, "  cuda>=12,, ,driver>=1  ")
    assert req.alternatives == ((Constraint("cuda", ">=", "12"),),
                                (Constraint("driver", ">=", "1"),))
    assert parse_requirement(SRC, "").holds({"cuda": "1"})


def test_keys_are_case_insensitive() -> None:
    assert parse_requirement(SRC, "CUDA>=12").alternatives == ((Constraint("cuda", ">=", "12"),),)


@pytest.mark.parametrize(("text", "message"), [
    ("cuda>=", "expected KEY OP VALUE"),
    ("cuda", "expected KEY OP VALUE"),
    (">=12", "expected KEY OP VALUE"),
    ("cuda=>12", "unknown operator '=>'"),
    ("cuda==12", "unknown operator '=='"),
    ("cuda>=12a", "dotted version"),
    ("cuda>=12..1", "dotted version"),
    ("driver>=470,brand<tesla", "compares only with = or !="),
    ("foo=1", "unknown key 'foo'"),
    ("cuda>=12 jetpack=5", "unknown key 'jetpack'"),  # checked even after a true alternative
])
def test_malformed_constraints_rejected(text: str, message: str) -> None:
    with pytest.raises(RequestError, match=message) as err:
        parse_requirement(SRC, text)
    assert err.value.source == SRC


def test_every_variable_must_hold_and_jetpack_is_skipped() -> None:
    reqs = requirements_from_env({
        "NVIDIA_REQUIRE_CUDA": "cuda>=12.0",
        "NVIDIA_REQUIRE_ARCH": "arch>=8.0",
        "NVIDIA_REQUIRE_JETPACK": "not a constraint",
        "NVIDIA_REQUIRE_JETPACK_HOST_MOUNTS": "",
    })
    assert reqs is not None
    assert [r.source for r in reqs.items] == ["env NVIDIA_REQUIRE_ARCH", SRC]
    assert reqs.unsatisfied({"cuda": "12.4", "arch": "9.0"}) is None
    assert reqs.unsatisfied({"cuda": "12.4", "arch": "7.5"}) == (
        "env NVIDIA_REQUIRE_ARCH", "unsatisfied condition: arch>=8.0 (this GPU has arch=7.5)")
    assert reqs.unsatisfied({"cuda": "11.8", "arch": "9.0"}) == (
        SRC, "unsatisfied condition: cuda>=12.0 (this GPU has cuda=11.8); update the driver "
             "or use an image built for an earlier CUDA")


def test_message_counts_alternatives() -> None:
    reqs = Requirements((parse_requirement(SRC, CUDA_12_4),))
    failed = reqs.unsatisfied({"cuda": "12.0", "driver": "525.60.13", "brand": "tesla"})
    assert failed is not None
    source, msg = failed
    assert source == SRC
    assert msg.startswith("unsatisfied condition: cuda>=12.4 (this GPU has cuda=12.0)")
    assert "none of the 4 alternatives holds" in msg


# Legacy image: CUDA_VERSION set and NVIDIA_REQUIRE_CUDA unset or empty -> cuda>=MAJOR.MINOR
# (cuda_image.go legacyVersion, golang.org/x/mod/semver).
@pytest.mark.parametrize(("version", "required"), [
    ("9.0.176", "cuda>=9.0"),
    ("10.1", "cuda>=10.1"),
    ("v11.2.0", "cuda>=11.2"),
    ("12", "cuda>=12.0"),
    ("11.0.3-rc1", "cuda>=11.0"),
])
def test_legacy_cuda_version(version: str, required: str) -> None:
    for extra in ({}, {"NVIDIA_REQUIRE_CUDA": ""}):
        reqs = requirements_from_env({"CUDA_VERSION": version, **extra})
        assert reqs is not None
        assert [(r.source, r.text) for r in reqs.items] == [("env CUDA_VERSION", required)]


@pytest.mark.parametrize("version", ["abc", "01.2", "9.0.176.1", "9.x", "9.0-rc1", " 9.0"])
def test_legacy_cuda_version_invalid(version: str) -> None:
    with pytest.raises(RequestError, match="invalid CUDA version") as err:
        requirements_from_env({"CUDA_VERSION": version})
    assert err.value.source == "env CUDA_VERSION"


# NVIDIA/nvidia-container-toolkit internal/config/image/cuda_image_test.go,
# TestParseMajorMinorVersionValid and TestParseMajorMinorVersionInvalid, every row:
# semver (golang.org/x/mod/semver), major and minor unsigned 32-bit.
@pytest.mark.parametrize(("version", "required"), [
    ("0", "cuda>=0.0"),
    ("8", "cuda>=8.0"),
    ("7.5", "cuda>=7.5"),
    ("9.0.116", "cuda>=9.0"),
    ("4294967295.4294967295.4294967295", "cuda>=4294967295.4294967295"),
    ("v11.6", "cuda>=11.6"),
    # beyond the table: the patch is not limited (only major and minor are parsed), and
    # semver's pre-release and build syntax
    ("9.0.4294967296", "cuda>=9.0"),
    ("12.4.1-rc.1+build.7", "cuda>=12.4"),
    ("12.4.1-0.alpha", "cuda>=12.4"),
])
def test_cuda_version_upstream_valid(version: str, required: str) -> None:
    reqs = requirements_from_env({"CUDA_VERSION": version})
    assert reqs is not None
    assert [(r.source, r.text) for r in reqs.items] == [("env CUDA_VERSION", required)]


@pytest.mark.parametrize("version", [
    "foo", "foo.5.10", "9.0.116.50", "9.0.116foo", "7.foo", "9.0.bar", "9.4294967296",
    "9.0.116.", "9..0", "9.", ".5.10", "-9", "+9", "-9.1.116", "-9.-1.-116",
    # beyond the table
    "4294967296", "4294967296.0", "99999999999999999999999.1", "12.4.1-01", "12.4.1-rc..1",
    "12.4.1+", "12.4.1-",
])
def test_cuda_version_upstream_invalid(version: str) -> None:
    with pytest.raises(RequestError, match="invalid CUDA version") as err:
        requirements_from_env({"CUDA_VERSION": version})
    assert err.value.source == "env CUDA_VERSION"


@pytest.mark.parametrize(("version", "which"), [
    ("4294967296", "major"), ("9.4294967296", "minor"), ("v4294967296.1.0", "major"),
])
def test_cuda_version_overflow_is_named(version: str, which: str) -> None:
    with pytest.raises(RequestError) as err:
        parse(env=[f"CUDA_VERSION={version}", "NVIDIA_VISIBLE_DEVICES=all"])
    assert err.value.source == "env CUDA_VERSION"
    assert err.value.message == (f"invalid CUDA version {version!r}: the {which} version "
                                 "does not fit in 32 bits (at most 4294967295)")


# The requirement language's version numbers: unsigned 32-bit, as the legacy cuda>=MAJOR.MINOR
# derived from CUDA_VERSION (NVIDIA/libnvidia-container src/cli/dsl.c dsl_compare_version parses
# them with strtoumax and fails only from UINTMAX_MAX on: nri-accel is stricter, see
# nri_accel/vendors/nvidia/requirements.py).
@pytest.mark.parametrize(("text", "ok"), [
    ("cuda>=4294967295", True),
    ("driver>=550.4294967295.0", True),
    ("arch>=00004294967295", True),  # leading zeros: the value fits
    ("cuda>=4294967296", False),
    ("driver>=550.4294967296", False),
    ("arch>=8.0 cuda>=18446744073709551616", False),  # checked in every alternative
    ("cuda>=1" + "0" * 200, False),
])
def test_requirement_versions_are_32_bit(text: str, ok: bool) -> None:
    if ok:
        parse_requirement(SRC, text)
        return
    with pytest.raises(RequestError, match="does not fit in 32 bits") as err:
        parse_requirement(SRC, text)
    assert err.value.source == SRC


def test_requirement_overflow_names_the_variable_in_a_request() -> None:
    with pytest.raises(RequestError) as err:
        parse(env=["NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_REQUIRE_DRIVER=driver>=4294967296"])
    assert err.value.source == "env NVIDIA_REQUIRE_DRIVER"
    assert err.value.message == ("invalid constraint 'driver>=4294967296': version number "
                                 "4294967296 does not fit in 32 bits (at most 4294967295)")


def test_not_legacy_when_require_cuda_is_set() -> None:
    reqs = requirements_from_env({"CUDA_VERSION": "12.4.1", "NVIDIA_REQUIRE_CUDA": "cuda>=12.4"})
    assert reqs is not None
    assert [r.source for r in reqs.items] == [SRC]


# NVIDIA_DISABLE_REQUIRE: Go strconv.ParseBool, an invalid value counts as false.
@pytest.mark.parametrize(("value", "disabled"), [
    ("true", True), ("1", True), ("t", True), ("T", True), ("TRUE", True), ("True", True),
    ("false", False), ("0", False), ("", False), ("yes", False), ("on", False),
    ("tRUE", False),
])
def test_disable_require(value: str, disabled: bool) -> None:
    env = {"NVIDIA_DISABLE_REQUIRE": value, "NVIDIA_REQUIRE_CUDA": "cuda>=12",
           "CUDA_VERSION": "9.0"}
    assert (requirements_from_env(env) is None) is disabled


def test_disable_require_skips_malformed_values() -> None:
    assert requirements_from_env({"NVIDIA_DISABLE_REQUIRE": "1",
                                  "NVIDIA_REQUIRE_CUDA": "garbage"}) is None


def test_no_requirements_is_none() -> None:
    assert requirements_from_env({}) is None
    assert requirements_from_env({"NVIDIA_REQUIRE_CUDA": " "}) is None


def test_request_carries_requirements_and_names_the_variable() -> None:
    assert nv(parse(env=["NVIDIA_REQUIRE_CUDA=cuda>=12"])).requirements is not None
    with pytest.raises(RequestError) as err:
        parse(env=["NVIDIA_REQUIRE_DRIVER=driver>=abc", "NVIDIA_VISIBLE_DEVICES=all"])
    assert err.value.source == "env NVIDIA_REQUIRE_DRIVER"


# ---- bounds: what one container's requirements may cost ---------------------------------

def written(n: int, start: int = 0, sep: str = ",") -> str:
    """`n` distinct constraints that every GPU of gpu_index() satisfies."""
    return sep.join(f"cuda>=0.{i}" for i in range(start, start + n))


def test_constraints_past_the_limit_are_refused_before_any_is_parsed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    parsed: list[tuple[str, str]] = []
    real = requirements_module.parse_requirement

    def counting(source: str, text: str) -> Any:
        parsed.append((source, text))
        return real(source, text)

    monkeypatch.setattr(requirements_module, "parse_requirement", counting)
    over = [f"NVIDIA_REQUIRE_A={written(300, sep=' ')}",
            f"NVIDIA_REQUIRE_B={written(MAX_CONSTRAINTS - 300 + 1, 300)}",
            "NVIDIA_VISIBLE_DEVICES=all"]
    with pytest.raises(RequestError) as err:
        parse(env=over)
    assert err.value.source == "env NVIDIA_REQUIRE_B"
    assert err.value.message == (f"the NVIDIA_REQUIRE_* variables write more than "
                                 f"{MAX_CONSTRAINTS} constraints in all (a CUDA image writes "
                                 "about 100)")
    assert parsed == []
    # Disabled requirements are never parsed, so they cost nothing to bound.
    assert nv(parse(env=[*over, "NVIDIA_DISABLE_REQUIRE=true"])).requirements is None


def test_constraints_at_the_limit_are_read() -> None:
    # Empty pieces are not constraints, nor is NVIDIA_REQUIRE_JETPACK* (never parsed).
    reqs = nv(parse(env=[f"NVIDIA_REQUIRE_A= {written(300, sep='  ')} ,",
                         f"NVIDIA_REQUIRE_B={written(MAX_CONSTRAINTS - 300, 300, ',,')}",
                         "NVIDIA_REQUIRE_JETPACK=" + ",".join(["x"] * 600),
                         "NVIDIA_VISIBLE_DEVICES=all"])).requirements
    assert reqs is not None
    assert sum(len(g) for r in reqs.items for g in r.alternatives) == MAX_CONSTRAINTS


def gpu_index(archs: list[str]) -> DeviceIndex:
    """A node of len(archs) GPUs of those compute capabilities, a CUDA 12.4 driver."""
    return DeviceIndex(Inventory(
        devices=tuple(Device(kind=KIND_GPU, name=str(i), uuid=f"GPU-{i:08d}", vendor="nvidia",
                             attributes=MappingProxyType({"compute_capability": arch,
                                                          "brand": "tesla"}))
                      for i, arch in enumerate(archs)),
        drivers=MappingProxyType({"nvidia": Driver("nvidia", "550.54.15", "12.4")})))


def test_requirements_are_evaluated_once_per_set_of_gpu_facts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    evaluated: list[dict[str, str]] = []
    real = Requirements.unsatisfied

    def counting(self: Requirements, facts: Mapping[str, str]) -> tuple[str, str] | None:
        evaluated.append(dict(facts))
        return real(self, facts)

    monkeypatch.setattr(Requirements, "unsatisfied", counting)
    index = gpu_index(["8.0"] * 48 + ["9.0"] * 16)
    gpus = index.inventory.of_kind(KIND_GPU)
    reqs = requirements_from_env({"NVIDIA_REQUIRE_CUDA": CUDA_12_4,
                                  "NVIDIA_REQUIRE_B": written(MAX_CONSTRAINTS - 10)})
    PROFILE.check(gpus, gpus, Options(requirements=reqs), index)
    assert [f["arch"] for f in evaluated] == ["8.0", "9.0"]  # of 64 GPUs
    PROFILE.check(gpus[40:56], gpus[40:56], Options(requirements=reqs), index)
    assert len(evaluated) == 2  # other GPUs, the same facts: nothing evaluated again
    # A failure still names the first GPU of the grant that fails, and its facts.
    arch = requirements_from_env({"NVIDIA_REQUIRE_ARCH": "arch>=9.0"})
    with pytest.raises(RequestError) as err:
        PROFILE.check(gpus[::-1], gpus, Options(requirements=arch), index)
    assert err.value.source == "env NVIDIA_REQUIRE_ARCH"
    assert err.value.message == ("nvidia.com/gpu=47: unsatisfied condition: arch>=9.0 "
                                 "(this GPU has arch=8.0)")
    assert [f["arch"] for f in evaluated[2:]] == ["9.0", "8.0"]
