"""NVIDIA_REQUIRE_* constraints: the language, its parser and its evaluation.

Owns: Constraint, Requirement, Requirements, parse_requirement(), requirements_from_env()
and legacy_cuda_image(). Imports the standard library, msgspec and nri_accel.errors only. Pure:
no I/O; parsing is memoised because CUDA images ship the same long expressions.

Semantics follow libnvidia-container (src/cli/dsl.c, src/cli/configure.c) as driven by
nvidia-container-toolkit (internal/config/image/cuda_image.go):

- Each variable whose name starts with NVIDIA_REQUIRE_ (except NVIDIA_REQUIRE_JETPACK,
  which the toolkit skips) is one requirement; all requirements must hold (AND).
- Inside one value, space-separated groups are alternatives (OR) and comma-separated
  constraints inside a group must all hold (AND): ``cuda>=12.0 brand=tesla,driver>=470``.
- A constraint is ``KEY OP VALUE`` with KEY in cuda, driver, arch, brand (case-insensitive)
  and OP one of = != < <= > >=. cuda/driver/arch compare as dotted numbers with trailing
  zero components ignored (12 == 12.0, 12.4 > 12); brand compares case-insensitively and
  only with = or !=.
- A fact the node does not know (no GPU visible, so no arch/brand; no CUDA version)
  satisfies the constraint, as upstream does.
- A legacy image (CUDA_VERSION set, NVIDIA_REQUIRE_CUDA unset or empty) requires
  ``cuda>=MAJOR.MINOR`` of CUDA_VERSION; NVIDIA_DISABLE_REQUIRE (Go strconv.ParseBool
  true: 1, t, T, true, TRUE, True) disables every requirement.

- Version numbers are unsigned 32-bit: a CUDA_VERSION whose major or minor exceeds
  4294967295 is refused (the toolkit's ParseUint(_, 10, 32); the patch is not limited,
  as there), and so is a constraint with a larger version component.

Deliberate differences: upstream reports a malformed constraint only when evaluation
reaches it; here every constraint is checked when the request is parsed, so a typo fails
the container at once with the variable named, whatever the GPU. And libnvidia-container
(dsl_compare_version, strtoumax) refuses a component only from UINTMAX_MAX (2^64 - 1)
on; here the limit is the 32 bits the toolkit gives CUDA_VERSION, which every real
driver, CUDA and compute-capability number is far below.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from msgspec import Struct

from nri_accel.errors import RequestError, cut
from nri_accel.memo import memoized

_SHOWN = 40  # characters of a requirement or version quoted in a message

REQUIRE_PREFIX = "NVIDIA_REQUIRE_"
REQUIRE_JETPACK = "NVIDIA_REQUIRE_JETPACK"
REQUIRE_CUDA = "NVIDIA_REQUIRE_CUDA"
DISABLE_REQUIRE = "NVIDIA_DISABLE_REQUIRE"
CUDA_VERSION = "CUDA_VERSION"

VERSION_KEYS = frozenset({"cuda", "driver", "arch"})
STRING_KEYS = frozenset({"brand"})
OPERATORS = ("=", "!=", "<", "<=", ">", ">=")

_GO_TRUE = frozenset({"1", "t", "T", "TRUE", "true", "True"})
_OP_CHARS = "<>=!"
_VERSION_RE = re.compile(r"[0-9]+(?:\.[0-9]+)*")
_BRAND_RE = re.compile(r"[A-Za-z0-9_.-]+")
# Go golang.org/x/mod/semver as the toolkit uses it for CUDA_VERSION ("v" optional):
# MAJOR[.MINOR[.PATCH[-PRERELEASE][+BUILD]]], no leading zeros in numbers or in numeric
# pre-release identifiers, no empty identifier.
_NUM = r"(?:0|[1-9][0-9]*)"
_PRE_ID = r"(?:0|[1-9][0-9]*|[0-9]*[A-Za-z-][0-9A-Za-z-]*)"
_BUILD_ID = r"[0-9A-Za-z-]+"
_SEMVER_RE = re.compile(
    rf"v?({_NUM})(?:\.({_NUM})(?:\.{_NUM}(?:-{_PRE_ID}(?:\.{_PRE_ID})*)?"
    rf"(?:\+{_BUILD_ID}(?:\.{_BUILD_ID})*)?)?)?"
)
# Version numbers are unsigned 32-bit: the toolkit parses CUDA_VERSION's major and minor
# with strconv.ParseUint(_, 10, 32) (internal/config/image cuda_image.go
# parseMajorMinorVersion; its tests: 4294967295 is valid, 9.4294967296 is not), and the
# requirement it derives, cuda>=MAJOR.MINOR, goes through the same language.
UINT32_MAX = 0xFFFFFFFF


def _version(text: str) -> tuple[int, ...]:
    """Dotted number -> tuple without trailing zero components (12.0 == 12)."""
    parts = [int(p) for p in text.split(".")]
    while len(parts) > 1 and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def _compare(left: tuple[int, ...], op: str, right: tuple[int, ...]) -> bool:
    width = max(len(left), len(right))
    a = left + (0,) * (width - len(left))
    b = right + (0,) * (width - len(right))
    if op == "=":
        return a == b
    if op == "!=":
        return a != b
    if op == "<":
        return a < b
    if op == "<=":
        return a <= b
    if op == ">":
        return a > b
    return a >= b


class Constraint(Struct, frozen=True):
    """One ``KEY OP VALUE`` test, e.g. cuda>=12.4 or brand=tesla."""

    key: str  # lower case: cuda, driver, arch, brand
    op: str
    value: str

    def __str__(self) -> str:
        return f"{self.key}{self.op}{self.value}"

    def holds(self, facts: Mapping[str, str]) -> bool:
        """True when the fact satisfies this constraint or the fact is unknown."""
        fact = facts.get(self.key, "")
        if not fact:
            return True
        if self.key in STRING_KEYS:
            same = fact.lower() == self.value.lower()
            return same if self.op == "=" else not same
        if not _VERSION_RE.fullmatch(fact):
            return False
        return _compare(_version(fact), self.op, _version(self.value))


class Requirement(Struct, frozen=True):
    """One NVIDIA_REQUIRE_* variable: alternatives (OR) of constraint groups (AND)."""

    source: str  # "env NVIDIA_REQUIRE_CUDA", "env CUDA_VERSION"
    text: str
    alternatives: tuple[tuple[Constraint, ...], ...]

    def holds(self, facts: Mapping[str, str]) -> bool:
        if not self.alternatives:
            return True
        return any(all(c.holds(facts) for c in group) for group in self.alternatives)

    def explain(self, facts: Mapping[str, str]) -> str:
        """Why this requirement fails for `facts` (call only when holds() is False)."""
        first = self.alternatives[0]
        failed = next(c for c in first if not c.holds(facts))
        msg = f"unsatisfied condition: {failed} (this GPU has {failed.key}={facts[failed.key]})"
        if len(self.alternatives) > 1:
            msg += f"; none of the {len(self.alternatives)} alternatives holds"
        if failed.key == "cuda" and failed.op in (">", ">="):
            msg += "; update the driver or use an image built for an earlier CUDA"
        return msg


class Requirements(Struct, frozen=True, cache_hash=True):
    """All requirements of one container; every one must hold for each granted GPU.

    The selector calls unsatisfied() per granted GPU with facts "cuda" (driver's CUDA version,
    "12.4"), "driver" ("550.54.15"), "arch" (compute capability, "8.0") and "brand"
    ("tesla"), and once with only cuda/driver when the container gets the driver but no
    GPU. A missing or empty fact satisfies its constraints (upstream behaviour).
    """

    items: tuple[Requirement, ...] = ()

    @property
    def chars(self) -> int:
        """The characters of the variables they were parsed from (what a memo keeping
        them is charged: nri_accel.memo)."""
        return sum(len(r.text) for r in self.items)

    def unsatisfied(self, facts: Mapping[str, str]) -> tuple[str, str] | None:
        """(source, reason) of the first requirement `facts` fail, or None."""
        for req in self.items:
            if not req.holds(facts):
                return req.source, req.explain(facts)
        return None


@memoized(1024, 64 * 1024)  # CUDA images repeat the same constraints across alternatives
def _parse_constraint(expr: str, source: str) -> Constraint:
    n = len(expr)
    i = 0
    while i < n and expr[i] not in _OP_CHARS:
        i += 1
    j = i
    while j < n and expr[j] in _OP_CHARS:
        j += 1
    key, op, value = expr[:i].lower(), expr[i:j], expr[j:]
    if not key or not op or not value:
        raise RequestError(f"invalid constraint {expr!r}: expected KEY OP VALUE such as "
                           "cuda>=12.0", source=source)
    if op not in OPERATORS:
        raise RequestError(f"invalid constraint {expr!r}: unknown operator {op!r} "
                           f"(use {' '.join(OPERATORS)})", source=source)
    if key in VERSION_KEYS:
        if not _VERSION_RE.fullmatch(value):
            raise RequestError(f"invalid constraint {expr!r}: {key} takes a dotted version "
                               "number such as 12.4", source=source)
        big = next((c for c in value.split(".") if _overflows(c)), None)
        if big is not None:
            raise RequestError(f"invalid constraint {cut(expr, _SHOWN)!r}: version number "
                               f"{cut(big, _SHOWN)} does not fit in 32 bits "
                               f"(at most {UINT32_MAX})",
                               source=source)
    elif key in STRING_KEYS:
        if op not in ("=", "!="):
            raise RequestError(f"invalid constraint {expr!r}: {key} compares only with "
                               "= or !=", source=source)
        if not _BRAND_RE.fullmatch(value):
            raise RequestError(f"invalid constraint {expr!r}: invalid {key} name",
                               source=source)
    else:
        raise RequestError(f"invalid constraint {expr!r}: unknown key {key!r} "
                           "(known: arch, brand, cuda, driver)", source=source)
    return Constraint(key, op, value)


def _overflows(digits: str) -> bool:
    """Whether a decimal number (no sign) exceeds UINT32_MAX; never converts a long one."""
    digits = digits.lstrip("0")
    return len(digits) > 10 or (len(digits) == 10 and int(digits) > UINT32_MAX)


@memoized(512, 256 * 1024)
def parse_requirement(source: str, text: str) -> Requirement:
    """Parse one NVIDIA_REQUIRE_* value; RequestError(source=source) when malformed."""
    groups = []
    for alternative in text.split(" "):
        constraints = tuple(
            _parse_constraint(expr, source) for expr in alternative.split(",") if expr
        )
        if constraints:
            groups.append(constraints)
    return Requirement(source, text, tuple(groups))


def legacy_cuda_image(env: Mapping[str, str]) -> bool:
    """A pre-NVIDIA_REQUIRE_CUDA image: CUDA_VERSION set, NVIDIA_REQUIRE_CUDA empty."""
    return bool(env.get(CUDA_VERSION)) and not env.get(REQUIRE_CUDA)


MAX_CONSTRAINTS = 512
"""Constraints that one container's NVIDIA_REQUIRE_* variables may write in all. A CUDA
12 image's NVIDIA_REQUIRE_CUDA writes 91 to 124 (cuda>=12.x, and 30 to 41 alternatives
of a brand and a driver branch); the 16 KiB of env nri-accel reads could write over
2,000, each parsed and evaluated (once per set of GPU facts) on the event loop: about
4 ms for each of the two. Counted before any is parsed (requirements_from_env); at the
limit, the parse and an evaluation cost about 1 ms each."""


def disabled(env: Mapping[str, str]) -> bool:
    """NVIDIA_DISABLE_REQUIRE parsed as Go's strconv.ParseBool (invalid means false)."""
    return env.get(DISABLE_REQUIRE, "") in _GO_TRUE


