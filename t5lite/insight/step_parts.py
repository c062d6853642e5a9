"""A compiled train step's collectives by where they come from: the transformer layers, the
logits, the token embedding, the norms, the data-parallel gradient reduction, the rest (loss,
metrics, optimizer).

Each collective instruction is attributed by the `op_name` of its HLO metadata (the Flax module
path JAX records, `.../decoder/layers_0/mlp/wi/...`, `transpose(...)` in the backward pass); an
instruction a compiler pass made without metadata (an all-reduce standing in for a
reduce-scatter, a combined gradient all-reduce) takes its operands' `op_name`. The per-layer
formulas of the papers count only the first part; `tensor_nd` sets the others beside it.
"""

from __future__ import annotations

import collections
import dataclasses
import re

from jax.sharding import Mesh

from t5lite.insight.communication import link_bytes
from t5lite.insight.hlo import collective_ops
from t5lite.partitioning.mesh import DATA

PARTS = ("layers", "logits", "embedding", "norms", "gradients", "rest")

_DEF_RE = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<rest>.*)$")
_META_RE = re.compile(r'op_name="(?P<op>[^"]*)"')
# The operand list: the first `opcode(%a, %b, ...)` of an instruction.
_OPERANDS_RE = re.compile(r"\s[a-z][\w\-]*\((?P<ops>%[^)]*)\)")
_NAME_RE = re.compile(r"%([\w.\-]+)")
_COMPUTATION_RE = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_CALLS_RE = re.compile(r"calls=%?([\w.\-]+)")


@dataclasses.dataclass(frozen=True)
class PartRow:
    """The collectives one part of the step runs: how many, and the bytes a device sends."""

    part: str
    count: int
    link_bytes: float


def _instructions(hlo_text: str) -> dict[str, tuple[str, list[str]]]:
    """name -> (op_name of its metadata or '', operand names), for every instruction; an
    instruction of a called computation (an `all-reduce-scatter` fusion's all-reduce) lists
    the computation as an operand, and the computation its caller."""
    out: dict[str, tuple[str, list[str]]] = {}
    computation = ""
    for line in hlo_text.splitlines():
        header = _COMPUTATION_RE.match(line)
        if header:
            computation = header.group("name")
            continue
        m = _DEF_RE.match(line)
        if m is None:
            continue
        rest = m.group("rest")
        meta = _META_RE.search(rest)
        ops = _OPERANDS_RE.search(rest)
        operands = _NAME_RE.findall(ops.group("ops")) if ops else []
        out[m.group("name")] = (meta.group("op") if meta else "", [*operands, computation])
        for called in _CALLS_RE.findall(rest):
            out.setdefault(called, ("", []))[1].append(m.group("name"))
    return out


def _op_name(name: str, instructions: dict[str, tuple[str, list[str]]]) -> str:
    """The op_name of `name`, else the nearest one among its operands (breadth first)."""
    queue, seen = collections.deque([name]), set()
    while queue:
        current = queue.popleft()
        if current in seen or current not in instructions:
            continue
        seen.add(current)
        op, operands = instructions[current]
        if op:
            return op
        queue.extend(operands)
    return ""


def part_of(op_name: str, kind: str, axes: tuple[str, ...] | None) -> str:
    """Which part of the step a collective with this `op_name` belongs to (one of `PARTS`)."""
    if kind == "all-reduce" and axes and DATA in axes:
        return "gradients"  # the data-parallel reduction of the gradients (and scalars)
    module = re.sub(r"\((\w+)\)", "", op_name)  # `jvp(DecoderOnly)` -> `jvp`
    if "logits_dense" in module or "attend" in module:
        return "logits"
    if "token_embedder" in module:
        return "embedding"
    if re.search(r"norm/", module):
        return "norms"
    if re.search(r"/layers(_\d+)?/", module):
        return "layers"
    return "rest"


def step_parts(hlo_text: str, mesh: Mesh) -> dict[str, PartRow]:
    """Every collective of compiled train-step HLO text, per part (`PARTS` order; parts with
    none are left out): count and bytes each device sends per step (ring algorithms)."""
    instructions = _instructions(hlo_text)
    count: collections.Counter[str] = collections.Counter()
    sent: collections.Counter[str] = collections.Counter()
    for op in collective_ops(hlo_text, mesh):
        c = op.collective
        part = part_of(_op_name(op.name, instructions), c.kind, c.axes)
        count[part] += op.runs
        sent[part] += link_bytes(c) * op.runs
    return {p: PartRow(p, count[p], sent[p]) for p in PARTS if count[p]}
