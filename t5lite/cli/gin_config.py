"""Finding and parsing gin files: the CLI's configuration layer, usable from notebooks too."""

from __future__ import annotations

import difflib
import inspect
import logging
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

import gin

# Packaged configs: `t5lite.configs` after an install; the repository's configs/ in a checkout.
_CONFIG_DIRS = (
    Path(__file__).resolve().parents[1] / "configs",
    Path(__file__).resolve().parents[2] / "configs",
)


class ConfigError(ValueError):
    """A gin file that cannot be found or a binding gin rejects."""


def find_gin_file(name: str, search_paths: Sequence[str] = ()) -> str:
    """Resolves `name` against the working directory, `search_paths`, then the packaged
    `configs/`."""
    candidates = [Path(name)] + [Path(d) / name for d in search_paths]
    candidates += [d / name for d in _CONFIG_DIRS]
    candidates += [d / name.removeprefix("configs/") for d in _CONFIG_DIRS]
    for c in candidates:
        if c.is_file():
            return str(c)
    raise ConfigError(
        f"gin file {name!r} not found in {', '.join([os.getcwd(), *search_paths])} or the "
        f"packaged configs ({', '.join(str(d) for d in _CONFIG_DIRS if d.is_dir())})"
    )


def parse_gin(
    gin_files: Sequence[str], bindings: Sequence[str], search_paths: Sequence[str] = ()
) -> None:
    """Parses files (with `include`s resolved the same way) and `NAME=VALUE` bindings.

    Raises ConfigError with gin's message (naming the binding) on any mistake, before anything
    is built or compiled.
    """
    from t5lite.cli import gin_checks, gin_unused
    from t5lite.cli import registry as gin_registry  # registers the configurables

    try:
        gin_checks.check_flag_syntax(bindings)
    except gin_checks.GinCheckError as e:
        raise ConfigError(str(e)) from None
    # A gin `import` finds modules in the working directory and the search paths, as t5x users
    # expect; `include`s look in the search paths too.
    for d in [os.getcwd(), *(os.path.abspath(p) for p in search_paths)]:
        if d not in sys.path:
            sys.path.insert(0, d)
    for d in search_paths:
        if os.path.abspath(d) not in gin.config._LOCATION_PREFIXES:
            gin.add_config_file_search_path(os.path.abspath(d))

    for d in _CONFIG_DIRS:
        if d.is_dir() and str(d) not in gin.config._LOCATION_PREFIXES:
            gin.add_config_file_search_path(str(d))
    _stand_in_for_t5x(gin_registry.T5X_MODULES)
    _tolerate_namespace_packages()
    # gin logs an ERROR for every search-path prefix an `include` does not resolve against,
    # even when a later prefix finds the file; those lines are noise, not errors.
    quiet = _DropMessages("Path not found")
    logging.getLogger().addFilter(quiet)
    try:
        # Finalising runs gin's hook that rejects `%gin.REQUIRED` macros left unset; unlocking
        # first lets a notebook (or a test) parse again after an earlier finalised parse.
        with gin.unlock_config(), gin_unused.recording_sources() as sources:
            gin.parse_config_files_and_bindings(
                [find_gin_file(f, search_paths) for f in gin_files],
                list(bindings),
                finalize_config=True,
            )
        _SOURCES.clear()
        _SOURCES.update(sources)
    except ImportError as e:  # a gin `import` (gin's message names the file and line)
        # gin re-raises a copy of the error with the file and line added, without `e.name`.
        missing = re.search(r"No module named '([\w.]+)'", str(e))
        top = missing.group(1).split(".")[0] if missing else ""
        if getattr(sys.modules.get(top), "__doc__", None) == _STAND_IN_DOC:
            known = ", ".join(sorted(gin_registry.T5X_MODULES))
            raise ConfigError(
                f"{one_line(e)}: t5x is not installed; t5lite stands in for {known} only (for "
                "a t5x run file, include t5lite's t5x/configs/runs/*.gin)"
            ) from e
        raise ConfigError(
            f"{one_line(e)}: looked in the working directory ({os.getcwd()}) and the installed "
            "packages"
        ) from e
    except (ValueError, KeyError, NameError, TypeError, OSError) as e:
        raise ConfigError(_with_suggestion(one_line(e))) from e
    finally:
        logging.getLogger().removeFilter(quiet)
    try:
        gin_checks.check_macros(bindings)
        gin_checks.check_types()
    except gin_checks.GinCheckError as e:
        raise ConfigError(str(e)) from None


