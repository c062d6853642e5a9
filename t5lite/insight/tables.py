"""Plain-text tables a person reads: natural order, repeated layers folded, terminal width."""

from __future__ import annotations

import re
import shutil
from collections.abc import Sequence

DEFAULT_WIDTH = 100  # columns; `--wide` lifts the limit

_LAYER_RE = re.compile(r"(?<![^/])(layers_)(\d+)(?=/|$)")


def terminal_width() -> int:
    """The terminal's width, at most `DEFAULT_WIDTH` (also when output is not a terminal)."""
    return min(DEFAULT_WIDTH, shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns)


def natural_key(text: str) -> list[int | str]:
    """Sort key that orders numbers by value: layers_2 before layers_10."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", text)]


def layer_pattern(path: str) -> tuple[str, int | None]:
    """`a/layers_12/b` -> ('a/layers_{}/b', 12); paths without a layer index -> (path, None)."""
    m = _LAYER_RE.search(path)
    if m is None:
        return path, None
    return path[: m.start(2)] + "{}" + path[m.end(2) :], int(m.group(2))


def fold_indices(indices: Sequence[int]) -> str:
    """[0, 1, 2, 3] -> '0..3'; [0, 2, 5] -> '0,2,5'."""
    ix = sorted(indices)
    if len(ix) > 2 and ix == list(range(ix[0], ix[-1] + 1)):
        return f"{ix[0]}..{ix[-1]}"
    return ",".join(map(str, ix))


def elide(text: str, width: int) -> str:
    """`text` cut to `width` characters, its middle replaced by '…' (ends say the most)."""
    if len(text) <= width:
        return text
    if width <= 1:
        return text[:width]
    head = (width - 1) * 2 // 5  # the end of a path names the array: keep more of it
    return text[:head] + "…" + text[len(text) - (width - 1 - head) :]


def shorten_path(path: str, width: int) -> str:
    """`path` cut to `width` by shortening its longest inner segments ('encoder_decoder_att…'),
    so that its first segment, a folded `layers_0..23` and its last segment stay readable."""
    segs = path.split("/")
    inner = [i for i in range(1, len(segs) - 1) if not segs[i].startswith("layers_")]
    while len("/".join(segs)) > width:
        longest = max(inner, key=lambda i: len(segs[i]), default=None)
        if longest is None or len(segs[longest]) <= 4:
            return elide("/".join(segs), width)
        segs[longest] = segs[longest][: len(segs[longest]) - 2] + "…"
    return "/".join(segs)


def format_table(
    rows: Sequence[Sequence[str]],
    *,
    max_width: int | None = DEFAULT_WIDTH,
    shrink: Sequence[int] = (),
    indent: str = "",
    paths: Sequence[int] = (),
    rule: bool = True,
    min_column: int = 8,
) -> list[str]:
    """Left-aligned columns, the first row a header underlined by a rule.

    When the table is wider than `max_width`, the columns in `shrink` (widest first) are cut
    in their middle (the columns in `paths` segment by segment), each to no fewer than
    `min_column` characters.
    """
    n = len(rows[0])
    widths = [max(len(r[i]) for r in rows) for i in range(n)]

    def total() -> int:
        return len(indent) + sum(widths) + 2 * (n - 1)

    while max_width is not None and total() > max_width:
        cands = [i for i in shrink if widths[i] > min_column]
        if not cands:
            break
        widths[max(cands, key=lambda k: widths[k])] -= 1  # the widest first, evenly

    def cut(i: int, cell: str) -> str:
        return shorten_path(cell, widths[i]) if i in paths else elide(cell, widths[i])

    lines = [
        (indent + "  ".join(cut(i, c).ljust(widths[i]) for i, c in enumerate(r))).rstrip()
        for r in rows
    ]
    if rule:
        lines.insert(1, indent + "-" * (total() - len(indent)))
    return lines
