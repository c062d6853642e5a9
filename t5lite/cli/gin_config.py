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
    from t5lite.cli import gin_checks
    from t5lite.cli import registry as gin_registry  # noqa: F401  (registers the configurables)

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
    # gin logs an ERROR for every search-path prefix an `include` does not resolve against,
    # even when a later prefix finds the file; those lines are noise, not errors.
    quiet = _DropMessages("Path not found")
    logging.getLogger().addFilter(quiet)
    try:
        # Finalising runs gin's hook that rejects `%gin.REQUIRED` macros left unset; unlocking
        # first lets a notebook (or a test) parse again after an earlier finalised parse.
        with gin.unlock_config():
            gin.parse_config_files_and_bindings(
                [find_gin_file(f, search_paths) for f in gin_files],
                list(bindings),
                finalize_config=True,
            )
    except ImportError as e:  # a gin `import` (gin's message names the file and line)
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
    where = re.search(r"In call to configurable '([\w.]+)'(?: in scope '([\w./]+)')?", text)
    if not (m and where):
        return None
    names = [a.strip(" '") for a in m.group(1).split(",") if a.strip()]
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
