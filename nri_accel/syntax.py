"""The syntax shared by every request grammar: device claims, id lists, value checks.

Owns: DeviceClaim (devices of one kind that one source names), ClaimSet (the
accumulator that refuses conflicting forms), the checks every user-supplied value goes
through (size, control characters, names shown escaped) and the id-list rules (ids are
names, never paths; ranges such as 0-3). Imports the standard library, msgspec,
nri_accel.errors and nri_accel.inventory (the CDI syntax of kinds and device names, and
vendor_of). Pure: no I/O.

request.py (annotations) and every vendor profile's env grammar build their claims with
these pieces, so a limit, a message or an escape rule is written once.

Every value is text from whoever wrote the pod or image: each is at most MAX_VALUE_BYTES,
control characters are refused (newline only where a grammar uses it as a separator),
an id list names at most MAX_IDS devices (repeats and each id of a range counted, so the
work a value costs is bounded by the limit, not by its length), and every error names its
source, a hostile key or variable name shown escaped and cut.
"""

from __future__ import annotations

import re

from msgspec import Struct

from nri_accel.errors import RequestError
from nri_accel.inventory import DEVICE_NAME_RE, KIND_RE, vendor_of

MAX_VALUE_BYTES = 4096
MAX_IDS = 256
TOO_MANY_IDS = (f"names more than {MAX_IDS} device ids, repeats and each id of a range "
                "counted")
MAX_NAME_CHARS = 253  # longest annotation key or variable name shown as it is in a source
MAX_ID_CHARS = 128
MAX_INDEX_DIGITS = 8  # no node numbers its accelerators past 99,999,999
_DIGITS_RE = re.compile(r"[0-9]+")
_MAX_RANGE_DIGITS = 6
_RANGE_RE = re.compile(r"([0-9]+)-([0-9]+)")
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_CONTROL_EXCEPT_NL_RE = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]")


class DeviceClaim(Struct, frozen=True):
    """Devices of one kind that one source names.

    Exactly one form: `ids` (as written, ranges expanded, duplicates dropped, order
    kept), `count` (N devices the allocator picks) or `all`. A limit with `count` means
    "at most N of the devices granted for that vendor" (inventory.vendor_of: the part of
    the kind before "/", so nvidia.com covers GPUs and MIG devices).
    """

    kind: str  # "nvidia.com/gpu", "aws.amazon.com/neuron", "vendor/class"
    ids: tuple[str, ...] = ()
    count: int | None = None
    all: bool = False
    source: str = ""  # 'annotation devices.nri-accel.io/pod', 'env NVIDIA_VISIBLE_DEVICES'
    cdi: bool = False  # a CDI request (cdi.k8s.io, ...): handed on as a CDI name with passthrough

    @property
    def vendor(self) -> str:
        return vendor_of(self.kind)


def claim_order(c: DeviceClaim) -> tuple[str, str, tuple[str, ...]]:
    """The deterministic order of claims: kind, source, ids."""
    return (c.kind, c.source, c.ids)


def named(what: str, name: str) -> str:
    """The source naming annotation key or variable `name` ("annotation cdi.k8s.io/x").
    Sources are logged and sent back to the runtime: a name longer than MAX_NAME_CHARS,
    or with a character repr() escapes, is shown escaped and cut. Those are the
    unprintable ones (str.isprintable): control characters, and also format characters
    (bidi controls such as U+202E, which reorder the text around them; zero-width ones
    such as U+200B and U+FEFF), line and paragraph separators (U+2028, U+2029) and
    spaces other than " ", which would make a name read as another."""
    if not bad_name(name):
        return f"{what} {name}"
    return f"{what} {name[:64]!r}..."


def bad_name(name: str) -> bool:
    """A key or variable name that named() would have to escape or cut."""
    return len(name) > MAX_NAME_CHARS or not name.isprintable()


def check_text(value: str, source: str, *, newlines: bool = False) -> None:
    """Refuse values over MAX_VALUE_BYTES and control characters (newline only where
    the grammar uses it as a separator)."""
    if len(value) > MAX_VALUE_BYTES or len(value.encode("utf-8", "replace")) > MAX_VALUE_BYTES:
        raise RequestError(f"value is longer than {MAX_VALUE_BYTES} bytes", source=source)
    if (_CONTROL_EXCEPT_NL_RE if newlines else _CONTROL_RE).search(value):
        raise RequestError("control characters are not allowed", source=source)


def check_kind(kind: str, source: str) -> str:
    if not KIND_RE.fullmatch(kind):
        raise RequestError(f"invalid device kind {kind!r}: expected vendor/class such as "
                           "nvidia.com/gpu", source=source)
    return kind


