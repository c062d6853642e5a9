"""A diverging run never commits a non-finite state, names the true last good checkpoint, and a
run that silently stopped learning ends with an error; non-finite checkpoints are not restored."""

from __future__ import annotations

import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import QUICK_TRAIN, file_checksums, require_devices, run_cli

import t5lite.programs.train as train_program
from t5lite.checkpoint import CheckpointError, CheckpointManager, restore_checkpoint
from t5lite.programs import train_hooks
from t5lite.pytree import finite_by_array


def test_finite_by_array_matches_numpy_element_by_element():
    big = np.finfo(np.float32).max
    tree = {
        "a_nan": np.array([1.0, np.nan, 2.0], np.float32),
        "b_inf": np.array([[1.0, np.inf]], np.float32),
        "c_both_infs": np.array([np.inf, -np.inf], np.float32),  # sum NaN
        "d_overflowing_sum": np.full([4], big, np.float32),  # finite values, sum inf: finite
        "e_ok": np.arange(6, dtype=np.float32).reshape(2, 3),
        "f_bf16_nan": jnp.array([1.0, np.nan], jnp.bfloat16),
        "g_bf16_overflowing_sum": jnp.full([4], 3e38, jnp.bfloat16),
        "h_ints": np.array([1, 2], np.int32),  # not inexact: no flag
        "i_ok_scalar": np.float32(3.0),
    }
    want = [
        bool(np.isfinite(np.asarray(x, np.float32)).all())
        for k, x in sorted(tree.items())
        if k != "h_ints"
    ]
    assert want == [False, False, False, True, True, False, True, True]
    assert np.asarray(jax.jit(finite_by_array)(tree)).tolist() == want
    assert np.asarray(jax.jit(finite_by_array)({"e_ok": tree["e_ok"]})).tolist() == [True]
    assert np.asarray(finite_by_array({"h_ints": tree["h_ints"]})).shape == (0,)


def _committed(model_dir: Path) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in model_dir.glob("checkpoint_*[0-9]"))


def test_diverging_run_never_commits_a_non_finite_state(tmp_path, capsys):
    require_devices(8)
    d = tmp_path / "run"
    # A short healthy run, then the same run continued with an exploding learning rate and no
    # clipping, saving after every step: the first non-finite step must not be saved.
    assert run_cli("train", *QUICK_TRAIN, "--gin.TRAIN_STEPS=4", "--gin.CheckpointConfig.period=2",
                   f"--gin.MODEL_DIR='{d}'") == 0  # fmt: skip
    before = _committed(d)
    capsys.readouterr()
    rc = run_cli(
        "train", *QUICK_TRAIN, "--gin.TRAIN_STEPS=40", "--gin.CheckpointConfig.period=1",
        "--gin.CheckpointConfig.keep=None", f"--gin.MODEL_DIR='{d}'",
        "--gin.warmup_cosine_schedule.peak_learning_rate=1e30",
    )  # fmt: skip
    lines = capsys.readouterr().err.strip().splitlines()
    err = lines[-1:]  # progress lines come before it
    assert rc == 1 and err[0].startswith("t5lite train: error:"), err
    # Step 5 computes its loss with checkpoint 4's parameters: finite, so checkpoint 4 is good.
    # Its update leaves finite but huge parameters (saved as checkpoint 5), and step 6 is not
    # finite: checkpoint 5 is no good although finite. Three rollbacks to checkpoint 4 each
    # end the same way, then the run stops naming it and moves checkpoint 5 aside.
    rollbacks = [line for line in lines if line.startswith("warning:")]
    assert len(rollbacks) == 3 and all(
        line.startswith("warning: step 6 is not finite (loss ")
        and f"back to {d / 'checkpoint_4'}, skipping 2 batches" in line
        for line in rollbacks
    ), rollbacks
    assert _committed(d) == before == [2, 4]
    assert err[0].startswith("t5lite train: error: step 6 is not finite (loss ")
    assert err[0].endswith(
        f"after 3 rollbacks; it was not saved. The last good checkpoint is {d / 'checkpoint_4'} "
        f"(newer checkpoints moved to {d / 'rolled_back_4'}): a rerun resumes from it; lower "
        "the learning rate or clip more strongly"
    ), err
    assert not any(p.name.endswith(".tmp") for p in d.rglob("*"))
    moved = sorted(p.relative_to(d).as_posix() for p in d.glob("rolled_back_*/checkpoint_*"))
    assert moved == [f"rolled_back_{n}/checkpoint_5" for n in (1, 2, 3, 4)]
    # Every committed checkpoint is finite, the moved ones too: the default restore checks each.
    for path in [d / f"checkpoint_{step}" for step in before] + [d / m for m in moved]:
        tree, _ = restore_checkpoint(path, with_extra=False)
        assert all(np.isfinite(x).all() for x in jax.tree.leaves(tree) if x.dtype.kind == "f")
    # A rerun with the normal learning rate resumes from the named checkpoint and trains on.
    assert run_cli("train", *QUICK_TRAIN, "--gin.TRAIN_STEPS=8", f"--gin.MODEL_DIR='{d}'") == 0
    assert f"resumed from {d / 'checkpoint_4'}" in capsys.readouterr().err
    assert _committed(d)[-1] == 8


