"""Collectives in compiled HLO text: what kind, how many bytes, over which mesh axes."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import re

import numpy as np
from jax.sharding import Mesh

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

_DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}

# `%name = <result shape> <op>(` where op may carry an async `-start` suffix; `-done` halves of
# async pairs are skipped so each collective counts once.
_OP_RE = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.+?)\s+"
    r"(?P<op>all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\("
)
_ARRAY_RE = re.compile(r"\b(pred|[suf]\d+|bf16|f8e4m3fn|f8e5m2|c64|c128)\[([\d,]*)\]")
_GROUPS_RE = re.compile(r"replica_groups=(\{[\{\}\d, ]*\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)")
# Newer XLA writes groups over a named mesh: `replica_groups=mesh['axis_0'=2,'axis_1'=2],
# device_ids=([2,2]T(1,0)) {'axis_0'}`: devices (iota, optionally transposed) laid out on the
# mesh; each group varies over the braced axes with the others fixed.
_MESH_GROUPS_RE = re.compile(
    r"replica_groups=mesh\[(?P<axes>[^\]]*)\]"
    r"(?:,\s*device_ids=\((?P<ids>[^)]*\)?)\))?"
    r"(?:\s*\{(?P<over>[^}]*)\})?"
)
_PAIRS_RE = re.compile(r"source_target_pairs=\{([\{\}\d, ]*)\}")
# A computation's header: `%name (params...) -> result {` at the start of a line (`ENTRY` first
# for the entry computation). XLA:TPU fuses FSDP's all-reduce + dynamic-slice to the device's
# shard into a fusion whose computation is named `all-reduce-scatter.N`
# (tests/test_layouts_tpu.py): the all-reduce inside it is a reduce-scatter whose results are
# the fusion's (the shards).
_COMPUTATION_RE = re.compile(
    r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*\(.*\)\s*->\s*(?P<result>.*)\{\s*$"
)


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective op of a compiled program."""

    kind: str  # one of KINDS
    bytes: int  # size of its result (for async starts: of the arrays it produces)
    axes: tuple[str, ...] | None  # mesh axes it communicates over; None if not identifiable
    groups: tuple[tuple[int, ...], ...]

    @property
    def group_size(self) -> int:
        """Devices taking part together (for a collective-permute: 2, a sender and receiver)."""
        return max((len(g) for g in self.groups), default=1)


@dataclasses.dataclass(frozen=True)
class CollectiveRow:
    """All collectives of one kind over the same mesh axes (`communication.collective_rows`
    groups them)."""

    kind: str
    axes: tuple[str, ...] | None
    count: int
    bytes: int  # sum of their result sizes per device
    link_bytes: float  # bytes each device sends over its links (ring algorithms)

    @property
    def axes_str(self) -> str:
        return "?" if self.axes is None else ("+".join(self.axes) or "-")


