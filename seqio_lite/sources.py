"""Random-access data sources with a stable identity.

A `DataSource` maps split names to random-access sequences of examples (dicts). Random access is
what makes a global shuffle and an index-based, resumable loader possible. Each split also has a
`fingerprint`: a short hash of what the data is (file names, sizes, content samples), stored in
iterator states so that a state refuses to restore onto different data.
"""

from __future__ import annotations

import abc
import bisect
import functools
import glob
import hashlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgpack
import numpy as np

Example = dict[str, Any]

# --------------------------------------------------------------------------------------------
# Example <-> bytes (msgpack; never pickle). Used by ArrayRecord sources and the cache job.
# --------------------------------------------------------------------------------------------


def _encode_value(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return {"__nd__": True, "dtype": v.dtype.str, "shape": list(v.shape), "data": v.tobytes()}
    if isinstance(v, np.generic):
        return v.item()
    return v


def _decode_value(v: Any) -> Any:
    if isinstance(v, dict) and v.get("__nd__"):
        return np.frombuffer(v["data"], dtype=np.dtype(v["dtype"])).reshape(v["shape"]).copy()
    return v


def encode_example(example: Mapping[str, Any]) -> bytes:
    """Serialises an example (numpy arrays, str, numbers, lists) with msgpack."""
    return msgpack.packb({k: _encode_value(v) for k, v in example.items()}, use_bin_type=True)


def decode_example(record: bytes) -> Example:
    """Inverse of `encode_example`."""
    return {k: _decode_value(v) for k, v in msgpack.unpackb(record, raw=False).items()}


def _hash(*parts: Any) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, bytes) else repr(p).encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def _file_identity(path: str) -> tuple:
    """Name, size and a hash of the first and last 64 KiB: cheap, and stable across copies."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(1 << 16)
        f.seek(max(0, size - (1 << 16)))
        tail = f.read(1 << 16)
    return (os.path.basename(path), size, _hash(head, tail))


# --------------------------------------------------------------------------------------------
# Base classes
# --------------------------------------------------------------------------------------------


class SplitData(abc.ABC):
    """One split of a source: `len`, `[i]`, and a `fingerprint`."""

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def __getitem__(self, index: int) -> Example: ...

    @property
    @abc.abstractmethod
    def fingerprint(self) -> str: ...


class DataSource(abc.ABC):
    """Maps split names to `SplitData`. Opened splits are cached on the instance."""

    def __init__(self, name: str):
        self.name = name
        self._opened: dict[str, SplitData] = {}

    @property
    @abc.abstractmethod
    def splits(self) -> Sequence[str]:
        """The split names this source has."""

    @abc.abstractmethod
    def _open(self, split: str) -> SplitData:
        """Opens one split (may scan files to build an index)."""

    def open(self, split: str) -> SplitData:
        """Returns the split's random-access data; a clear error for unknown or empty splits."""
        if split not in self.splits:
            raise ValueError(
                f"{type(self).__name__} {self.name!r} has no split {split!r}; "
                f"available: {sorted(self.splits)}"
            )
        if split not in self._opened:
            data = self._open(split)
            if len(data) == 0:  # almost always a wrong or truncated file: name it
                files = self.files(split) if isinstance(self, _FileSource) else []
                where = (
                    f" ({', '.join(files[:3])}{', ...' if len(files) > 3 else ''})" if files else ""
                )
                raise ValueError(
                    f"Split {split!r} of {type(self).__name__} {self.name!r} is empty{where}"
                )
            self._opened[split] = data
        return self._opened[split]

    def num_examples(self, split: str) -> int:
        """Number of examples in `split`."""
        return len(self.open(split))

    def fingerprint(self, split: str) -> str:
        """Stable identity of `split`'s data."""
        return self.open(split).fingerprint

    def __getstate__(self) -> dict:
        # Worker processes reopen splits lazily rather than receive file handles.
        state = dict(self.__dict__)
        state["_opened"] = {}
        return state


def _expand(split: str, patterns: str | Sequence[str], owner: str = "") -> list[str]:
    """Expands glob patterns (sorted, deduplicated); a clear error when nothing matches."""
    patterns = [patterns] if isinstance(patterns, str | os.PathLike) else list(patterns)
    files: list[str] = []
    for pattern in patterns:
        matched = sorted(glob.glob(os.fspath(pattern)))
        if not matched:
            where = f"{owner}, split {split!r}" if owner else f"split {split!r}"
            raise FileNotFoundError(f"No file matches {os.fspath(pattern)!r} ({where})")
        files.extend(m for m in matched if m not in files)
    return files


