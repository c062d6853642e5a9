"""Who consumes a collective's result in compiled HLO text (test helper).

XLA:CPU has no reduce-scatter creator: the partitioner's reduce-scatter stays an all-reduce whose
every use is a slice to this device's shard (often fused with its consumer). These helpers find
those uses, so a test can tell a reduce-scatter spelled that way from an all-reduce whose whole
sum is used.
"""

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


def users(hlo_text: str, name: str) -> list[str]:
    """Names of the instructions that take `%name` as an operand."""
    pat = re.compile(rf"%{re.escape(name)}(?=[,)\s])")
    out = []
    for line in hlo_text.splitlines():
        m = _DEF_RE.match(line)
        if m and m.group("name") != name and pat.search(line.split("=", 1)[1]):
            out.append(m.group("name"))
    return out


def final_uses(hlo_text: str, name: str, defs: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(op, first result shape) of each use of `name`, looking through get-tuple-element."""
    out = []
    for u in users(hlo_text, name):
        op, shape, _ = defs[u]
        if op in ("get-tuple-element", "bitcast"):
            out += final_uses(hlo_text, u, defs)
        else:
            found = shapes(shape)
            out.append((op, found[0] if found else ()))
    return out


def collective_names(hlo_text: str, kind: str) -> list[str]:
    """Names of the collectives of one kind (async starts included)."""
    out = []
    for line in hlo_text.splitlines():
        m, d = _OP_RE.match(line), _DEF_RE.match(line)
        if m and d and m.group("op") == kind:
            out.append(d.group("name"))
    return out
