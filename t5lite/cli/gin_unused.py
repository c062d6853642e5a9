"""Bindings that the run would never read: a binding on a configurable that nothing calls.

gin applies a binding only when its configurable is called, and accepts a binding on any
registered configurable. A configurable that the run never calls takes its bindings silently:
`--gin.standard_logical_axis_rules.additional_rules=...` (t5x's name) trained to the end with
the rule unused where the presets call `preset_rules`.

t5lite's library never calls a gin configurable (registry.py): what a run calls is the program
the command runs, and what gin reaches from its bindings: references (`@X()`, `@X`, `%MACRO`)
followed through scopes as gin resolves them (a scoped reference `@s/X()` and a macro call in
exactly their scope; an unscoped one in its caller's). That is known before anything is built:
`check_reached` runs right after parsing.

- A `--gin.` binding on one of t5lite's configurables that the program does not reach is an
  error at once, naming the configurable the run calls instead where one takes that parameter.
- A `--gin.` binding on any other configurable (a user module's, which user code may call
  directly) is checked against gin's operative config once the program has returned
  (`check_called`): the latest point, with a non-zero exit.
- A user's gin file may be shared by train, eval and infer, and may define tasks or
  vocabularies that a later flag picks: its bindings are errors only where they cannot be meant
  for another run, that is on a configurable that nothing in the configuration references while
  the run calls an alternative of it (`registry.ALTERNATIVES`) that takes the same parameter
  (`standard_logical_axis_rules.additional_rules` beside the presets' `preset_rules`). The
  packaged configs/ are not checked (their bindings are defaults that a user file overrides).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import inspect
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from gin import config as gin_config
from gin import config_parser

from t5lite.cli.gin_checks import GinCheckError

# (scope, complete selector, parameter); a macro's is (NAME, "gin.macro", "value").
_Key = tuple[str, str, str]


@dataclasses.dataclass(frozen=True)
class Source:
    """Where a binding was written: a line of a gin file, or a `--gin.` flag (file None)."""

    file: str | None
    line: int
    text: str

    def describe(self, config_dirs: Sequence[Path]) -> str:
        if self.file is None:
            return "--gin." + self.text.partition("=")[0].strip()
        return f"{_short_path(self.file, config_dirs)}:{self.line}"


@contextlib.contextmanager
def recording_sources() -> Iterator[dict[_Key, Source]]:
    """Records where each binding gin parses was written (the last one of a key wins, as in
    gin). Patches gin's parser class for the duration only."""
    sources: dict[_Key, Source] = {}
    original = config_parser.ConfigParser

    class Recording(original):  # type: ignore[misc, valid-type]
        def parse_statement(self):
            statement = super().parse_statement()
            if isinstance(statement, config_parser.BindingStatement):
                key = _statement_key(statement)
                if key is not None:
                    loc = statement.location
                    sources[key] = Source(loc.filename, loc.line_num, loc.line_content.strip())
            return statement

    config_parser.ConfigParser = Recording
    try:
        yield sources
    finally:
        config_parser.ConfigParser = original


def _statement_key(statement: config_parser.BindingStatement) -> _Key | None:
    if not statement.arg_name:  # a macro
        name = f"{statement.scope}/{statement.selector}" if statement.scope else statement.selector
        return (name, "gin.macro", "value")
    try:
        parsed = gin_config.ParsedBindingKey.parse(
            (statement.scope, statement.selector, statement.arg_name)
        )
    except (ValueError, KeyError):  # gin reports it itself, naming the line
        return None
    return (parsed.scope, parsed.complete_selector, parsed.arg_name)


@dataclasses.dataclass(frozen=True)
class _Reach:
    """Configurables a run calls: (selector, scope) -> the binding that references it."""

    calls: dict[tuple[str, tuple[str, ...]], _Key | None]

    def reaches(self, scope: str, selector: str) -> bool:
        want = tuple(scope.split("/")) if scope else ()
        return any(s == selector and p[: len(want)] == want for s, p in self.calls)

    def via(self, selector: str) -> _Key | None:
        return next((v for (s, _), v in self.calls.items() if s == selector), None)


def _reach(roots: Sequence[str]) -> _Reach:
    """Every (configurable, scope) that calling `roots` reaches through the bindings."""
    calls: dict[tuple[str, tuple[str, ...]], _Key | None] = {}
    todo: list[tuple[str, tuple[str, ...], _Key | None]] = [(r, (), None) for r in roots]
    while todo:
        selector, path, via = todo.pop()
        if (selector, path) in calls:
            continue
        calls[(selector, path)] = via
        for i in range(len(path) + 1):  # gin's scope inheritance: every prefix of the scope
            scope = "/".join(path[:i])
            for param, value in gin_config._CONFIG.get((scope, selector), {}).items():
                for ref in _references(value):
                    ref_path = tuple(ref.scopes) if ref.scopes else path
                    todo.append((ref.configurable.selector, ref_path, (scope, selector, param)))
    return _Reach(calls)


def _references(value: Any) -> Iterator[gin_config.ConfigurableReference]:
    if isinstance(value, gin_config.ConfigurableReference):
        yield value
    elif isinstance(value, list | tuple | set):
        for v in value:
            yield from _references(v)
    elif isinstance(value, dict):
        for v in [*value.keys(), *value.values()]:
            yield from _references(v)


def _referenced() -> set[str]:
    """Selectors that some binding references (whether or not this run reaches it)."""
    return {
        ref.configurable.selector
        for params in gin_config._CONFIG.values()
        for value in params.values()
        for ref in _references(value)
    }