def test_a_silently_diverged_run_ends_with_an_error(tmp_path, capsys):
    require_devices(8)
    # Continued with a huge learning rate that leaves every value finite, the model collapses
    # to uniform predictions (loss ln 384 = 5.954) and would train on forever.
    args = [*QUICK_TRAIN, "--gin.CheckpointConfig.period=2", f"--gin.MODEL_DIR='{tmp_path}'"]
    assert run_cli("train", *args, "--gin.TRAIN_STEPS=4") == 0
    rc = run_cli("train", *args, "--gin.TRAIN_STEPS=40", "--gin.train.max_stalled_steps=5",
                 "--gin.warmup_cosine_schedule.peak_learning_rate=1e6")  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 1
    assert err.startswith("t5lite train: error: the model has stopped learning: cross-entropy ")
    assert err.endswith("set train.max_stalled_steps=0 to train on anyway"), err
    assert _committed(tmp_path)[-1] >= 4  # what was saved is kept


def test_non_finite_checkpoint_is_refused_unless_asked(tmp_path):
    state = {"params": {"w": jnp.array([1.0, np.nan]), "b": jnp.zeros(3)}, "step": jnp.int32(3)}
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(3, state)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          state)  # fmt: skip
    with pytest.raises(CheckpointError) as e:
        CheckpointManager(tmp_path).restore(target)
    assert str(e.value) == (
        f"checkpoint {tmp_path / 'checkpoint_3'}: array 'params/w' holds NaN or Inf (a diverged "
        "run?); restore an earlier checkpoint, or pass allow_non_finite=True to read it anyway"
    )
    with pytest.raises(CheckpointError, match="'params/w' holds NaN"):
        restore_checkpoint(tmp_path / "checkpoint_3")  # numpy restore, no target
    got, _ = CheckpointManager(tmp_path).restore(target, allow_non_finite=True)
    assert np.isnan(np.asarray(got["params"]["w"])[1])


class _Ckpt:
    def latest_step(self):
        return 6

    def close(self):
        pass


def _uniform(grad_norm=0.0):
    return {"loss": math.log(384) + 1e-3, "z_loss": 1e-3, "grad_norm": grad_norm}


def test_a_stalled_run_stops_after_its_patience():
    stall = train_hooks.StallDetector(384, 3, _Ckpt())
    stall.check(1, _uniform())
    stall.check(2, _uniform(grad_norm=0.5))  # still learning: the count starts again
    stall.check(3, _uniform())
    stall.check(4, _uniform())
    with pytest.raises(train_program.TrainingError) as e:
        stall.check(5, _uniform())
    assert str(e.value) == (
        "the model has stopped learning: cross-entropy 5.9506 = ln(vocab_size) (uniform "
        "predictions) with zero gradients since step 3; checkpoints are kept (latest: 6). "
        "Lower the learning rate, or set train.max_stalled_steps=0 to train on anyway"
    )


def test_a_learning_run_or_an_opt_out_never_stalls():
    healthy = train_hooks.StallDetector(384, 2, _Ckpt())
    off = train_hooks.StallDetector(384, 0, _Ckpt())
    for step in range(1, 50):
        healthy.check(step, {"loss": 5.0 - step / 100, "z_loss": 0.0, "grad_norm": 1.0})
        off.check(step, _uniform())
    assert healthy.since is None and off.since is None  # no stall counted, nothing raised


def test_a_second_run_on_a_model_directory_is_refused(tmp_path, capsys):
    require_devices(8)
    import json
    import socket
    import subprocess

    args = [*QUICK_TRAIN, "--gin.CheckpointConfig.period=2", f"--gin.MODEL_DIR='{tmp_path}'"]
    assert run_cli("train", *args, "--gin.TRAIN_STEPS=3") == 0
    assert not (tmp_path / "RUN_LOCK").exists()  # released at the end
    before = file_checksums(tmp_path, only="checkpoint_")
    other = subprocess.Popen(["sleep", "60"])  # stands for a live run on this host
    try:
        lock = {"host": socket.gethostname(), "pid": other.pid, "since": 0}
        (tmp_path / "RUN_LOCK").write_text(json.dumps(lock))
        capsys.readouterr()
        assert run_cli("train", *args, "--gin.TRAIN_STEPS=4") == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [
            f"t5lite train: error: {tmp_path} is in use by another run (process {other.pid} on "
            f"{socket.gethostname()}, since 1970-01-01 00:00); wait for it, use another model "
            f"directory, or delete {tmp_path / 'RUN_LOCK'} if that run is gone"
        ]
        assert file_checksums(tmp_path, only="checkpoint_") == before  # nothing written
    finally:
        other.kill()
        other.wait()
    # The owner is gone now: the lock is stale, taken over with a message, and released.
    assert run_cli("train", *args, "--gin.TRAIN_STEPS=4") == 0
    out = capsys.readouterr().out
    assert f"taking over the run lock of {tmp_path}: process {other.pid}" in out
    assert not (tmp_path / "RUN_LOCK").exists() and _committed(tmp_path)[-1] == 4
