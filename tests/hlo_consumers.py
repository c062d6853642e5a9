"""Instructions of compiled HLO text by name: collectives of a kind and their result shapes
(test helper)."""

from __future__ import annotations

import re

from t5lite.insight.hlo import _ARRAY_RE

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
