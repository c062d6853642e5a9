"""The on-disk layout of a t5lite checkpoint: names, metadata, tree paths, commit markers.

Shared by the writer (`manager.CheckpointManager`) and every reader. Layout of one checkpoint
(no pickle anywhere; every file opens with plain tools):

    <directory>/checkpoint_<step>/
        metadata.json   format, format_version, step, tree (nested dicts/lists whose leaves are
                        array paths), arrays {path: {shape, dtype, logical_axes, dir}}
        extra.json      the trainer's JSON state (step, rng, data iterator state, ...)
        arrays/<dir>/   one zarr3 array per leaf (see `tensorstore_io`), e.g.
                        arrays/params.encoder.layers_0.mlp.wi.kernel
        COMMIT          written last; a directory without it is not a checkpoint
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import jax
from jax.sharding import PartitionSpec

from t5lite.pytree import key_str, path_str

FORMAT = "t5lite.checkpoint"
FORMAT_VERSION = 1
COMMIT_FILE = "COMMIT"
METADATA_FILE = "metadata.json"
EXTRA_FILE = "extra.json"
TMP_SUFFIX = ".tmp"
DELETING_SUFFIX = ".deleting"
STEP_RE = re.compile(r"^checkpoint_(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint cannot be saved or restored; the message names the directory and array."""


# ---------------------------------------------------------------------------------------------
# Tree paths


def flatten(tree: Any) -> tuple[list[tuple[str, Any]], Any]:
    """(path, leaf) pairs with '/'-joined key paths, and the treedef."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return [(path_str(p), x) for p, x in leaves], treedef


def tree_json(tree: Any) -> Any:
    """The tree's structure as JSON: dicts and lists of array paths."""

    def build(path: tuple, node: Any) -> Any:
        if node is None:
            return None
        children = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x, n=node: x is not n)[
            0
        ]
        if len(children) == 1 and children[0][0] == ():
            return path_str(path)
        if not children:
            return [] if isinstance(node, list | tuple) else {}
        keys = [p[0] for p, _ in children]
        if all(hasattr(k, "idx") for k in keys):
            return [build((*path, k), c) for k, (_, c) in zip(keys, children)]
        return {key_str(k): build((*path, k), c) for k, (_, c) in zip(keys, children)}

    return build((), tree)


def array_dir(path: str, taken: set[str]) -> str:
    """A file-system-safe, unique directory name for an array path."""
    name = re.sub(r"[^A-Za-z0-9_.\-]", "_", path.replace("/", ".")) or "_root"
    base, n = name, 1
    while name in taken:
        name, n = f"{base}.{n}", n + 1
    taken.add(name)
    return name


def logical_axes_by_path(logical_axes: Any) -> dict[str, Any]:
    if logical_axes is None:
        return {}
    leaves = jax.tree_util.tree_flatten_with_path(
        logical_axes,
        is_leaf=lambda x: x is None or isinstance(x, PartitionSpec | tuple),
    )[0]
    return {path_str(p): None if x is None else [a for a in x] for p, x in leaves}


# ---------------------------------------------------------------------------------------------
# Directory helpers


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, obj: Any) -> None:
    """Writes `obj` (or an already serialised string) as JSON and fsyncs it."""
    with open(path, "w") as f:
        f.write(obj if isinstance(obj, str) else json.dumps(obj, indent=1))
        f.flush()
        os.fsync(f.fileno())


def is_committed(path: str | os.PathLike) -> bool:
    """Whether `path` is a committed checkpoint directory."""
    return (Path(path) / COMMIT_FILE).is_file()


def committed_steps(directory: str | os.PathLike) -> list[int]:
    """Steps of the committed checkpoints under `directory`, ascending."""
    d = Path(directory)
    if not d.is_dir():
        return []
    steps = []
    for p in d.iterdir():
        m = STEP_RE.match(p.name)
        if m and is_committed(p):
            steps.append(int(m.group(1)))
    return sorted(steps)


def read_metadata(path: str | os.PathLike) -> dict:
    """Reads and checks the metadata of a committed checkpoint.

    Args:
      path: a `checkpoint_<step>` directory.

    Returns:
      The parsed `metadata.json`.

    Raises:
      CheckpointError: missing or uncommitted directory, unreadable metadata, newer format.
    """
    p = Path(path)
    if not p.is_dir():
        raise CheckpointError(f"checkpoint directory {p} does not exist")
    if not is_committed(p):
        raise CheckpointError(f"checkpoint directory {p} is not committed (no {COMMIT_FILE})")
    try:
        meta = json.loads((p / METADATA_FILE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {p}: cannot read {METADATA_FILE}: {e}") from e
    version = meta.get("format_version")
    if meta.get("format") != FORMAT or not isinstance(version, int):
        raise CheckpointError(f"checkpoint {p}: {METADATA_FILE} is not a {FORMAT} file")
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {p} has format version {version}, newer than this t5lite reads "
            f"({FORMAT_VERSION}); upgrade t5lite"
        )
    return meta


def read_extra(p: Path) -> dict:
    """The trainer's JSON state saved with a checkpoint (`extra.json`)."""
    f = p / EXTRA_FILE
    try:
        return json.loads(f.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {p}: cannot read {EXTRA_FILE}: {e}") from e
