"""The id rule the router applies to conversation ids, checked before a call so a bad id fails at once.

The SDK does not import server code, so the rule is written here too; tests/sdk/test_ids.py keeps the
two equal.
"""

from __future__ import annotations

import re

MAX_ID_LENGTH = 128
# fullmatch, not match: "$" also matches before a trailing newline, which let "id\n" through.
_ID_PATTERN = re.compile(r"[A-Za-z0-9._:-]+")


def check_id(kind: str, value: str) -> str | None:
    """None when ``value`` is a valid id, else a message saying what is wrong."""
    if not value:
        return f"{kind} is required"
    if len(value) > MAX_ID_LENGTH:
        return f"{kind} is {len(value)} characters long; at most {MAX_ID_LENGTH} are allowed"
    if not _ID_PATTERN.fullmatch(value):
        return f"{kind} {value[:40]!r} has characters outside [A-Za-z0-9._:-]"
    return None