# Where each binding of the last parse was written (gin_unused.Source), for check_read.
_SOURCES: dict = {}


def check_read(command: str) -> list:
    """Raises ConfigError naming a binding that `command`'s program would never read (see
    gin_unused); returns the flags whose configurables are checked once it has returned."""
    from t5lite.cli import gin_checks, gin_unused
    from t5lite.cli import registry as gin_registry

    try:
        return gin_unused.check_reached(
            gin_registry.PROGRAMS[command],
            _SOURCES,
            set(gin_registry.SELECTORS.values()),
            gin_registry.ALTERNATIVES,
            _CONFIG_DIRS,
        )
    except gin_checks.GinCheckError as e:
        raise ConfigError(str(e)) from None


def check_called(pending: Sequence) -> None:
    """After the program returned: ConfigError naming a pending flag whose configurable was
    never called."""
    from t5lite.cli import gin_checks, gin_unused

    try:
        gin_unused.check_called(pending)
    except gin_checks.GinCheckError as e:
        raise ConfigError(str(e)) from None


def _tolerate_namespace_packages() -> None:
    """gin's package-resource reader crashes (TypeError) on `include 'DIR/x.gin'` when DIR is a
    directory on sys.path without `__init__.py` (a namespace package has no file); the search
    paths are on sys.path for gin `import`s, so that is any included subdirectory there. Such a
    path is simply not a package resource: the plain file reader finds it under its prefix."""

    def tolerant(check):
        def exists(path: str) -> bool:
            try:
                return check(path)
            except TypeError:
                return False

        exists.tolerant = True  # type: ignore[attr-defined]
        return exists

    readers = gin.config._FILE_READERS
    readers[:] = [(r, c if getattr(c, "tolerant", False) else tolerant(c)) for r, c in readers]


_STAND_IN_DOC = "t5lite's stand-in for t5x/seqio in gin files (t5lite/cli/registry.T5X_MODULES)"


def _stand_in_for_t5x(modules: dict[str, dict[str, object]]) -> None:
    """Makes t5x's and seqio's module names importable where those packages are not installed.

    A t5x gin file's `from t5x import models` then imports a module holding t5lite's
    configurables under t5x's names (`registry.T5X_MODULES`). An installed t5x or seqio is never
    shadowed: its own modules are imported, as in t5x.
    """
    import importlib.machinery
    import importlib.util
    import types

    for name, attrs in modules.items():
        top = name.split(".")[0]
        if top in sys.modules:
            if sys.modules[top].__doc__ != _STAND_IN_DOC:
                continue  # the real package, already imported
        else:
            spec = importlib.util.find_spec(top)
            # A directory of gin files named t5x/ on the path is a namespace package (no
            # origin), not t5x.
            if spec is not None and spec.origin is not None:
                continue  # the real package
        parts = name.split(".")
        for i in range(1, len(parts) + 1):  # parents first: `import t5x.models` needs `t5x`
            path = ".".join(parts[:i])
            if path not in sys.modules:
                module = types.ModuleType(path, _STAND_IN_DOC)
                # gin resolves `include 't5x/x.gin'` against a package's origin: point it into
                # configs/ (a file that need not exist; only its directory is used).
                origin = str(_CONFIG_DIRS[-1].joinpath(*path.split("."), "__init__.py"))
                module.__spec__ = importlib.machinery.ModuleSpec(path, None, origin=origin)
                module.__path__ = []  # a package, so submodules import
                sys.modules[path] = module
                if i > 1:
                    setattr(sys.modules[".".join(parts[: i - 1])], parts[i - 1], module)
        for attr, value in attrs.items():
            setattr(sys.modules[name], attr, value)


