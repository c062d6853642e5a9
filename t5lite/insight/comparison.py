"""The compiled collectives against the analytic model, per mesh axis: what matches, what the
compiler chose instead (a named choice), and the report's table of it."""

from __future__ import annotations

import dataclasses
import itertools
import math
import textwrap
from collections.abc import Sequence

from t5lite.insight.communication import (
    AnalyticCommunication,
    CompilerChoice,
    ExpectedCollective,
    link_bytes,
)
from t5lite.insight.hlo import KINDS, Collective, CollectiveRow
from t5lite.insight.sharding import format_bytes


@dataclasses.dataclass(frozen=True)
class AxisComparison:
    """Compiled against analytic link bytes over one set of mesh axes, and why they differ.

    `explained` is the analytic figure after the compiler choices named in `differences`
    (those of `AnalyticCommunication.choices` that bring it closest to the compiled figure);
    any remaining gap is named kind by kind. `kinds`: per kind, (kind, compiled count, compiled
    result bytes, explained count, explained result bytes).
    """

    axes: tuple[str, ...]
    compiled: float
    analytic: float
    explained: float
    differences: tuple[str, ...]
    notes: tuple[str, ...] = ()  # analytic context printed under the row (2D TP formulas)
    kinds: tuple[tuple[str, int, int, int, int], ...] = ()

    @property
    def ratio(self) -> float:
        return self.compiled / self.explained if self.explained else math.inf

    @property
    def agrees(self) -> bool:
        return abs(self.ratio - 1) <= 0.10 if self.explained else self.compiled == 0


def compare_communication(
    rows: Sequence[CollectiveRow], analytic: AnalyticCommunication
) -> list[AxisComparison]:
    """Per mesh axes: compiled vs analytic link bytes, each difference named."""
    axes_sets = dict.fromkeys(
        [tuple(e.axes) for e in analytic.expected]
        + [tuple(c.axes) for c in analytic.choices if c.kinds]
        + [r.axes for r in rows if r.axes and r.link_bytes > 0]
    )
    out = []
    for axes in axes_sets:
        mine = [r for r in rows if r.axes is not None and set(r.axes) == set(axes)]
        exp = [e for e in analytic.expected if set(e.axes) == set(axes)]
        compiled = sum(r.link_bytes for r in mine)
        expected = sum(e.link_bytes for e in exp)
        if not mine and not exp:
            continue  # a choice the compiler did not make, over axes nothing else uses
        choices = [c for c in analytic.choices if set(c.axes) == set(axes)]
        best = _best_choices(mine, exp, choices, compiled, expected)
        kinds = _kinds(mine, exp, best[1])
        names = [c.name for c in best[1]]
        if abs(compiled - best[0]) > 0.10 * max(best[0], 1):
            names += _kind_deltas(mine, exp, best[1])
        notes = (
            analytic.layer_formulas
            if analytic.layer_formulas and axes == _formula_axes(analytic)
            else ()
        )
        out.append(AxisComparison(axes, compiled, expected, best[0], tuple(names), notes, kinds))
    return out


def _best_choices(
    rows: Sequence[CollectiveRow],
    expected: Sequence[ExpectedCollective],
    choices: Sequence[CompilerChoice],
    compiled: float,
    analytic: float,
) -> tuple[float, list[CompilerChoice]]:
    """The choices whose bytes sent come closest to the compiled figure (within 1% of the
    analytic one counts as as close); among those, the ones whose collective counts per kind
    match the compiled counts best (a choice worth a few KiB, like norm scales' gradients
    all-reduced, still accounts for dozens of collectives), then the fewest."""
    subsets = [list(s) for k in range(len(choices) + 1) for s in itertools.combinations(choices, k)]
    sent = [analytic + sum(c.link_bytes for c in s) for s in subsets]
    closest = min(abs(v - compiled) for v in sent)
    near = [i for i, v in enumerate(sent) if abs(v - compiled) <= closest + 0.01 * max(analytic, 1)]

    def count_gap(i: int) -> int:
        return sum(abs(k[1] - k[3]) for k in _kinds(rows, expected, subsets[i]))

    i = min(near, key=lambda i: (count_gap(i), len(subsets[i])))
    return sent[i], subsets[i]