@dataclasses.dataclass(frozen=True)
class Pending:
    """A `--gin.` binding on a configurable that is not t5lite's and was not reached: it must
    have been called (by user code) by the end of the run."""

    scope: str
    selector: str
    flag: str


def check_reached(
    roots: Sequence[str],
    sources: dict[_Key, Source],
    own: set[str],
    alternatives: Sequence[frozenset[str]],
    config_dirs: Sequence[Path],
) -> list[Pending]:
    """Raises GinCheckError naming the first binding that the run started at `roots` would
    never read (see the module docstring); returns the flags left for `check_called`.

    Args:
      roots: selectors of the configurables the command calls (its program).
      sources: where each binding was written (`recording_sources`).
      own: selectors of t5lite's configurables (registry.py).
      alternatives: sets of selectors that fill the same slot.
      config_dirs: the packaged configs/ (not checked; shown relative to them).
    """
    reach = _reach(roots)
    referenced = _referenced()
    pending = []
    for (scope, selector), params in gin_config._CONFIG.items():
        if selector.startswith("gin.") or reach.reaches(scope, selector):
            continue
        for param in params:
            source = sources.get((scope, selector, param))
            if source is None:  # bound from Python (a notebook): nothing to point at
                continue
            if source.file is None and selector not in own:
                pending.append(Pending(scope, selector, source.describe(config_dirs)))
                continue
            instead = _instead(selector, param, reach, own, alternatives)
            if source.file is None or (
                not _packaged(source.file, config_dirs)
                and _superseded(selector, instead, referenced, alternatives)
            ):
                raise GinCheckError(
                    _message(scope, selector, param, source, instead, reach, sources, config_dirs)
                )
    return pending


def _superseded(
    selector: str, instead: str | None, referenced: set[str], alternatives: Sequence[frozenset]
) -> bool:
    """Whether a user file's binding cannot be meant for another run: nothing references its
    configurable, and the run calls an alternative of it that takes the same parameter."""
    if selector in referenced or instead is None:
        return False
    return any({selector, instead} <= group for group in alternatives)


def check_called(pending: Sequence[Pending]) -> None:
    """After the program returned: each pending flag's configurable was called (gin's
    operative config records every call with its scope)."""
    called = [(scope, selector) for scope, selector in gin_config._OPERATIVE_CONFIG]
    for p in pending:
        want = p.scope.split("/") if p.scope else []
        if not any(s == p.selector and c.split("/")[: len(want)] == want for c, s in called):
            where = f" in scope '{p.scope}'" if p.scope else ""
            raise GinCheckError(
                f"{p.flag}: {_name(p.selector)} was not called{where} by this run, so the "
                "binding was ignored"
            )


def _instead(
    selector: str, param: str, reach: _Reach, own: set[str], alternatives: Sequence[frozenset]
) -> str | None:
    """The configurable the run calls in place of `selector`, taking `param`: an alternative
    of it first, else the closest name among those the run calls."""
    called = {s for s, _ in reach.calls if s in own and param in _parameters(s)}
    same_slot = [s for s in called if any({selector, s} <= g for g in alternatives)]
    candidates = sorted(same_slot or called)
    if not candidates:
        return None
    close = difflib.get_close_matches(
        _name(selector), [_name(c) for c in candidates], n=1, cutoff=0
    )
    return next(c for c in candidates if _name(c) == close[0])


def _message(
    scope: str,
    selector: str,
    param: str,
    source: Source,
    instead: str | None,
    reach: _Reach,
    sources: dict[_Key, Source],
    config_dirs: Sequence[Path],
) -> str:
    name = f"{scope}/{_name(selector)}" if scope else _name(selector)
    where = source.describe(config_dirs)
    head = where if source.file is None else f"{where}: {name}.{param}"
    in_scope = f" in scope '{scope}'" if scope else ""
    text = f"{head}: {_name(selector)} is not called{in_scope} by this run, so the binding "
    text += "would be ignored"
    if instead is None:
        return text
    via = reach.via(instead)
    how = ""
    if via is not None:
        slot = _slot_name(via)
        at = sources.get(via)
        how = f" ({slot}" + (f" in {at.describe(config_dirs)})" if at and at.file else ")")
    return f"{text}; the run calls {_name(instead)}{how}: bind {_name(instead)}.{param}"


def _slot_name(key: _Key) -> str:
    scope, selector, param = key
    if selector == "gin.macro":
        return scope
    return f"{scope + '/' if scope else ''}{_name(selector)}.{param}"


def _name(selector: str) -> str:
    """A configurable's name as gin files write it (t5lite.preset_rules -> preset_rules)."""
    configurable = gin_config._REGISTRY.get_match(selector)
    return configurable.name if configurable is not None else selector.split(".")[-1]


def _parameters(selector: str) -> set[str]:
    configurable = gin_config._REGISTRY.get_match(selector)
    if configurable is None:
        return set()
    target = configurable.wrapped
    try:
        return set(inspect.signature(target).parameters)
    except (TypeError, ValueError):
        return set()


def _packaged(file: str, config_dirs: Sequence[Path]) -> bool:
    path = Path(file).resolve()
    return any(path.is_relative_to(d.resolve()) for d in config_dirs)


def _short_path(file: str, config_dirs: Sequence[Path]) -> str:
    path = Path(file).resolve()
    for d in config_dirs:
        if path.is_relative_to(d.resolve()):
            return str(path.relative_to(d.resolve()))
    return os.path.relpath(path) if path.is_relative_to(Path.cwd()) else str(path)