class _FileSource(DataSource):
    """A source whose splits are lists of file patterns."""

    def __init__(self, split_to_filepattern: Mapping[str, str | Sequence[str]], name: str = ""):
        super().__init__(name or type(self).__name__)
        self._patterns = dict(split_to_filepattern)

    @property
    def splits(self) -> Sequence[str]:
        return list(self._patterns)

    def files(self, split: str) -> list[str]:
        """The files of `split`, in read order."""
        return _expand(split, self._patterns[split], f"{type(self).__name__} {self.name!r}")


# --------------------------------------------------------------------------------------------
# Line-based files: text and JSONL
# --------------------------------------------------------------------------------------------


class _LineIndex(SplitData):
    """Byte offsets of the kept lines of several files; reads one line per access."""

    def __init__(self, files: list[str], parse: Callable[[str, str, int], Any], kind: str):
        self._files = files
        self._parse = parse
        self._kind = kind
        self._starts: list[np.ndarray] = []  # per file: byte offset of each kept line
        self._linenos: list[np.ndarray] = []  # per file: 1-based line number of each kept line
        self.num_skipped = 0
        for path in files:
            offsets, linenos = self._scan(path)
            self._starts.append(offsets)
            self._linenos.append(linenos)
        self._cum = np.cumsum([0] + [len(s) for s in self._starts]).tolist()
        self._fingerprint = _hash(kind, [_file_identity(f) for f in files], self.num_skipped)

    def _scan(self, path: str) -> tuple[np.ndarray, np.ndarray]:
        offsets, linenos = [], []
        with open(path, "rb") as f:
            pos = 0
            for lineno, raw in enumerate(f, start=1):
                line = raw.decode("utf-8").rstrip("\r\n")
                keep = self._parse(line, path, lineno)
                if keep is _SKIP:
                    self.num_skipped += 1
                elif keep is not _EMPTY:
                    offsets.append(pos)
                    linenos.append(lineno)
                pos += len(raw)
        return np.asarray(offsets, np.int64), np.asarray(linenos, np.int64)

    def __len__(self) -> int:
        return self._cum[-1]

    def __getitem__(self, index: int) -> Example:
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} lines")
        fi = bisect.bisect_right(self._cum, index) - 1
        j = index - self._cum[fi]
        with open(self._files[fi], "rb") as f:
            f.seek(int(self._starts[fi][j]))
            line = f.readline().decode("utf-8").rstrip("\r\n")
        return self._parse(line, self._files[fi], int(self._linenos[fi][j]))

    @property
    def fingerprint(self) -> str:
        return self._fingerprint


_SKIP = object()  # a malformed line, skipped and counted
_EMPTY = object()  # an empty line, not an example


class TextLineSource(_FileSource):
    """Plain-text files, one example per non-empty line: `{"text": line}`."""

    def _open(self, split: str) -> SplitData:
        def parse(line: str, path: str, lineno: int) -> Any:
            return {"text": line} if line.strip() else _EMPTY

        return _LineIndex(self.files(split), parse, "text")


def _type_names(types: type | tuple[type, ...]) -> str:
    types = types if isinstance(types, tuple) else (types,)
    return " or ".join(_JSON_NAMES.get(t, t.__name__) for t in types)


_JSON_NAMES = {str: "a string", list: "a list", int: "an integer", float: "a number"}


def _check_fields(value: Mapping[str, Any], required: Mapping[str, type | tuple]) -> None:
    """A clear error when a record lacks a required field or has it with the wrong type."""
    for field, types in required.items():
        if field not in value:
            raise ValueError(f"missing field {field!r} (the record has {sorted(value)})")
        v = value[field]
        if not isinstance(v, types) or isinstance(v, bool):
            raise ValueError(
                f"field {field!r} is {json.dumps(v)[:40]}, expected {_type_names(types)}"
            )