def requirements_from_env(env: Mapping[str, str]) -> Requirements | None:
    """The container's requirements, or None when there are none or they are disabled.

    `env` maps names to values with the last definition winning. Variables are taken in
    name order so the result (and the first failure reported) is deterministic.
    """
    if disabled(env):
        return None
    names = [name for name in sorted(env)
             if name.startswith(REQUIRE_PREFIX) and not name.startswith(REQUIRE_JETPACK)]
    written = 0  # constraints: the pieces between commas and blanks, as parsing splits
    for name in names:
        written += len(env[name].replace(",", " ").split())
        if written > MAX_CONSTRAINTS:  # refused before any is parsed
            raise RequestError(f"the NVIDIA_REQUIRE_* variables write more than "
                               f"{MAX_CONSTRAINTS} constraints in all (a CUDA image "
                               "writes about 100)", source=f"env {name}")
    items = [parse_requirement(f"env {name}", env[name]) for name in names]
    if legacy_cuda_image(env):
        m = _SEMVER_RE.fullmatch(env[CUDA_VERSION])
        if m is None:
            raise RequestError(f"invalid CUDA version {cut(env[CUDA_VERSION], _SHOWN)!r} "
                               "(legacy image without NVIDIA_REQUIRE_CUDA)",
                               source=f"env {CUDA_VERSION}")
        major, minor = m.group(1), m.group(2) or "0"
        for what, number in (("major", major), ("minor", minor)):
            if _overflows(number):
                version = cut(env[CUDA_VERSION], _SHOWN)
                raise RequestError(f"invalid CUDA version {version!r}: the "
                                   f"{what} version does not fit in 32 bits (at most "
                                   f"{UINT32_MAX})", source=f"env {CUDA_VERSION}")
        items.append(parse_requirement(f"env {CUDA_VERSION}", f"cuda>={major}.{minor}"))
    items = [r for r in items if r.alternatives]
    return Requirements(tuple(items)) if items else None
