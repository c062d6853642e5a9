"""Instructions of compiled HLO text by name: collectives of a kind and their result shapes
(test helper)."""

from __future__ import annotations

import re

from t5lite.insight.hlo import _ARRAY_RE, _OP_RE

_DEF_RE = re.compile(
    r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.+?)\s+(?P<op>[\w\-]+)\("
)


def shapes(text: str) -> list[tuple[int, ...]]:
    return [tuple(int(d) for d in dims.split(",") if d) for _, dims in _ARRAY_RE.findall(text)]


def definitions(hlo_text: str) -> dict[str, tuple[str, str, str]]:
    """name -> (op, result shape text, whole line) for every instruction."""
    out = {}
    for line in hlo_text.splitlines():
        m = _DEF_RE.match(line)
        if m:
            out[m.group("name")] = (m.group("op"), m.group("shape"), line)
    return out


def collective_names(hlo_text: str, kind: str) -> list[str]:
    """Names of the collectives of one kind (async starts included)."""
    out = []
    for line in hlo_text.splitlines():
        m, d = _OP_RE.match(line), _DEF_RE.match(line)
        if m and d and m.group("op") == kind:
            out.append(d.group("name"))
    return out