def _result_bytes(shape_text: str, kind: str) -> int:
    arrays = [
        math.prod(int(d) for d in dims.split(",") if d) * _DTYPE_BYTES[dt]
        for dt, dims in _ARRAY_RE.findall(shape_text)
    ]
    if not arrays:
        return 0
    # An async start returns (operands..., results...) tuples; the results are the second half.
    if shape_text.lstrip().startswith("(") and kind in ("all-gather", "collective-permute"):
        return sum(arrays[len(arrays) // 2 :]) if len(arrays) > 1 else arrays[0]
    return sum(arrays)


def _parse_groups(text: str) -> tuple[tuple[int, ...], ...]:
    if text.startswith("["):  # iota form: [G,S]<=[dims]T(perm)
        m = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
        assert m is not None
        out_shape = [int(x) for x in m.group(1).split(",")]
        dims = [int(x) for x in m.group(2).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        return tuple(tuple(int(i) for i in row) for row in ids.reshape(out_shape))
    return tuple(
        tuple(int(i) for i in g.split(",") if i.strip())
        for g in re.findall(r"\{([\d, ]*)\}", text)
        if g.strip()
    )


def _iota(text: str) -> np.ndarray:
    """`[dims]T(perm)` or `[n]` -> the flat device ids it denotes."""
    m = re.match(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", text.strip())
    if not m:
        return np.asarray([int(i) for i in re.findall(r"\d+", text)])
    ids = np.arange(math.prod(int(x) for x in m.group(1).split(","))).reshape(
        [int(x) for x in m.group(1).split(",")]
    )
    if m.group(2):
        ids = ids.transpose([int(x) for x in m.group(2).split(",")])
    return ids.reshape(-1)


def _parse_mesh_groups(m: re.Match) -> tuple[tuple[int, ...], ...]:
    named = re.findall(r"'([^']+)'=(\d+)", m.group("axes"))
    names, sizes = [n for n, _ in named], [int(s) for _, s in named]
    ids = _iota(m.group("ids")) if m.group("ids") else np.arange(math.prod(sizes))
    ids = ids.reshape(sizes)
    over = re.findall(r"'([^']+)'", m.group("over") or "")
    if not over:  # no axes named: one group of every device
        return (tuple(int(i) for i in ids.reshape(-1)),)
    keep = [names.index(a) for a in over]
    rest = [i for i in range(len(names)) if i not in keep]
    rows = ids.transpose(rest + keep).reshape(-1, math.prod(sizes[k] for k in keep))
    return tuple(tuple(int(i) for i in row) for row in rows)


def _axis_groups(mesh_shape: dict[str, int], axes: tuple[str, ...]) -> frozenset:
    """Device groups (by flat mesh position) that vary over `axes` with the other axes fixed."""
    names = list(mesh_shape)
    ids = np.arange(math.prod(mesh_shape.values())).reshape(list(mesh_shape.values()))
    keep = [names.index(a) for a in axes]
    rest = [i for i in range(len(names)) if i not in keep]
    moved = ids.transpose(rest + keep).reshape(-1, math.prod(mesh_shape[a] for a in axes))
    return frozenset(frozenset(int(i) for i in row) for row in moved)


def _coords(mesh_shape: dict[str, int]) -> np.ndarray:
    """[device position, mesh axis] -> coordinate of that device along that axis."""
    return np.stack(
        np.unravel_index(np.arange(math.prod(mesh_shape.values())), tuple(mesh_shape.values())),
        axis=1,
    )


def _identify_axes(
    groups: tuple[tuple[int, ...], ...], mesh: Mesh | None, pairs: bool = False
) -> tuple[str, ...] | None:
    """The mesh axes a collective's groups span, e.g. ('model',) or ('data', 'model').

    Groups that are exactly a product of mesh axes get those axes' names. Groups that vary over
    an axis but hold only part of it (XLA splitting an axis, e.g. 2 of model=4) get the name with
    the part, e.g. 'model/2'. A collective-permute's source-target pairs get the axes along which
    a device and its peer differ. None only without a mesh (or with ids outside it).
    """
    if mesh is None or not groups:
        return None
    if all(len(g) == 1 for g in groups):
        return ()  # every device alone: nothing crosses a link
    shape = {k: v for k, v in mesh.shape.items()}
    coords = _coords(shape)
    if any(i >= len(coords) for g in groups for i in g):
        return None
    want = frozenset(frozenset(g) for g in groups)
    names = list(shape)
    varying = [
        n for j, n in enumerate(names) if any(len({coords[i][j] for i in g}) > 1 for g in groups)
    ]
    if pairs or _axis_groups(shape, tuple(varying)) == want:
        return tuple(varying)  # a permute's pairs: the axes a device and its peer differ on
    # Part of an axis (or of several): name each varying axis with how many of its devices a
    # group spans along it.
    out = []
    for n in varying:
        j = names.index(n)
        span = max(len({coords[i][j] for i in g}) for g in groups)
        out.append(n if span == shape[n] else f"{n}/{span}")
    return tuple(out)


# A while loop's body and its trip count (XLA records it for loops it can analyse, such as a
# scanned layer stack's: `backend_config={..."known_trip_count":{"n":"8"}}`).
_WHILE_RE = re.compile(r"\swhile\(.*\bbody=%?(?P<body>[\w.\-]+)")
_TRIP_RE = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
# Other computations an op runs once per execution: a call's or fusion's (a collective can sit
# in a fusion, e.g. XLA:TPU's `all-reduce-scatter`) and a conditional's branches (at most one
# of them runs: counting each once is an upper bound).
_CALLS_RE = re.compile(
    r"\b(?P<how>calls|branch_computations)=\{?(?P<names>%?[\w.\-]+(?:,\s*%?[\w.\-]+)*)"
)


def executions(hlo_text: str, branch_share: float = 1.0) -> dict[str, int]:
    """How many times each computation of compiled HLO text runs per execution of the entry
    computation: a while loop's body runs its known trip count times per run of the loop (1
    where XLA recorded none), a called computation as often as its caller, and a conditional's
    branch `branch_share` times as often (which branch runs is data, not HLO: 1 counts every
    branch each time; a caller that knows the program's schedule gives the share it takes)."""
    callees: dict[str, list[tuple[str, float]]] = {}
    order: list[str] = []
    entry = None
    current = None
    for line in hlo_text.splitlines():
        header = _COMPUTATION_RE.match(line)
        if header:
            current = header.group("name")
            order.append(current)
            callees[current] = []
            if line.startswith("ENTRY"):
                entry = current
            continue
        if current is None:
            continue
        w = _WHILE_RE.search(line)
        if w:
            trip = _TRIP_RE.search(line)
            callees[current].append((w.group("body"), int(trip.group(1)) if trip else 1))
        for c in _CALLS_RE.finditer(line):
            share = branch_share if c.group("how") == "branch_computations" else 1
            names = c.group("names").split(",")
            callees[current] += [(n.strip().lstrip("%"), share) for n in names]
    runs: dict[str, float] = dict.fromkeys(order, 0)
    if entry is None:  # a bare computation (tests): every op runs once
        return dict.fromkeys(order, 1)
    runs[entry] = 1
    # XLA prints callees before their callers, so the reverse order visits every caller of a
    # computation before the computation itself.
    for name in reversed(order):
        for callee, n in callees[name]:
            if callee in runs:
                runs[callee] += runs[name] * n
    # A computation no edge above reaches (called through an attribute not parsed here, or HLO
    # cut short) counts once rather than vanishing.
    return {name: round(n) if n else 1 for name, n in runs.items()}


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
    """One collective instruction of compiled HLO text and how often one step runs it."""

    name: str  # the instruction's name, e.g. `all-reduce.12`
    collective: Collective
    runs: int  # its computation's executions per step (`executions`)


# Between slices (a multi-slice topology) XLA:TPU compiles a collective to the DCN runtime's
# host transfers: a `send` (and its `recv`) whose attributes name the transfer; the send's first
# operand is this device's buffer. Its peers are the devices at the same place in the other
# slices.
_MEGASCALE_RE = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.+?)\s+send\(.*"
    r'_xla_megascale_transfer_type="(?P<type>\w+)"'
)
_MEGASCALE_KINDS = {
    "ALL_REDUCE": "all-reduce",
    "ALL_GATHER": "all-gather",
    "REDUCE_SCATTER": "reduce-scatter",
    "ALL_TO_ALL": "all-to-all",
    "ONE_TO_ONE": "collective-permute",
}


def device_slices(devices: np.ndarray) -> np.ndarray:
    """Each device's slice (its `slice_index`, 0 where it has none), shaped as `devices`."""
    return np.vectorize(lambda d: getattr(d, "slice_index", 0) or 0, otypes=[int])(devices)


def axes_along(mesh: Mesh, ids: np.ndarray) -> tuple[str, ...]:
    """The mesh axes along which `ids` (shaped as the mesh) change."""
    return tuple(
        name
        for i, name in enumerate(mesh.axis_names)
        if ids.shape[i] > 1 and bool(np.any(np.diff(ids, axis=i) != 0))
    )


def _megascale(m: re.Match, mesh: Mesh | None) -> Collective:
    """A DCN transfer as the collective it implements, over the mesh axes that cross slices."""
    kind = _MEGASCALE_KINDS.get(m.group("type"), "all-reduce")
    arrays = [
        math.prod(int(d) for d in dims.split(",") if d) * _DTYPE_BYTES[t]
        for t, dims in _ARRAY_RE.findall(m.group("shape"))
    ]
    sent = arrays[0] if arrays else 0
    if mesh is None:
        return Collective(kind, sent, None, ())
    axes = axes_along(mesh, device_slices(mesh.devices))
    shape = dict(mesh.shape)
    groups = tuple(tuple(sorted(g)) for g in _axis_groups(shape, axes)) if axes else ()
    n = math.prod(shape[a] for a in axes) if axes else 1
    size = {"all-gather": sent * n, "reduce-scatter": sent // max(n, 1)}.get(kind, sent)
    if kind == "collective-permute":  # a pair: this device and its peer in the other slice
        groups = tuple(p for g in groups for p in itertools.pairwise(g))
    return Collective(kind, size, axes, groups)


def collective_ops(
    hlo_text: str, mesh: Mesh | None = None, branch_share: float = 1.0
) -> list[CollectiveOp]:
    """Every collective instruction in compiled HLO text, in text order, with bytes, (given
    the mesh) mesh axes, and runs per step (`executions`, with its `branch_share`). Group ids
    in SPMD-partitioned HLO are positions in `mesh.devices.flat`."""
    runs = executions(hlo_text, branch_share)
    out = []
    repeat = 1
    fused_result: str | None = None  # inside an `all-reduce-scatter` fusion: its result shape
    for line in hlo_text.splitlines():
        header = _COMPUTATION_RE.match(line)
        if header:
            fusion = header.group("name").startswith("all-reduce-scatter")
            fused_result = header.group("result") if fusion else None
            repeat = runs.get(header.group("name"), 1)
            continue
        m = _OP_RE.match(line)
        if not m:
            dcn = _MEGASCALE_RE.match(line)
            if dcn:
                out.append(CollectiveOp(dcn.group("name"), _megascale(dcn, mesh), repeat))
            continue
        kind, shape = m.group("op"), m.group("shape")
        if fused_result is not None and kind == "all-reduce":
            kind, shape = "reduce-scatter", fused_result
        groups: tuple[tuple[int, ...], ...] = ()
        g = _GROUPS_RE.search(line)
        mg = _MESH_GROUPS_RE.search(line)
        if mg:
            groups = _parse_mesh_groups(mg)
        elif g:
            groups = _parse_groups(g.group(1))
        elif kind == "collective-permute":
            p = _PAIRS_RE.search(line)
            if p:
                groups = tuple(
                    tuple(int(i) for i in pair.split(","))
                    for pair in re.findall(r"\{(\d+,\d+)\}", "{" + p.group(1) + "}")
                )
        if not groups and mesh is not None and kind != "collective-permute":
            groups = (tuple(range(mesh.devices.size)),)  # `replica_groups={}`: all devices
        axes = _identify_axes(groups, mesh, pairs=kind == "collective-permute")
        c = Collective(kind, _result_bytes(shape, kind), axes, groups)
        out.append(CollectiveOp(m.group("name"), c, repeat))
    return out


def parse_collectives(
    hlo_text: str, mesh: Mesh | None = None, branch_share: float = 1.0
) -> list[Collective]:
    """Every collective one step runs, with bytes and (given the mesh) mesh axes.

    One entry per execution: a collective in a loop body (a scanned layer stack's, or the
    microbatch loop's) appears once per iteration, so counts and bytes are what a step sends;
    one in a conditional's branch `branch_share` times per run of the conditional.
    """
    ops = collective_ops(hlo_text, mesh, branch_share)
    return [op.collective for op in ops for _ in range(op.runs)]


def count_collectives(hlo_text: str, mesh: Mesh | None = None) -> dict[str, int]:
    """Number of collectives of each kind (kinds with none are present with 0)."""
    counts = collections.Counter(c.kind for c in parse_collectives(hlo_text, mesh))
    return {k: counts.get(k, 0) for k in KINDS}


def count_collectives_by_axes(
    hlo_text: str, mesh: Mesh
) -> dict[tuple[str, tuple[str, ...] | None], int]:
    """Counts keyed by (kind, mesh axes)."""
    return dict(collections.Counter((c.kind, c.axes) for c in parse_collectives(hlo_text, mesh)))


# `%name = <array shape> <op>(`: an instruction's result shape, and its operands after the `(`.
_INSTRUCTION_RE = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>\w+\[[\d,]*\])\S*\s+(?P<op>[\w\-]+)\("
    r"(?P<args>.*)$"
)
_HEADER_PARAM_RE = re.compile(r"%?([\w.\-]+):\s*(\w+\[[\d,]*\])")


def _dims(shape_text: str) -> list[int]:
    return [int(d) for d in shape_text[shape_text.index("[") + 1 : -1].split(",") if d]


def dot_flops(hlo_text: str, min_runs: int = 1) -> int:
    """Multiply-add FLOPs (2 per product) of the `dot`s in compiled HLO text, fused ones
    included, each times its computation's executions per step (`executions`: loop bodies by
    trip count; a conditional's branches each once, an upper bound). `min_runs=2` counts only
    the dots inside loops (a scanned layer stack's, a pipeline's ticks)."""
    runs = executions(hlo_text)
    shapes: dict[str, str] = {}
    dots: list[tuple[str, str, str]] = []  # (computation, result shape, operands and attributes)
    current = None
    for line in hlo_text.splitlines():
        header = _COMPUTATION_RE.match(line)
        if header:
            current = header.group("name")
            shapes.update(_HEADER_PARAM_RE.findall(line.split("->")[0]))
            continue
        m = _INSTRUCTION_RE.match(line)
        if m:
            shapes[m.group("name")] = m.group("shape")
            if m.group("op") == "dot" and current is not None:
                dots.append((current, m.group("shape"), m.group("args")))
    total = 0
    for computation, shape, args in dots:
        n = runs.get(computation, 1)
        if n < min_runs:
            continue
        lhs = _dims(shapes[args.split(",")[0].strip().lstrip("%")])
        contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", args)
        k = (
            math.prod(lhs[int(i)] for i in contracting.group(1).split(",") if i)
            if contracting
            else 1
        )
        total += 2 * math.prod(_dims(shape)) * k * n
    return total