def check_id(ident: str, source: str, extra: re.Pattern[str] | None = None) -> str:
    """A device id: a name in CDI's device-name syntax of at most MAX_ID_CHARS (index,
    UUID, PCI bus id, "0:1", CDI name), or a match of `extra` (a family's own id form,
    such as NVIDIA's legacy MIG-GPU-<uuid>/<gi>/<ci>). Never a path."""
    if not ident:
        raise RequestError("empty device id", source=source)
    if not ((len(ident) <= MAX_ID_CHARS and DEVICE_NAME_RE.fullmatch(ident))
            or (extra is not None and extra.fullmatch(ident))):
        raise RequestError(f"invalid device id {ident!r}: ids are names such as 0, "
                           "GPU-<uuid>, 0:1 or 0000:3b:00.0, never paths", source=source)
    return ident


class ClaimSet:
    """Accumulates one source's claims per kind and refuses conflicting forms, and a
    source naming more than MAX_IDS ids: every id named counts ("all" too), repeats and
    each id of a range included, so that a value repeating ids or ranges costs no more
    than one naming MAX_IDS different ones."""

    def __init__(self, source: str, *, cdi: bool = False) -> None:
        self.source = source
        self.cdi = cdi
        self.ids: dict[str, dict[str, None]] = {}
        self.counts: dict[str, int] = {}
        self.alls: set[str] = set()
        self.n_named = 0

    def add_id(self, kind: str, ident: str) -> None:
        """One id (checked by the caller), or "all"."""
        self._name(1)
        if ident == "all":
            if self.ids.get(kind) or kind in self.counts:
                self._conflict(kind)
            self.alls.add(kind)
        else:
            self._ids_of(kind)[ident] = None  # a repeat keeps its first place

    def add_ids(self, kind: str, token: str, extra: re.Pattern[str] | None = None) -> None:
        """An id, "all", or a range "first-last" of indices (at most MAX_IDS of them),
        counted before it is expanded."""
        m = _RANGE_RE.fullmatch(token)
        if m is None:
            self.add_id(kind, token if token == "all" else check_id(token, self.source, extra))
            return
        if max(len(m.group(1)), len(m.group(2))) > _MAX_RANGE_DIGITS:
            raise RequestError(f"range {token[:32]!r} is too large", source=self.source)
        first, last = int(m.group(1)), int(m.group(2))
        if first > last:
            raise RequestError(f"reversed range {token!r}", source=self.source)
        if last - first >= MAX_IDS:
            raise RequestError(f"range {token!r} names more than {MAX_IDS} devices",
                               source=self.source)
        self._name(last - first + 1)
        self._ids_of(kind).update(dict.fromkeys(map(str, range(first, last + 1))))

    def _name(self, n: int) -> None:
        """Count `n` more ids named; refuse the source past MAX_IDS."""
        self.n_named += n
        if self.n_named > MAX_IDS:
            raise RequestError(TOO_MANY_IDS, source=self.source)

    def _ids_of(self, kind: str) -> dict[str, None]:
        if kind in self.alls or kind in self.counts:
            self._conflict(kind)
        return self.ids.setdefault(kind, {})

    def add_count(self, kind: str, count: int) -> None:
        if self.ids.get(kind) or kind in self.alls or self.counts.get(kind, count) != count:
            self._conflict(kind)
        self.counts[kind] = count

    def _conflict(self, kind: str) -> None:
        raise RequestError(f"{kind} is requested in conflicting forms (ids, 'all' and a "
                           "count exclude each other)", source=self.source)

    def claims(self) -> tuple[DeviceClaim, ...]:
        out = [DeviceClaim(k, ids=tuple(v), source=self.source, cdi=self.cdi)
               for k, v in self.ids.items()]
        out += [DeviceClaim(k, count=n, source=self.source) for k, n in self.counts.items()]
        out += [DeviceClaim(k, all=True, source=self.source, cdi=self.cdi) for k in self.alls]
        return tuple(sorted(out, key=claim_order))


def decimal_index(token: str, what: str) -> str:
    """A device index as written in an env value, canonical ("07" -> "7"); ValueError
    naming `what` when it is not one."""
    if not _DIGITS_RE.fullmatch(token):
        raise ValueError(f"{what} {token!r} is not a device index (decimal digits)")
    if len(token.lstrip("0")) > MAX_INDEX_DIGITS:
        raise ValueError(f"{what} {token!r} is out of range")
    return str(int(token))