class JsonlSource(_FileSource):
    """JSON Lines files, one JSON object per line.

    A malformed line, or one that lacks a field of `required_fields` or has it with another
    type, is an error naming the file and line, unless `skip_malformed=True`: then it is
    skipped, and counted in `num_skipped(split)`. Lines are validated once, when a split is
    first opened, so errors surface before training starts rather than mid-run.
    """

    def __init__(
        self,
        split_to_filepattern: Mapping[str, str | Sequence[str]],
        skip_malformed: bool = False,
        name: str = "",
        required_fields: Mapping[str, type | tuple[type, ...]] | None = None,
    ):
        super().__init__(split_to_filepattern, name)
        self.skip_malformed = skip_malformed
        self.required_fields = dict(required_fields or {})

    def _open(self, split: str) -> SplitData:
        skip = self.skip_malformed
        required = self.required_fields

        def parse(line: str, path: str, lineno: int) -> Any:
            if not line.strip():
                return _EMPTY
            try:
                value = json.loads(line)
                if not isinstance(value, dict):
                    raise ValueError(f"expected a JSON object, got {type(value).__name__}")
                _check_fields(value, required)
            except ValueError as e:
                if skip:
                    return _SKIP
                kind = "malformed JSON line: " if isinstance(e, json.JSONDecodeError) else ""
                raise ValueError(f"{path}:{lineno}: {kind}{e}") from None
            return value

        return _LineIndex(self.files(split), parse, "jsonl")

    def num_skipped(self, split: str) -> int:
        """Malformed lines skipped in `split` (0 unless `skip_malformed`)."""
        return self.open(split).num_skipped  # type: ignore[attr-defined]


# --------------------------------------------------------------------------------------------
# Columnar and record files
# --------------------------------------------------------------------------------------------


class _ParquetSplit(SplitData):
    def __init__(self, files: list[str], columns: Sequence[str] | None):
        import pyarrow.parquet as pq

        self._files = files
        self._columns = list(columns) if columns else None
        self._groups: list[tuple[int, int]] = []  # (file index, row group)
        starts = [0]
        for fi, path in enumerate(files):
            meta = pq.ParquetFile(path).metadata
            for g in range(meta.num_row_groups):
                self._groups.append((fi, g))
                starts.append(starts[-1] + meta.row_group(g).num_rows)
        self._starts = starts
        self._fingerprint = _hash("parquet", [_file_identity(f) for f in files], self._columns)

    @functools.lru_cache(maxsize=4)  # noqa: B019 -- a few decoded row groups per split object
    def _group(self, gi: int) -> list[Example]:
        import pyarrow.parquet as pq

        fi, g = self._groups[gi]
        return pq.ParquetFile(self._files[fi]).read_row_group(g, columns=self._columns).to_pylist()

    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, index: int) -> Example:
        gi = bisect.bisect_right(self._starts, index) - 1
        return self._group(gi)[index - self._starts[gi]]

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    def __getstate__(self) -> dict:
        return {"files": self._files, "columns": self._columns}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["files"], state["columns"])


class ParquetSource(_FileSource):
    """Parquet files; random access through row groups (a few decoded groups are cached)."""

    def __init__(
        self,
        split_to_filepattern: Mapping[str, str | Sequence[str]],
        columns: Sequence[str] | None = None,
        name: str = "",
        required_fields: Sequence[str] = (),
    ):
        super().__init__(split_to_filepattern, name)
        self.columns = columns
        self.required_fields = list(required_fields)

    def _open(self, split: str) -> SplitData:
        import pyarrow.parquet as pq

        files = self.files(split)
        for path in files:
            try:
                names = pq.read_schema(path).names
            except Exception as e:  # pyarrow's errors have no common base worth naming
                raise ValueError(f"{path}: not a readable Parquet file ({e})") from None
            missing = [f for f in self.required_fields if f not in names]
            if missing:
                raise ValueError(f"{path}: no column {missing[0]!r} (columns: {names})")
        return _ParquetSplit(files, self.columns)


class _ArrayRecordSplit(SplitData):
    def __init__(self, files: list[str], decode: Callable[[bytes], Example]):
        from grain.sources import ArrayRecordDataSource

        self._files = files
        self._decode = decode
        self._ds = ArrayRecordDataSource(files)
        self._fingerprint = _hash("array_record", [_file_identity(f) for f in files])

    def __len__(self) -> int:
        return len(self._ds)

    def __getitem__(self, index: int) -> Example:
        return self._decode(self._ds[index])

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    def __getstate__(self) -> dict:
        return {"files": self._files, "decode": self._decode}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["files"], state["decode"])


class ArrayRecordSource(_FileSource):
    """ArrayRecord files of msgpack-encoded examples (`encode_example`), or a custom `decode`."""

    def __init__(
        self,
        split_to_filepattern: Mapping[str, str | Sequence[str]],
        decode: Callable[[bytes], Example] = decode_example,
        name: str = "",
    ):
        super().__init__(split_to_filepattern, name)
        self.decode = decode

    def _open(self, split: str) -> SplitData:
        return _ArrayRecordSplit(self.files(split), self.decode)


# --------------------------------------------------------------------------------------------
# In-memory and generated data
# --------------------------------------------------------------------------------------------


