"""Status codes and the exception root of the ttrpc library.

Owns: Code (the gRPC status codes ttrpc carries in its Response) and TtrpcError,
the one exception this library raises on purpose. Imports only the standard library.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any


class Code(enum.IntEnum):
    """gRPC status codes (google.golang.org/grpc/codes), as ttrpc puts them on the wire."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class TtrpcError(Exception):
    """A call failed with a non-OK status, or a message could not be sent or accepted.

    `code` is always a Code (a status number this library does not know arrives as
    UNKNOWN, its number kept in the message); `message` is the human-readable text;
    `details` are the status' google.protobuf.Any messages, passed through untouched.
    A handler raises it to answer with that status; a caller catches it.
    """

    def __init__(self, code: Code | int, message: str, *, details: Sequence[Any] = ()) -> None:
        self.code, self.message = known_code(code, message)
        self.details = tuple(details)
        super().__init__(f"{self.code.name}: {self.message}")


_CODES = frozenset(int(c) for c in Code)


def known_code(code: int, message: str) -> tuple[Code, str]:
    """(code, message) as a Code: a number outside Code becomes UNKNOWN, noted in the message."""
    if code in _CODES:
        return Code(code), message
    return Code.UNKNOWN, f"{message} (status code {code})"
