"""The model directory of a training run: one run at a time, and what makes it stand alone.

`acquire_lock` takes the directory's run lock (`run_lock.RunLock`) for the whole run;
`write_run_files` writes the operative config (`config.gin`) and a copy of the task's
SentencePiece models (`vocabulary/`), so the directory is usable without the files it was trained
from; `run_info` is what every checkpoint records for `t5lite convert` and other readers.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import jax

import seqio_lite
from t5lite import distributed
from t5lite.checkpoint.layout import read_extra
from t5lite.model.config import config_record
from t5lite.programs.run_lock import RunLock, RunLockError
from t5lite.programs.train_loop import TrainingError


def acquire_lock(model_dir: str, stack: contextlib.ExitStack) -> None:
    """Process 0 takes the model directory's run lock (released when `stack` closes); every
    process learns whether it could."""
    lock, error = None, None
    if jax.process_index() == 0:
        try:
            lock = RunLock(model_dir).acquire()
        except RunLockError as e:
            error = e
    if jax.process_count() > 1:
        refused = distributed.broadcast_from_chief(error is not None)
        if refused and error is None:
            error = RunLockError(f"{model_dir} is in use by another run (see process 0)")
    if error is not None:
        raise error
    if lock is not None:
        stack.callback(lock.release)


def write_run_files(model_dir: str, operative_config: Callable[[], str] | None, task: str) -> None:
    """`config.gin`, and a copy of every SentencePiece model the task's features use under
    `vocabulary/`; a copy already there that differs is an error (never replaced)."""
    os.makedirs(model_dir, exist_ok=True)
    if operative_config is not None:
        with open(os.path.join(model_dir, "config.gin"), "w") as f:
            f.write(operative_config())
    obj = seqio_lite.get_task_or_mixture(task)
    for t in obj.tasks if isinstance(obj, seqio_lite.Mixture) else [obj]:
        for feature in t.output_features.values():
            vocab = feature.vocabulary
            if isinstance(vocab, seqio_lite.SentencePieceVocabulary):
                _copy_vocabulary(model_dir, vocab, t.name)


def _copy_vocabulary(model_dir: str, vocab: Any, task_name: str) -> None:
    dest = os.path.join(model_dir, "vocabulary", os.path.basename(vocab.model_file))
    if os.path.exists(dest):
        with open(dest, "rb") as f:
            if f.read() != vocab.model_bytes:  # never replace what the model learned
                raise TrainingError(
                    f"{dest} differs from task {task_name!r}'s vocabulary "
                    f"{vocab.model_file}: this model was trained with another one"
                )
        return
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    with open(dest + ".tmp", "wb") as f:
        f.write(vocab.model_bytes)
    os.replace(dest + ".tmp", dest)


def run_info(seed: int, model: Any, init_checkpoint: str | None) -> dict[str, Any]:
    """What every checkpoint of the run records beside the state: the seed, the network config,
    the token ids (`t5lite convert` writes them back as the HF pad / EOS / start ids), LoRA
    settings (to merge adapters on export) and an imported model's original HF ids."""
    ids = {k: getattr(model, k) for k in ("pad_id", "eos_id", "decoder_start_token_id")}
    info = {"seed": seed, "network_config": config_record(model.network_config), "token_ids": ids}
    if model.lora is not None:
        info["lora"] = asdict(model.lora)
    if init_checkpoint:
        hf_ids = read_extra(pathlib.Path(init_checkpoint)).get("hf_token_ids")
        info.update({"hf_token_ids": hf_ids} if hf_ids is not None else {})
    return info