class _ListSplit(SplitData):
    def __init__(self, examples: Sequence[Example], fingerprint: str):
        self._examples = examples
        self._fingerprint = fingerprint

    def __len__(self) -> int:
        return len(self._examples)

    def __getitem__(self, index: int) -> Example:
        return dict(self._examples[index])

    @property
    def fingerprint(self) -> str:
        return self._fingerprint


class InMemorySource(DataSource):
    """Examples held in memory: `{split: [example, ...]}`; fingerprinted by content."""

    def __init__(self, split_to_examples: Mapping[str, Sequence[Example]], name: str = ""):
        super().__init__(name or "InMemorySource")
        self._data = {k: list(v) for k, v in split_to_examples.items()}

    @property
    def splits(self) -> Sequence[str]:
        return list(self._data)

    def _open(self, split: str) -> SplitData:
        examples = self._data[split]
        fp = _hash("memory", [encode_example(e) for e in examples])
        return _ListSplit(examples, fp)


class _FunctionSplit(SplitData):
    def __init__(self, fn: Callable[[str, int], Example], split: str, n: int, version: str):
        self._fn, self._split, self._n = fn, split, n
        # A function's identity is its qualified name, a version string and a sample of output.
        sample = [encode_example(fn(split, i)) for i in range(min(n, 8))]
        name = getattr(fn, "__qualname__", repr(fn))
        self._fingerprint = _hash("function", name, version, split, n, sample)

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index: int) -> Example:
        if not 0 <= index < self._n:
            raise IndexError(f"index {index} out of range for {self._n} examples")
        return self._fn(self._split, index)

    @property
    def fingerprint(self) -> str:
        return self._fingerprint


class FunctionSource(DataSource):
    """Examples generated on demand: `fn(split, index) -> example`, `num_examples[split]` long.

    `fn` must be deterministic in its arguments; bump `version` when its output changes.
    """

    def __init__(
        self,
        fn: Callable[[str, int], Example],
        num_examples: Mapping[str, int],
        version: str = "1",
        name: str = "",
    ):
        super().__init__(name or getattr(fn, "__name__", "FunctionSource"))
        self._fn = fn
        self._num = dict(num_examples)
        self.version = version

    @property
    def splits(self) -> Sequence[str]:
        return list(self._num)

    def _open(self, split: str) -> SplitData:
        return _FunctionSplit(self._fn, split, self._num[split], self.version)


class HFDatasetSource(DataSource):
    """A local Hugging Face `datasets` dataset: a `save_to_disk` folder, or JSON/Parquet files.

    Args:
      path: a folder written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`, or (with
        `data_files`) a builder name such as "json" or "parquet".
      data_files: `{split: file pattern(s)}` for file-based datasets. Nothing is downloaded.
    """

    def __init__(
        self,
        path: str,
        data_files: Mapping[str, str | Sequence[str]] | None = None,
        name: str = "",
        required_fields: Sequence[str] = (),
    ):
        super().__init__(name or f"hf:{path}")
        self._path = path
        self._data_files = dict(data_files) if data_files else None
        self._dd = None
        self.required_fields = list(required_fields)

    def _load(self) -> Any:
        if self._dd is None:
            try:
                import datasets
            except ImportError as e:
                raise ImportError(
                    "HFDatasetSource needs Hugging Face `datasets` (pip install datasets)"
                ) from e
            if self._data_files is None:
                if not os.path.exists(self._path):
                    raise FileNotFoundError(f"No saved dataset at {self._path!r}")
                dd = datasets.load_from_disk(self._path)
                if isinstance(dd, datasets.Dataset):
                    dd = datasets.DatasetDict({"train": dd})
            else:
                for split, pattern in self._data_files.items():
                    _expand(split, pattern)  # a clear error before `datasets` gives its own
                dd = datasets.load_dataset(self._path, data_files=self._data_files)
            self._dd = dd
        return self._dd

    @property
    def splits(self) -> Sequence[str]:
        return list(self._data_files) if self._data_files else list(self._load())

    def _open(self, split: str) -> SplitData:
        ds = self._load()[split]
        missing = [f for f in self.required_fields if f not in ds.column_names]
        if missing:
            raise ValueError(
                f"{self._path} split {split!r}: no column {missing[0]!r} (columns: "
                f"{ds.column_names})"
            )
        fp = _hash("hf", self._path, split, getattr(ds, "_fingerprint", None), len(ds))
        return _ListSplit(ds, fp)

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["_dd"] = None
        return state
