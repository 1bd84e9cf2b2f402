"""Finding where a JSON value ends in text that may still be growing: the parsers need to know
whether `{"a": 1` is a whole value, a value cut short (wait for more), or not JSON at all."""

from __future__ import annotations

import json
from dataclasses import dataclass

_WS = " \t\n\r"
_LITERALS = ("true", "false", "null")


@dataclass(frozen=True, slots=True)
class Scan:
    """`end`: where the value ends (complete), or len(text) when it runs off the end (partial);
    `ok`: False when the text is not JSON (a fallback to content)."""

    end: int
    complete: bool
    ok: bool = True


def skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WS:
        pos += 1
    return pos


def scan_value(text: str, pos: int) -> Scan:
    """Scan one JSON value from `pos` (no leading whitespace skipped)."""
    n = len(text)
    if pos >= n:
        return Scan(n, False)
    c = text[pos]
    if c == '"':
        return _scan_string(text, pos)
    if c in "{[":
        return _scan_container(text, pos)
    if c in "-0123456789":
        end = pos + 1
        while end < n and text[end] in "0123456789.eE+-":
            end += 1
        if end == n:
            return Scan(n, False)
        return Scan(end, True, _loads_ok(text[pos:end]))
    for lit in _LITERALS:
        tail = text[pos : pos + len(lit)]
        if lit.startswith(tail):
            return Scan(n, False) if len(tail) < len(lit) else Scan(pos + len(lit), True)
    return Scan(pos, False, False)


def _loads_ok(s: str) -> bool:
    try:
        json.loads(s)
    except ValueError:
        return False
    return True


def _scan_string(text: str, pos: int) -> Scan:
    i, n = pos + 1, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return Scan(i + 1, True)
        if c < " ":
            return Scan(i, False, False)
        i += 1
    return Scan(n, False)


def _scan_container(text: str, pos: int) -> Scan:
    """Brackets and strings only; the whole value is checked with json.loads once it closes."""
    stack, i, n = [], pos, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            s = _scan_string(text, i)
            if not s.ok:
                return s
            if not s.complete:
                return Scan(n, False)
            i = s.end
            continue
        if c in "{[":
            stack.append("}" if c == "{" else "]")
        elif c in "}]":
            if not stack or stack.pop() != c:
                return Scan(i, False, False)
            if not stack:
                return Scan(i + 1, True, _loads_ok(text[pos : i + 1]))
        elif c not in _WS and c not in ",:-+.0123456789eEtrufalsn":
            return Scan(i, False, False)
        i += 1
    return Scan(n, False)


def partial_string(text: str, pos: int) -> tuple[str, bool] | None:
    """The decoded prefix of the JSON string at `pos` (an escape cut short held back), and
    whether it closed; None if there is no string there."""
    if pos >= len(text) or text[pos] != '"':
        return None
    s = _scan_string(text, pos)
    if not s.ok:
        return None
    if s.complete:
        return json.loads(text[pos : s.end]), True
    body = text[pos + 1 :]
    for cut in range(len(body), max(len(body) - 6, -1), -1):  # an escape is at most \uXXXX
        try:
            return json.loads('"' + body[:cut] + '"'), False
        except ValueError:
            continue
    return "", False
