"""Task, Mixture and their registries.

A `Task` ties a `DataSource` to a list of per-example preprocessors, the output features (with
their vocabularies), a postprocessing function and metric functions. A `Mixture` samples several
tasks at given rates. Loading (shuffling, sharding, batching) lives in `loader.py`, the offline
cache in `cache.py` and `cache_tasks.py`: they consume tasks, and this module imports neither.

Preprocessors are plain per-example functions: `fn(example, **kwargs) -> example | None`
(`None` drops the example). Keyword arguments are passed according to the function's signature:
`sequence_length` (dict of feature lengths), `output_features` (dict of `Feature`), and `rng`
(a `numpy.random.Generator` seeded from the example's position, so the function is
deterministic yet differs per example and per epoch). Bind other arguments with
`functools.partial`. Preprocessors listed before `CacheDatasetPlaceholder()` run in the offline
cache job (`cache_tasks.py`); their `rng` depends only on the example's index in the source.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from seqio_lite import sources as sources_lib
from seqio_lite.vocabularies import Vocabulary

Example = dict[str, Any]
Preprocessor = Callable[..., Example | None]

_NAME_RE = re.compile(r"^[\w.:-]+$")


@dataclasses.dataclass(frozen=True)
class Feature:
    """One output feature of a task.

    Attributes:
      vocabulary: maps the feature's text to ids and back.
      add_eos: whether `append_eos*` preprocessors add EOS to this feature.
      required: whether the feature must be present after preprocessing.
      dtype: numpy dtype of the ids.
    """

    vocabulary: Vocabulary
    add_eos: bool = True
    required: bool = True
    dtype: Any = np.int32


class CacheDatasetPlaceholder:
    """Marks where the offline cache ends: preprocessors before it run in `cache_tasks`."""

    def __repr__(self) -> str:
        return "CacheDatasetPlaceholder()"


@functools.lru_cache(maxsize=1024)
def _accepted_kwargs(fn: Callable) -> frozenset[str]:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return frozenset()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return frozenset({"sequence_length", "output_features", "rng"})
    return frozenset(params) & {"sequence_length", "output_features", "rng"}


def call_preprocessor(
    fn: Preprocessor,
    example: Example,
    *,
    sequence_length: Mapping[str, int] | None,
    output_features: Mapping[str, Feature],
    rng: np.random.Generator,
) -> Example | None:
    """Calls `fn` with the keyword arguments its signature asks for."""
    available = {"sequence_length": sequence_length, "output_features": output_features, "rng": rng}
    return fn(example, **{k: available[k] for k in accepted_kwargs(fn)})


def accepted_kwargs(fn: Callable) -> frozenset[str]:
    """Which of `sequence_length`, `output_features` and `rng` a preprocessor takes."""
    try:
        return _accepted_kwargs(fn)
    except TypeError:  # unhashable callables: inspect every time
        return _accepted_kwargs.__wrapped__(fn)


def preprocessor_name(fn: Callable) -> str:
    """A readable, stable name for a preprocessor (used in fingerprints)."""
    if isinstance(fn, functools.partial):
        kw = ",".join(f"{k}={v!r}" for k, v in sorted(fn.keywords.items()))
        return f"{preprocessor_name(fn.func)}({kw})"
    return getattr(fn, "__qualname__", type(fn).__name__)


class Task:
    """A dataset with its preprocessing, features, postprocessing and metrics.

    Args:
      name: unique name (letters, digits, `_.:-`).
      source: where raw examples come from.
      output_features: `{feature name: Feature}`, e.g. `{"inputs": ..., "targets": ...}`.
      preprocessors: per-example functions, optionally with one `CacheDatasetPlaceholder()`.
      postprocess_fn: maps decoded model output (and targets) to what metrics compare;
        called as `postprocess_fn(text, example=..., is_target=...)` if it accepts them.
      metric_fns: seqio-style metrics: `fn(targets, predictions)` or `fn(targets, scores)`.
    """

    def __init__(
        self,
        name: str,
        source: sources_lib.DataSource,
        output_features: Mapping[str, Feature],
        preprocessors: Sequence[Preprocessor | CacheDatasetPlaceholder] = (),
        postprocess_fn: Callable[..., Any] | None = None,
        metric_fns: Sequence[Callable[..., Mapping[str, float]]] = (),
    ):
        if not _NAME_RE.match(name):
            raise ValueError(f"Task name {name!r} may contain only letters, digits and _.:-")
        self.name = name
        self.source = source
        self.output_features = dict(output_features)
        placeholders = [i for i, p in enumerate(preprocessors) if _is_placeholder(p)]
        if len(placeholders) > 1:
            raise ValueError(f"Task {name!r}: at most one CacheDatasetPlaceholder allowed")
        cut = placeholders[0] if placeholders else 0
        procs = list(preprocessors)
        self.pre_cache_preprocessors: list[Preprocessor] = procs[:cut]  # type: ignore[assignment]
        self.post_cache_preprocessors: list[Preprocessor] = [  # type: ignore[misc]
            p for p in procs[cut:] if not _is_placeholder(p)
        ]
        self.supports_caching = bool(placeholders)
        self.postprocess_fn = postprocess_fn
        self.metric_fns = list(metric_fns)

    def __repr__(self) -> str:
        return f"Task({self.name!r})"

    @property
    def splits(self) -> Sequence[str]:
        """Split names of the source."""
        return self.source.splits

    def num_input_examples(self, split: str) -> int:
        """Number of raw examples in `split`."""
        return self.source.num_examples(split)

    def fingerprint(self, split: str, cached: sources_lib.DataSource | None = None) -> str:
        """Identity of this task's data and preprocessing for `split`; with `cached` (the task's
        offline cache, `cache.cached_source(task)`), of the cached data and the post-cache
        preprocessors."""
        procs = [preprocessor_name(p) for p in self.post_cache_preprocessors]
        if cached is not None:
            base = cached.fingerprint(split)
        else:
            base = self.source.fingerprint(split)
            procs = [preprocessor_name(p) for p in self.pre_cache_preprocessors] + procs
        feats = {k: (f.vocabulary.fingerprint, f.add_eos) for k, f in self.output_features.items()}
        return sources_lib._hash(self.name, base, procs, sorted(feats.items()))

    def preprocess_pre_cache(self, example: Example, index: int) -> Example | None:
        """Runs the pre-cache preprocessors; `rng` depends only on the source index."""
        rng = np.random.default_rng([0x5E910, index])
        for fn in self.pre_cache_preprocessors:
            example = call_preprocessor(
                fn, example, sequence_length=None, output_features=self.output_features, rng=rng
            )
            if example is None:
                return None
        return example

    @property
    def post_cache_uses_rng(self) -> bool:
        """Whether a post-cache preprocessor takes `rng` (else its output is a function of the
        example alone, and the loader draws no generator for it)."""
        return any("rng" in accepted_kwargs(fn) for fn in self.post_cache_preprocessors)

    def preprocess_post_cache(
        self,
        example: Example,
        rng: np.random.Generator | None,
        sequence_length: Mapping[str, int] | None,
    ) -> Example | None:
        """Runs the remaining preprocessors and checks the required features are present."""
        return self.post_cache_fn(sequence_length)(example, rng)

    def post_cache_fn(
        self, sequence_length: Mapping[str, int] | None
    ) -> Callable[[Example, np.random.Generator | None], Example | None]:
        """`preprocess_post_cache` for one `sequence_length`, each preprocessor's keyword
        arguments bound once rather than looked up per example: the loader calls it for every
        example, on the thread that also feeds the devices."""
        steps = []
        for fn in self.post_cache_preprocessors:
            names = accepted_kwargs(fn)
            static = {"sequence_length": sequence_length, "output_features": self.output_features}
            static = {k: v for k, v in static.items() if k in names}
            steps.append((functools.partial(fn, **static) if static else fn, "rng" in names))
        required = [k for k, f in self.output_features.items() if f.required]

        def run(example: Example, rng: np.random.Generator | None) -> Example | None:
            for fn, wants_rng in steps:
                example = fn(example, rng=rng) if wants_rng else fn(example)
                if example is None:
                    return None
            for k in required:
                if k not in example:
                    missing = [k for k in required if k not in example]
                    raise ValueError(
                        f"Task {self.name!r}: example lacks required feature(s) {missing} after "
                        f"preprocessing (has {sorted(example)})"
                    )
            return example

        return run


def _is_placeholder(p: Any) -> bool:
    return isinstance(p, CacheDatasetPlaceholder) or p is CacheDatasetPlaceholder


# --------------------------------------------------------------------------------------------
# Mixtures
# --------------------------------------------------------------------------------------------

RateFn = Callable[[Task], float]


def rate_num_examples(
    scale: float = 1.0,
    temperature: float = 1.0,
    maximum: int | None = None,
    split: str = "train",
) -> RateFn:
    """Rate proportional to `(scale * min(num_examples, maximum)) ** (1 / temperature)`."""

    def rate(task: Task) -> float:
        n = task.num_input_examples(split)
        if maximum is not None:
            n = min(n, maximum)
        return (scale * n) ** (1.0 / temperature)

    return rate


def rate_unsupervised(task: Task) -> float:
    """Equal rates."""
    del task
    return 1.0


class Mixture:
    """Several tasks sampled at given rates (numbers or `RateFn`s).

    Args:
      name: unique name.
      tasks: task names or objects, or `(task, rate)` pairs.
      default_rate: rate for tasks given without one.
    """

    def __init__(
        self,
        name: str,
        tasks: Sequence[str | Task | tuple[str | Task, float | RateFn]],
        default_rate: float | RateFn | None = None,
    ):
        self.name = name
        self._entries: list[tuple[str | Task, float | RateFn]] = []
        for t in tasks:
            if isinstance(t, tuple):
                self._entries.append(t)
            elif default_rate is None:
                raise ValueError(f"Mixture {name!r}: task {t!r} has no rate and no default_rate")
            else:
                self._entries.append((t, default_rate))
        if not self._entries:
            raise ValueError(f"Mixture {name!r} has no tasks")

    @property
    def tasks(self) -> list[Task]:
        """The member tasks (sub-mixtures are flattened)."""
        return [t for t, _ in self.tasks_and_rates()]

    def tasks_and_rates(self) -> list[tuple[Task, float]]:
        """Member tasks with their normalised rates (summing to 1); sub-mixtures flattened."""
        out: list[tuple[Task, float]] = []
        for entry, rate in self._entries:
            obj = get_task_or_mixture(entry) if isinstance(entry, str) else entry
            if isinstance(obj, Mixture):
                r = float(rate) if not callable(rate) else 1.0
                out.extend((t, r * w) for t, w in obj.tasks_and_rates())
            else:
                out.append((obj, float(rate(obj)) if callable(rate) else float(rate)))
        total = sum(r for _, r in out)
        if total <= 0 or any(r < 0 or math.isnan(r) for _, r in out):
            raise ValueError(f"Mixture {self.name!r}: rates must be >= 0 with a positive sum")
        return [(t, r / total) for t, r in out if r > 0]

    def __repr__(self) -> str:
        return f"Mixture({self.name!r})"


# --------------------------------------------------------------------------------------------
# Registries
# --------------------------------------------------------------------------------------------


class UnknownNameError(KeyError, ValueError):
    """An unregistered task or mixture name; the message suggests the closest registered one.

    A KeyError for seqio compatibility and a ValueError so that a CLI reports it as a user's
    mistake; `str()` is the message itself (KeyError's would quote it).
    """

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def _unknown(kind: str, name: str, known: list[str]) -> UnknownNameError:
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return UnknownNameError(f"no {kind} named {name!r}{hint} (registered: {', '.join(known)})")


class _Registry:
    """Name -> object, with clear errors for duplicates and unknown names."""

    def __init__(self, kind: str):
        self._kind = kind
        self._items: dict[str, Any] = {}

    def add(self, obj: Any, overwrite: bool = False) -> Any:
        if obj.name in self._items and not overwrite:
            raise ValueError(f"{self._kind} {obj.name!r} is already registered")
        self._items[obj.name] = obj
        return obj

    def get(self, name: str) -> Any:
        if name not in self._items:
            raise _unknown(self._kind.lower(), name, sorted(self._items))
        return self._items[name]

    def remove(self, name: str) -> None:
        self._items.pop(name, None)

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        return name in self._items


TaskRegistry = _Registry("Task")
MixtureRegistry = _Registry("Mixture")


def get_task_or_mixture(name_or_obj: str | Task | Mixture) -> Task | Mixture:
    """Looks a name up in the registries (mixtures first); objects pass through."""
    if not isinstance(name_or_obj, str):
        return name_or_obj
    if name_or_obj in MixtureRegistry:
        return MixtureRegistry.get(name_or_obj)
    if name_or_obj in TaskRegistry:
        return TaskRegistry.get(name_or_obj)
    raise _unknown(
        "task or mixture", name_or_obj, sorted(TaskRegistry.names() + MixtureRegistry.names())
    )
