"""lm-evaluation-harness tasks for t5lite models, offline: `t5lite eval` and during `train`.

Tasks are harness YAML files under `HarnessConfig.include_path` whose data are local files
(`dataset_path: json|csv|parquet|text` with `dataset_kwargs.data_files`, paths relative to the
YAML's folder). `prepare` checks them before anything slow: a task that is not there, one that
would download (a Hugging Face hub `dataset_path`, a URL) and a data file that does not exist are
each one error naming it. `run_harness` evaluates a `harness_lm.T5LiteLM` with lm-eval's
`simple_evaluate` and records the metrics as the other evaluations do: metrics.jsonl and
TensorBoard (`eval/<task>/<metric>`), and one line per task in `MODEL_DIR/eval/<task>/<split>.jsonl`
(`evaluate.read_eval_results`). Needs the `[eval]` extra.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import glob
import os
from collections.abc import Sequence
from typing import Any

from t5lite.programs import metrics_writer as mw

LOCAL_BUILDERS = ("json", "csv", "parquet", "text", "arrow")
_NONE_FILTER = ",none"


@dataclasses.dataclass(frozen=True)
class HarnessConfig:
    """Which lm-eval tasks to run, and how."""

    tasks: Sequence[str]
    """Task (or group) names defined by the YAML files under `include_path`."""
    include_path: str | None = None
    """Folder of task YAML files (searched recursively); data paths are relative to each YAML."""
    period: int = 0
    """Train: run the tasks every this many steps (0: only after the last step)."""
    num_fewshot: int | None = None
    """Few-shot examples per prompt (None: each task's own setting)."""
    limit: int | None = None
    """The first N documents of each task (None: all)."""
    batch_size: int = 8
    """Rows per compiled batch (a multiple of the data-parallel size)."""
    max_length: int = 512
    """Tokens per row at most; longer contexts lose their start."""
    max_gen_toks: int = 256
    """Tokens generated when a task's `generation_kwargs` do not say."""
    tokenizer: str | None = None
    """A folder of Hugging Face tokenizer files (None: the model's own vocabulary)."""
    vocabulary: Any = None
    """A seqio_lite vocabulary (None: the model's own)."""
    bootstrap_iters: int = 0
    """lm-eval's bootstrap resamples for standard errors (0: none, the fast choice)."""
    seed: int | None = None
    """The seed of sampled generation (tasks with `do_sample: true`); None: the training run's
    seed during training, 0 in `t5lite eval`."""


@dataclasses.dataclass(frozen=True)
class PreparedTasks:
    """Checked tasks: lm-eval's task manager and each task's YAML folder."""

    manager: Any
    folders: dict[str, str]


class HarnessError(ValueError):
    """A harness task that cannot run offline (named in the message)."""


def _lm_eval() -> Any:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # before `datasets` reads its settings
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import lm_eval.evaluator
        import lm_eval.tasks
    except ImportError:
        raise HarnessError(
            "lm-eval tasks need the [eval] extra: pip install 't5lite[eval]'"
        ) from None
    return lm_eval


def prepare(config: HarnessConfig) -> PreparedTasks:
    """Indexes `config.include_path` and checks that every task runs offline (fast: nothing is
    read but the YAML files)."""
    lm_eval = _lm_eval()
    if not config.tasks:
        raise HarnessError("HarnessConfig.tasks is empty: name at least one lm-eval task")
    include = _include_dir(config.include_path) if config.include_path else None
    # Built-in tasks are not indexed: they all download their data (and indexing takes ~20 s).
    manager = lm_eval.tasks.TaskManager(include_path=include, include_defaults=False)
    folders: dict[str, str] = {}
    for name in config.tasks:
        _check_task(manager, name, config.include_path, folders)
    return PreparedTasks(manager, folders)


def _include_dir(path: str) -> str:
    """`path`, else the same path under the packaged configs/ (as gin files are found)."""
    here = os.path.dirname(os.path.abspath(__file__))
    packaged = [os.path.join(here, "..", "configs"), os.path.join(here, "..", "..", "configs")]
    for base in [os.getcwd(), *packaged]:
        full = os.path.normpath(os.path.join(base, path))
        if os.path.isdir(full):
            return full
    raise HarnessError(
        f"HarnessConfig.include_path {path} does not exist (nor under the packaged configs/)"
    )


def _check_task(manager: Any, name: str, include: str | None, folders: dict[str, str]) -> None:
    entry = manager.task_index.get(name)
    if entry is None:
        where = f"in {include}" if include else "(HarnessConfig.include_path is not set)"
        raise HarnessError(
            f"harness task {name!r} is not defined {where}; lm-eval's built-in tasks download "
            "their data from the Hugging Face hub, which an offline evaluation cannot: define "
            "it as a task YAML over local JSON/JSONL files (docs/lm-eval.md)"
        )
    cfg = entry.cfg or {}
    yaml_path = str(entry.yaml_path) if entry.yaml_path else "?"
    folders[name] = os.path.dirname(yaml_path)
    if entry.kind.name != "TASK":  # a group or tag: check what it names
        children = cfg.get("task", [])
        for child in children if isinstance(children, list) else [children]:
            if isinstance(child, str):
                _check_task(manager, child, include, folders)
        return
    if cfg.get("output_type") == "generate_until" and cfg.get("generation_kwargs"):
        from t5lite.programs.harness_gen import generation

        try:  # the settings generate_until will read, checked before anything is restored
            generation(cfg["generation_kwargs"], 1)
        except ValueError as e:
            raise HarnessError(f"harness task {name!r} ({yaml_path}): {e}") from None
    path = cfg.get("dataset_path")
    if cfg.get("custom_dataset") is None and path not in LOCAL_BUILDERS:
        raise HarnessError(
            f"harness task {name!r} needs the network: dataset_path {path!r} ({yaml_path}) is "
            f"a Hugging Face hub dataset; use a local one ({', '.join(LOCAL_BUILDERS)}) with "
            "dataset_kwargs.data_files"
        )
    data_files = (cfg.get("dataset_kwargs") or {}).get("data_files")
    if path in LOCAL_BUILDERS and not data_files:
        raise HarnessError(f"harness task {name!r} ({yaml_path}): no dataset_kwargs.data_files")
    for f in _paths(data_files):
        if "://" in f:
            raise HarnessError(f"harness task {name!r} needs the network: data file {f}")
        full = os.path.join(folders[name], f)
        if not glob.glob(full):
            raise HarnessError(
                f"harness task {name!r}: data file {full} does not exist ({yaml_path})"
            )


def _paths(data_files: Any) -> list[str]:
    if isinstance(data_files, str):
        return [data_files]
    if isinstance(data_files, dict):
        return [p for v in data_files.values() for p in _paths(v)]
    return [p for v in data_files or [] for p in _paths(v)]


def load_tasks(prepared: PreparedTasks) -> list[Any]:
    """lm-eval's task objects; each reads its data files relative to its YAML's folder."""
    built: list[Any] = []
    for name, folder in prepared.folders.items():
        with contextlib.chdir(folder):
            loaded = prepared.manager.load([name])
        built.extend(loaded["groups"].values() or loaded["tasks"].values())
    # A group's tasks were added with it: keep top-level objects only, once each.
    seen, out = set(), []
    for obj in built:
        key = getattr(obj, "name", None) or obj.task_name
        if key not in seen:
            seen.add(key)
            out.append(obj)
    return out


def run_harness(
    lm: Any,
    config: HarnessConfig,
    prepared: PreparedTasks,
    *,
    writer: mw.MetricsWriter,
    step: int,
) -> dict[str, float]:
    """Runs the tasks on `lm`; writes and returns `{"<task>/<metric>": value}`."""
    evaluator = _lm_eval().evaluator
    tasks = load_tasks(prepared)
    results = evaluator.simple_evaluate(
        model=lm,
        tasks=tasks,
        num_fewshot=config.num_fewshot,
        limit=config.limit,
        bootstrap_iters=config.bootstrap_iters,
        task_manager=prepared.manager,
        log_samples=False,
        verbosity="WARNING",
    )
    if results is None:  # only process 0 gets results (lm-eval's rank 0)
        return {}
    out: dict[str, float] = {}
    when = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    splits = _splits(tasks)
    version = getattr(_lm_eval(), "__version__", "?")
    for task, metrics in results["results"].items():
        numbers = _metrics(metrics)
        out.update({f"{task}/{k}": v for k, v in numbers.items()})
        record = {
            "step": step,
            "task": task,
            "split": splits.get(task, "test"),
            "metrics": numbers,
            "harness": f"lm-eval {version}",
            "num_fewshot": results.get("n-shot", {}).get(task),
            "time": when,
        }
        writer.append_jsonl(os.path.join("eval", task, f"{record['split']}.jsonl"), record)
    writer.write(step, out, prefix="eval")
    return out


def _metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """`acc,none` -> `acc`; another filter's metric keeps its name: `exact_match/strict`."""
    out = {}
    for k, v in metrics.items():
        if isinstance(v, int | float) and not isinstance(v, bool) and "," in k:
            out[k.replace(_NONE_FILTER, "").replace(",", "/")] = float(v)
    return out


def _splits(tasks: list[Any]) -> dict[str, str]:
    """Each leaf task's evaluated split (lm-eval: test if it has one, else validation)."""
    out = {}
    for obj in tasks:
        leaves = obj.get_all_tasks() if hasattr(obj, "get_all_tasks") else [obj]
        for t in leaves:
            cfg = t.config
            out[t.task_name] = cfg.test_split or cfg.validation_split or "test"
    return out


def make_lm(
    model: Any,
    partitioner: Any,
    params: Any,
    tokens: Any,
    config: HarnessConfig,
    seed: int = 0,
) -> Any:
    """A `harness_lm.T5LiteLM` for `model` with `params`, sized by `config`; it samples with
    `config.seed`, else `seed`."""
    _lm_eval()
    from t5lite.programs.harness_lm import T5LiteLM

    return T5LiteLM(
        model,
        params,
        tokens,
        partitioner=partitioner,
        batch_size=config.batch_size,
        max_length=config.max_length,
        max_gen_toks=config.max_gen_toks,
        seed=seed if config.seed is None else config.seed,
    )


def checkpoint_dir(model_dir: str, checkpoint_step: int | None = None) -> tuple[str, int]:
    """A committed checkpoint of `model_dir` (the latest by default) and its step."""
    from t5lite.checkpoint import CheckpointManager

    ckpt = CheckpointManager(model_dir)
    try:
        step = ckpt.latest_step() if checkpoint_step is None else checkpoint_step
        if step is None or step not in ckpt.all_steps():
            which = "no committed checkpoint" if step is None else f"no checkpoint {step}"
            raise HarnessError(f"{model_dir} has {which}")
        return str(ckpt.step_dir(step)), step
    finally:
        ckpt.close()


def restore_params(model: Any, partitioner: Any, checkpoint: str, batch_size: int) -> Any:
    """The parameters of a `checkpoint_<step>` directory, laid out on `partitioner`'s mesh as
    the harness's trainers lay them out (the optimizer it was trained with is not needed)."""
    from t5lite.checkpoint import restore_checkpoint
    from t5lite.trainer import Trainer

    lengths = {"inputs": 8, "targets": 8} if model.feature_converter_name == "enc_dec" else {}
    trainer = Trainer(model, partitioner, batch_size=batch_size, lengths=lengths or {"targets": 8})
    state, _ = restore_checkpoint(
        checkpoint, {"params": trainer.abstract_state().params}, with_extra=False
    )
    return state["params"]


def evaluate_checkpoint(
    *,
    model_dir: str,
    model: Any,
    partitioner: Any,
    config: HarnessConfig,
    checkpoint_step: int | None = None,
    prepared: PreparedTasks | None = None,
) -> dict[str, float]:
    """`t5lite eval` with harness tasks: runs them on a checkpoint of `model_dir` (the latest
    by default) and records the metrics there."""
    import jax

    from t5lite.programs.harness_tokens import find_tokens

    prepared = prepared or prepare(config)
    path, step = checkpoint_dir(model_dir, checkpoint_step)
    tokens = find_tokens(model, path, tokenizer=config.tokenizer, vocabulary=config.vocabulary)
    params = restore_params(model, partitioner, path, config.batch_size)
    lm = make_lm(model, partitioner, params, tokens, config)
    writer = mw.MetricsWriter(model_dir, total_steps=step, enabled=jax.process_index() == 0)
    try:
        return run_harness(lm, config, prepared, writer=writer, step=step)
    finally:
        writer.close()


class HarnessEvaluate:
    """The train loop's state hook: the harness tasks every `HarnessConfig.period` steps and
    after the last, on the current parameters; `last` holds the newest metrics."""

    def __init__(self, config: HarnessConfig, prepared: PreparedTasks, lm: Any, writer: Any):
        self.config, self.prepared, self.lm, self.writer = config, prepared, lm, writer
        self.last: dict[str, float] = {}

    def due(self, info: Any) -> bool:
        return info.final or bool(self.config.period and info.step % self.config.period == 0)

    def __call__(self, info: Any) -> None:
        self.lm.params = info.state.params  # compiled functions are kept between evaluations
        self.last = run_harness(
            self.lm, self.config, self.prepared, writer=self.writer, step=info.step
        )


def train_hook(
    config: HarnessConfig,
    prepared: PreparedTasks,
    model: Any,
    partitioner: Any,
    task: str,
    writer: Any,
    seed: int = 0,
) -> HarnessEvaluate:
    """The train loop's harness evaluation; the vocabulary is `config`'s, else the training
    task's targets vocabulary."""
    import seqio_lite
    from t5lite.programs.harness_tokens import find_tokens

    vocab = config.vocabulary
    if vocab is None and config.tokenizer is None:
        obj = seqio_lite.get_task_or_mixture(task)
        first = obj.tasks[0] if isinstance(obj, seqio_lite.Mixture) else obj
        vocab = first.output_features["targets"].vocabulary
    tokens = find_tokens(model, "", tokenizer=config.tokenizer, vocabulary=vocab)
    lm = make_lm(model, partitioner, None, tokens, config, seed=seed)
    return HarnessEvaluate(config, prepared, lm, writer)