def _with_suggestion(message: str) -> str:
    """Adds "did you mean" to gin's message for an unknown configurable or parameter name."""
    m = re.search(r"Configurable '([\w.]+)' doesn't have a parameter named '(\w+)'", message)
    if m:
        params = _parameters(m.group(1))
        close = difflib.get_close_matches(m.group(2), params, n=1)
        return f"{message}; did you mean {close[0]}?" if close else message
    m = re.search(r"No configurable matching '([\w.]+)'", message)
    if not m:
        return message
    known = sorted({name.split(".")[-1] for name, _ in gin.config._REGISTRY.items()})
    close = difflib.get_close_matches(m.group(1).split(".")[-1], known, n=1)
    return f"{message}; did you mean {close[0]}?" if close else message


def _parameters(configurable: str) -> list[str]:
    """The parameter names of a registered configurable (short or dotted name)."""
    for name, c in gin.config._REGISTRY.items():
        if name == configurable or name.split(".")[-1] == configurable.split(".")[-1]:
            target = c.wrapped.__init__ if inspect.isclass(c.wrapped) else c.wrapped
            return [p for p in inspect.signature(target).parameters if p != "self"]
    return []


def missing_arguments(e: BaseException) -> str | None:
    """One line for gin's error when a configurable is called without a required argument."""
    text = re.sub(r"\s*\(<(function|class) [^>]*>\)", "", str(e))
    m = re.search(r"No values supplied by Gin or caller for arguments: \[([^\]]*)\]", text)
    # Keyword-only arguments without a default are Python's own error, not gin's.
    kw = re.search(r"missing \d+ required (?:keyword-only |positional )?arguments?: (.*)", text)
    where = re.search(r"In call to configurable '([\w.]+)'(?: in scope '([\w./]+)')?", text)
    if not ((m or kw) and where):
        return None
    listed = m.group(1) if m else kw.group(1).splitlines()[0]
    names = re.findall(r"'(\w+)'", listed)
    scope = f"{where.group(2)}/" if where.group(2) else ""
    binding = ", ".join(f"{scope}{where.group(1)}.{n}" for n in names)
    return f"{binding}: required, but no value is bound"


def describe_configs() -> str:
    """The packaged gin files by folder, and the macros each run file requires (for --help)."""
    root = next((d for d in _CONFIG_DIRS if d.is_dir()), None)
    if root is None:
        return ""
    lines = ["packaged gin files (--gin_file=NAME):"]
    for folder in ("models", "partitioning", "runs"):
        names = sorted(str(p.relative_to(root)) for p in (root / folder).rglob("*.gin"))
        lines.append(f"  {folder}/: " + ", ".join(n.removeprefix(f"{folder}/") for n in names))
    lines.append("  " + ", ".join(sorted(p.name for p in root.glob("*.gin"))))
    lines.append("required macros (set with --gin.NAME=VALUE; strings quoted: \"'...'\"):")
    for run in sorted((root / "runs").glob("*.gin")):
        required = re.findall(r"^(\w+) = %gin.REQUIRED", run.read_text(), flags=re.M)
        if required:
            lines.append(f"  runs/{run.name}: {', '.join(required)}")
    return "\n".join(lines)


def operative_config() -> str:
    """Every binding of the parsed gin files and flags, as `config.gin` records them."""
    return gin.config_str()


def one_line(e: BaseException) -> str:
    """An exception's message on one line, without gin's function reprs."""
    text = re.sub(r"\s*\(<(function|class) [^>]*>\)", "", str(e))
    # The program a command runs is already named by the command ("t5lite train: error: ...").
    programs = "train|evaluate|infer|inspect|plan|cache"
    text = re.sub(rf"\s*In call to configurable '({programs})'\s*$", "", text)
    return " ".join(line.strip() for line in text.strip().splitlines() if line.strip())


class _DropMessages(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)
