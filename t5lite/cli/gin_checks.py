"""Checks of a gin configuration that gin itself does not make, run before anything compiles.

- a `--gin.NAME=value` macro that no loaded file uses (a typo such as `TRAN_STEPS` would
  otherwise be ignored and the default run start), with "did you mean";
- an unquoted string in a flag (`--gin.MODEL_DIR=runs/x`): gin values are Python literals;
- a literal of the wrong type for a parameter, checked against the configurable's type hints
  (macros are followed to their values).
"""

from __future__ import annotations

import ast
import collections.abc
import difflib
import re
import types
import typing
from collections.abc import Sequence
from typing import Any

from gin import config as gin_config

_MACRO = "gin.macro"
_NAME = re.compile(r"^[A-Za-z_][\w./]*$")


class GinCheckError(ValueError):
    """A binding that would be ignored or fail later; the message names it."""


def check_flag_syntax(bindings: Sequence[str]) -> None:
    """Before parsing: flags whose value is a bare word or path, not a Python literal."""
    for b in bindings:
        name, sep, value = b.partition("=")
        value = value.strip()
        if not sep or not value or value[0] in "@%" or "@" in value or "%" in value:
            continue  # references and macros are gin's own syntax
        try:
            ast.literal_eval(value)
        except (ValueError, SyntaxError):
            if value not in ("True", "False", "None"):
                raise GinCheckError(
                    f"--gin.{name.strip()}={value}: gin values are Python literals; quote a "
                    f"string: --gin.{name.strip()}=\"'{value}'\""
                ) from None


def _referenced_macros() -> set[str]:
    names: set[str] = set()

    def walk(v: Any) -> None:
        if isinstance(v, gin_config.ConfigurableReference):
            if v.configurable.name == "macro":
                names.add(v.scoped_selector.split("/")[0])
        elif isinstance(v, list | tuple | set):
            for x in v:
                walk(x)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)

    for params in gin_config._CONFIG.values():
        for v in params.values():
            walk(v)
    return names


# Macros the packaged gin files no longer read, and what replaced them.
RENAMED_MACROS = {
    "ACTIVATION_DTYPE": "PRECISION (e.g. \"'compute=bfloat16'\")",
    "PARAM_DTYPE": "PRECISION (e.g. \"'params=bfloat16'\"; the masters stay fp32)",
}


def check_macros(bindings: Sequence[str]) -> None:
    """After parsing: every macro set by a flag is used by some loaded gin file."""
    used = _referenced_macros()
    for b in bindings:
        name = b.partition("=")[0].strip()
        if name in RENAMED_MACROS and name not in used:
            raise GinCheckError(f"--gin.{name}: renamed; set --gin.{RENAMED_MACROS[name]}")
        if "." in name or "/" in name or not _NAME.match(name) or name in used:
            continue
        close = difflib.get_close_matches(name, sorted(used), n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise GinCheckError(f"--gin.{name}: no loaded gin file uses the macro %{name}{hint}")


def _resolve(value: Any, depth: int = 0) -> Any:
    """A macro reference's bound value (followed through macros), else the value itself."""
    while isinstance(value, gin_config.ConfigurableReference) and depth < 20:
        if value.configurable.name != "macro":
            return value
        key = (value.scoped_selector.split("/")[0], _MACRO)
        if key not in gin_config._CONFIG:
            return value
        value = gin_config._CONFIG[key].get("value")
        depth += 1
    return value


def _matches(value: Any, hint: Any) -> bool | None:
    """Whether a literal fits a type hint; None where the hint is beyond this check."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any or isinstance(value, gin_config.ConfigurableReference):
        return None
    if origin in (typing.Union, types.UnionType):
        results = [_matches(value, a) for a in args]
        return (
            None if None in results and not any(results) else any(r is not False for r in results)
        )
    if hint is type(None) or hint is None:
        return value is None
    if origin is typing.Literal:
        return value in args
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    base = origin or hint
    if base is collections.abc.Callable:
        return callable(value)  # a literal never is; references were skipped above
    if base in (dict, collections.abc.Mapping):
        return isinstance(value, dict)
    if base in (list, tuple, collections.abc.Sequence):
        return isinstance(value, list | tuple)
    if isinstance(base, type) and base.__module__.startswith("t5lite"):
        return isinstance(value, base)  # a literal where a t5lite object is expected
    return None


def _describe(hint: Any) -> str:
    """A type hint as a user reads it: `int | None`, `a function (@name())`, `one of ...`."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_describe(a) for a in args)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if (origin or hint) is collections.abc.Callable:
        return "a function (@name())"
    if hint is type(None):
        return "None"
    return getattr(origin or hint, "__name__", str(hint))


def check_types() -> None:
    """After parsing: literal values against the type hints of the parameters they set."""
    for (scope, selector), params in gin_config._CONFIG.items():
        if selector == _MACRO:
            continue
        configurable = gin_config._REGISTRY.get_match(selector)
        if configurable is None:
            continue
        target = configurable.wrapped
        if isinstance(target, type) and not hasattr(target, "__dataclass_fields__"):
            target = target.__init__  # a class's parameters are its constructor's
        try:
            hints = typing.get_type_hints(target)
        except Exception:  # unresolvable annotations: nothing to check against
            continue
        for param, raw in params.items():
            if param not in hints:
                continue
            value = _resolve(raw)
            if _matches(value, hints[param]) is False:
                where = f"{scope}/" if scope else ""
                via = ""
                if isinstance(raw, gin_config.ConfigurableReference):
                    via = f"%{raw.scoped_selector.split('/')[0]} = "
                raise GinCheckError(
                    f"{where}{configurable.name}.{param} = {via}{value!r}: expects "
                    f"{_describe(hints[param])}, got {type(value).__name__}"
                )