def _formula_axes(analytic: AnalyticCommunication) -> tuple[str, ...] | None:
    """The mesh axes whose row carries the per-layer formulas: the last ones compared."""
    axes = [tuple(e.axes) for e in analytic.expected]
    return axes[-1] if axes else None


def _tally(rows, expected, chosen, link: bool) -> dict[str, list]:
    """Per kind: [compiled count, compiled bytes, explained count, explained bytes] (expected
    plus the chosen compiler choices' changes); bytes sent over links with `link`, else result
    bytes."""
    by_kind: dict[str, list] = {k: [0, 0, 0, 0] for k in KINDS}
    for r in rows:
        by_kind[r.kind][0] += r.count
        by_kind[r.kind][1] += r.link_bytes if link else r.bytes
    for e in expected:
        by_kind[e.kind][2] += e.count
        by_kind[e.kind][3] += e.link_bytes if link else e.bytes
    for c in chosen:
        for kind, n, b in c.kinds:
            if link:
                size = _choice_group_size(c.axes, expected)
                b = link_bytes(Collective(kind, b, c.axes, (tuple(range(size)),)))
            by_kind[kind][2] += n
            by_kind[kind][3] += b
    return by_kind


def _kinds(rows, expected, chosen) -> tuple[tuple[str, int, int, int, int], ...]:
    """Per kind present: compiled count and result bytes, explained count and result bytes
    (expected plus the chosen compiler choices' changes)."""
    by_kind = _tally(rows, expected, chosen, link=False)
    return tuple((k, *v) for k, v in by_kind.items() if any(v))


def _kind_deltas(
    rows: Sequence[CollectiveRow],
    expected: Sequence[ExpectedCollective],
    chosen: Sequence[CompilerChoice] = (),
) -> list[str]:
    """What remains unexplained, kind by kind: compiled count and bytes against expected (after
    the chosen compiler choices)."""
    by_kind = _tally(rows, expected, chosen, link=True)
    return [
        f"{kind}: {n} compiled ({format_bytes(link)} sent) vs {m} expected ({format_bytes(want)})"
        for kind, (n, link, m, want) in by_kind.items()
        if (n or m) and abs(link - want) > 0.10 * max(want, 1)
    ]


def _choice_group_size(axes: Sequence[str], expected: Sequence[ExpectedCollective]) -> int:
    """Devices in a group of a collective over `axes`: as the expected ones over them, else
    from a part-axis name (`data/2`: 2); a permute's link bytes do not depend on it."""
    if expected:
        return expected[0].group_size
    return math.prod(int(a.split("/")[1]) if "/" in a else 2 for a in axes)


def format_comparison(comparisons: Sequence[AxisComparison], width: int | None = None) -> list[str]:
    """Lines for a report: per mesh axes, compiled vs analytic bytes sent and why they differ
    (each reason wrapped at `width` columns)."""
    lines = ["  mesh axes      compiled     analytic    explained  ratio"]
    for c in comparisons:
        verdict = "agrees" if c.agrees else "differs"
        lines.append(
            f"  {'+'.join(c.axes) or '-':<12}{format_bytes(c.compiled):>11}"
            f"{format_bytes(c.analytic):>13}{format_bytes(c.explained):>13}"
            f"  {c.ratio:5.2f}  {verdict}"
        )
        for d in c.differences:
            lines += (
                textwrap.wrap(d, width, initial_indent="      - ", subsequent_indent=" " * 8)
                if width
                else [f"      - {d}"]
            )
        lines += list(c.notes)
    return lines
