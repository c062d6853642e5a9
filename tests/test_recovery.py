"""Recovery from bad steps (`t5lite.programs.recovery`): spikes and non-finite steps roll back to
a checkpoint known to be good, within `RecoveryConfig`'s limits; a run that ends stalled says so
however short it is; and, through the CLI, a run diverged at learning rate 1e6 stops naming a
checkpoint from which a rerun at the normal learning rate trains to the end."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from conftest import QUICK_TRAIN, require_devices, run_cli

from t5lite.checkpoint import CheckpointManager
from t5lite.checkpoint.layout import read_extra
from t5lite.programs.configs import RecoveryConfig
from t5lite.programs.recovery import HealthCheck, Rollback
from t5lite.programs.train_hooks import StallDetector
from t5lite.programs.train_loop import StepMetrics, TrainingError

UNIFORM = math.log(384)


class _Writer:
    def __init__(self):
        self.lines: list[str] = []

    def info(self, text: str) -> None:
        self.lines.append(text)


def _m(step, loss, grad_norm=1.0, finite=True, last=False):
    values = {"loss": loss, "z_loss": 0.0, "grad_norm": grad_norm}
    return StepMetrics(step, values, np.array([finite, True]), {}, last=last, final=last)


def _save(ckpt, health, step):
    tree = {"w": np.full([2], float(step), np.float32)}
    ckpt.save(step, tree, extra=health.good.record())
    health.saved(step)


def test_a_spike_rolls_back_to_the_newest_confirmed_checkpoint_then_the_run_stops(tmp_path):
    ckpt = CheckpointManager(tmp_path, keep=2)
    writer = _Writer()
    config = RecoveryConfig(
        max_rollbacks=1, spike_factor=2.0, spike_window=20, good_after_steps=2, skip_batches=3
    )
    health = HealthCheck(config, ckpt, ["w", "b"], StallDetector(384, 0, ckpt), writer)
    health.started(0)
    for step in range(1, 26):
        health(_m(step, 3.0 - 0.01 * step))
        if step in (2, 10, 25):
            _save(ckpt, health, step)
    # 2 and 10 were each followed by two healthy steps; 25 by none yet. The keep policy (2)
    # keeps 10, the newest good one, beside 25 and deletes 2.
    ckpt.wait()
    assert ckpt.all_steps() == [10, 25] and ckpt.protected == {10}
    assert health.good.newest_before(26) == 10
    assert read_extra(ckpt.step_dir(25))["good_checkpoints"] == [2, 10]
    median = float(np.median([3.0 - 0.01 * s for s in range(6, 26)]))  # the last 20 losses
    with pytest.raises(Rollback) as r:
        health(_m(26, 2.01 * median))
    assert (r.value.bad_step, r.value.to, r.value.skip) == (26, 10, 26 - 10 + 3)
    why = (
        f"step 26 is a loss spike (loss {2.01 * median:.4g} > 2 x the median {median:.4g} of "
        "the last 20 healthy steps)"
    )
    assert writer.lines == [
        f"warning: {why}; rollback 1 of 1: back to {tmp_path / 'checkpoint_10'}, skipping 19 "
        f"batches (newer checkpoints moved to {tmp_path / 'rolled_back_1'})"
    ]
    assert ckpt.all_steps() == [10] and (tmp_path / "rolled_back_1" / "checkpoint_25").is_dir()
    # Restarted from 10: the median starts afresh (no spike is called on 19 losses), a stalled
    # step confirms nothing, and the next bad step is past the limit: the run stops.
    health.started(10)
    for step in range(11, 30):
        health(_m(step, 100.0 if step < 29 else UNIFORM, grad_norm=1.0 if step < 29 else 0.0))
    with pytest.raises(TrainingError) as e:
        health(_m(30, float("nan"), finite=False))
    assert str(e.value) == (
        "step 30 is not finite (loss nan, gradient norm 1, 1 non-finite parameter arrays, first "
        f"'params/w') after 1 rollback; it was not saved. The last good checkpoint is "
        f"{tmp_path / 'checkpoint_10'}: a rerun resumes from it; lower the learning rate or clip "
        "more strongly"
    )


def test_without_a_confirmed_checkpoint_the_run_stops_and_sets_the_unconfirmed_aside(tmp_path):
    ckpt = CheckpointManager(tmp_path)
    health = HealthCheck(RecoveryConfig(), ckpt, ["w", "b"], StallDetector(384, 0, ckpt), _Writer())
    health.started(0)
    health(_m(1, 3.0))
    _save(ckpt, health, 1)
    with pytest.raises(TrainingError) as e:  # step 2's loss is of checkpoint 1's parameters
        health(_m(2, float("inf")))
    assert str(e.value) == (
        "step 2 is not finite (loss inf, gradient norm 1); it was not saved. The last good "
        "checkpoint is none (none was followed by a healthy step; moved to "
        f"{tmp_path / 'rolled_back_1'}): a rerun starts afresh; lower the learning rate or clip "
        "more strongly"
    )
    assert ckpt.all_steps() == []


def test_a_run_that_ends_stalled_says_so_however_short():
    class Ckpt:
        def latest_step(self):
            return 3

    stall = StallDetector(384, 200, Ckpt(), stop_text=lambda since: f"good before {since}")
    for m in [_m(1, 5.0), _m(2, UNIFORM, 0.0), _m(3, UNIFORM, 0.0, last=True)]:
        stall(m)
    assert stall.annotation(_m(3, UNIFORM, 0.0, last=True)) == {"stalled_since": 2}
    assert stall.annotation(_m(3, UNIFORM, 0.0)) == {}
    with pytest.raises(TrainingError) as e:
        stall.end_of_run(final=True, writer=_Writer())
    assert str(e.value) == (
        "the run ended stalled: cross-entropy 5.9506 = ln(vocab_size) (uniform predictions) "
        "with zero gradients from step 2 to its last step 3; good before 2. Lower the learning "
        "rate, or set train.max_stalled_steps=0 to end with a warning"
    )
    # Preempted (not the final step), or with the stall check off: a warning, no error.
    for final, patience in [(False, 200), (True, 0)]:
        warned = StallDetector(384, patience, Ckpt())
        for m in [_m(1, UNIFORM, 0.0), _m(2, UNIFORM, 0.0, last=True)]:
            warned(m)
        writer = _Writer()
        warned.end_of_run(final=final, writer=writer)
        assert writer.lines == [
            "warning: the run ended stalled: cross-entropy 5.9506 = ln(vocab_size) (uniform "
            "predictions) with zero gradients from step 1 to its last step 2"
        ]
    # One stalled last step is not a stall yet.
    once = StallDetector(384, 200, Ckpt())
    once(_m(1, 5.0))
    once(_m(2, UNIFORM, 0.0, last=True))
    once.end_of_run(final=True, writer=_Writer())
    assert once.ended_stalled is None


def test_a_run_diverged_at_lr_1e6_names_a_checkpoint_a_rerun_trains_from(tmp_path, capsys):
    require_devices(8)
    d = tmp_path / "run"
    args = [*QUICK_TRAIN, f"--gin.MODEL_DIR='{d}'"]
    assert run_cli("train", *args, "--gin.TRAIN_STEPS=4", "--gin.CheckpointConfig.period=2") == 0
    capsys.readouterr()
    # Step 5's update leaves finite but useless parameters: from step 6 on the model predicts
    # the uniform distribution with zero gradients, for far fewer steps than the stall window.
    rc = run_cli(
        "train",
        *args,
        "--gin.TRAIN_STEPS=10",
        "--gin.CheckpointConfig.period=1",
        "--gin.warmup_cosine_schedule.peak_learning_rate=1e6",
    )
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 1
    assert err == (
        "t5lite train: error: the run ended stalled: cross-entropy 5.9506 = ln(vocab_size) "
        "(uniform predictions) with zero gradients from step 6 to its last step 10; the last good "
        f"checkpoint is {d / 'checkpoint_4'} (newer checkpoints moved to {d / 'rolled_back_1'}): "
        "a rerun resumes from it. Lower the learning rate, or set train.max_stalled_steps=0 to "
        "end with a warning"
    )
    records = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 10 and records[-1]["stalled_since"] == 6
    assert sum("stalled_since" in r for r in records) == 1
    # The rerun at the normal learning rate resumes from it and trains to the end.
    assert run_cli("train", *args, "--gin.TRAIN_STEPS=10") == 0
    assert f"resumed from {d / 'checkpoint_4'}" in capsys.readouterr().err
    records = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 10 and records[-1]["loss"] < UNIFORM - 0.5
    assert "stalled_since" not in records[-1]


def test_a_transient_bad_step_rolls_back_skips_its_batches_and_the_run_finishes(
    tmp_path, capsys, monkeypatch
):
    """A step whose loss is NaN once (its batch, say): back to the newest good checkpoint, the
    batches of the rolled-back steps skipped, and the run goes on to its last step (exit 0)."""
    import jax.numpy as jnp

    import t5lite.programs.train as train_program

    require_devices(8)
    args = [*QUICK_TRAIN, "--gin.CheckpointConfig.period=2"]
    ref = tmp_path / "ref"
    assert run_cli("train", *args, "--gin.TRAIN_STEPS=12", f"--gin.MODEL_DIR='{ref}'") == 0

    class Poisoned(train_program.Trainer):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            step_fn, calls = self.train_step, []

            def train_step(state, batch):
                state, metrics = step_fn(state, batch)
                calls.append(None)
                if len(calls) == 6:  # the first dispatch of step 6
                    metrics = {**metrics, "loss_sum": metrics["loss_sum"] * jnp.nan}
                return state, metrics

            self.train_step = train_step

    monkeypatch.setattr(train_program, "Trainer", Poisoned)
    d = tmp_path / "run"
    capsys.readouterr()
    assert run_cli("train", *args, "--gin.TRAIN_STEPS=10", f"--gin.MODEL_DIR='{d}'") == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warnings == [
        "warning: step 6 is not finite (loss nan, gradient norm "
        + warnings[0].split("gradient norm ")[1].split(")")[0]
        + f"); rollback 1 of 3: back to {d / 'checkpoint_4'}, skipping 2 batches"
    ]

    def tokens(model_dir):
        lines = (model_dir / "metrics.jsonl").read_text().splitlines()
        return [(r["step"], r["target_tokens"]) for r in map(json.loads, lines)]

    want = tokens(ref)  # steps 1..12 on the batches 1..12
    got = tokens(d)
    # Steps 1-5, then from checkpoint 4 again: steps 5-10 on batches 7-12 (5 and 6 skipped).
    assert [s for s, _ in got] == [1, 2, 3, 4, 5, 5, 6, 7, 8, 9, 10]
    assert [t for _, t in got] == [t for _, t in want[:5] + want[6:]]
    assert [t for _, t in want[4:10]] != [t for _, t in want[6:]]  # the batches tell apart
    assert sorted(p.name for p in d.glob("checkpoint_*")) == [
        "checkpoint_10",
        "checkpoint_6",
        "checkpoint_8",
    ]
