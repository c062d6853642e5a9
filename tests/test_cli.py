"""The CLI end to end on fake devices: train, resume bit-identically, eval, infer, errors."""

import json
import os
import re
import subprocess
import sys

import pytest
from conftest import QUICK_TRAIN, require_devices, run_cli

# conftest's quick run (whose fixed schedule shares the compiled train step with the other
# files' quick runs), 6 steps with a save every 3.
QUICK = [*QUICK_TRAIN, "--gin.TRAIN_STEPS=6", "--gin.CheckpointConfig.period=3"]


def losses(model_dir):
    with open(os.path.join(model_dir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if r["split"] == "train"}


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """An uninterrupted QUICK run (checkpoints 3 and 6): the reference a resumed run must equal,
    and the checkpoint eval and infer read. Trained once for the module; no test writes into it
    (eval and infer read its checkpoint through a symlink)."""
    require_devices(8)
    d = tmp_path_factory.mktemp("quick") / "full"
    assert run_cli("train", *QUICK, f"--gin.MODEL_DIR='{d}'") == 0
    return d


def test_train_resume_is_bit_identical(tmp_path, full):
    require_devices(8)
    parts = tmp_path / "parts"
    # Interrupted after 3 steps (as a preemption would), then the same command again.
    assert (
        run_cli("train", *QUICK, f"--gin.MODEL_DIR='{parts}'", "--gin.train.stop_after_steps=3")
        == 0
    )
    assert sorted(losses(parts)) == [1, 2, 3]
    assert run_cli("train", *QUICK, f"--gin.MODEL_DIR='{parts}'") == 0
    assert losses(parts) == losses(full)  # exact float equality, steps 1..6
    assert sorted(os.listdir(full)) == [
        "checkpoint_3", "checkpoint_6", "config.gin", "metrics.jsonl", "tensorboard"
    ]  # fmt: skip
    assert "TRAIN_STEPS = 6" in (full / "config.gin").read_text()


def test_train_loop_traces_its_step_once_and_puts_the_next_batch_last(tmp_path, monkeypatch):
    """Every step of the loop (a new batch each, metrics read a step late, a save at step 3)
    dispatches the same compiled train step: nothing it passes changes type or sharding. While
    step N runs, step N-1's report comes before step N+1's batch is put on the devices (putting
    it ends in a device program, which XLA:CPU runs only after step N, holding the host). The
    set-up's objects are out of the garbage collector's sight while the steps run, and back in
    it afterwards."""
    import collections
    import gc

    import jax

    import t5lite.programs.train as train_program
    from t5lite.programs import train_loop

    require_devices(8)
    frozen_while_stepping = []
    run_steps = train_program._run

    def recording(*args, **kwargs):
        frozen_while_stepping.append(gc.get_freeze_count())
        return run_steps(*args, **kwargs)

    monkeypatch.setattr(train_program, "_run", recording)
    events = []
    prefetch, report = train_loop.Batches.prefetch, train_loop.TrainLoop._read

    def recording_prefetch(self):
        if self._next is None:
            events.append("put")
        prefetch(self)

    def recording_report(self, info):
        events.append(f"report {info.step}")
        return report(self, info)

    monkeypatch.setattr(train_loop.Batches, "prefetch", recording_prefetch)
    monkeypatch.setattr(train_loop.TrainLoop, "_read", recording_report)
    traces = collections.Counter()

    def listen(event, duration, **kw):
        if event == "/jax/core/compile/jaxpr_trace_duration":
            traces[kw.get("fun_name")] += 1

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        assert run_cli("train", *QUICK, f"--gin.MODEL_DIR='{tmp_path}'") == 0
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert sorted(losses(tmp_path)) == [1, 2, 3, 4, 5, 6]
    # The batch's features go over stacked and are split on the devices by one jitted call.
    assert traces["_train_step"] == 1 and traces["split_stacked"] == 1, traces
    assert events == [
        "put", "put",  # steps 1 and 2
        "report 1", "put",  # step 3's batch
        "report 2", "put", "report 3",  # step 3 saves: read at once
        "put",  # step 5's batch (nothing pending from step 3)
        "report 4", "put",
        "report 5", "report 6",  # the last step: no batch after it
    ], events  # fmt: skip
    # JAX, Flax, gin and the model: far more objects than a step makes.
    assert frozen_while_stepping[0] > 100_000 and gc.get_freeze_count() == 0


def test_eval_and_infer_from_checkpoint(tmp_path, full):
    require_devices(8)
    d = tmp_path / "m"  # the shared run's last checkpoint alone, as eval and infer read it
    d.mkdir()
    os.symlink(full / "checkpoint_6", d / "checkpoint_6")
    common = [
        "--gin_file=models/t5_1_1/tiny.gin", "--gin.VOCAB_SIZE=384",
        f"--gin.MODEL_DIR='{d}'", "--gin.TASK='synthetic_reverse'",
        "--gin.TASK_FEATURE_LENGTHS={'inputs': 16, 'targets': 16}", "--gin.BATCH_SIZE=8",
        "--gin.NUM_PARTITIONS=4",
    ]  # fmt: skip
    assert (
        run_cli("eval", "--gin_file=runs/eval.gin", *common, "--gin.DataConfig.num_examples=8") == 0
    )
    out = tmp_path / "pred.jsonl"
    args = ["--gin_file=runs/infer.gin", *common, f"--gin.OUTPUT_FILE='{out}'",
            "--gin.DataConfig.num_examples=8"]  # fmt: skip
    assert run_cli("infer", *args) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 8
    assert set(records[0]) == {"task", "inputs", "targets", "prediction"}
    # Existing output is never overwritten.
    assert run_cli("infer", *args) == 1
    score_out = tmp_path / "score.jsonl"
    assert run_cli("infer", *args[:-2], f"--gin.OUTPUT_FILE='{score_out}'",
               "--gin.DataConfig.num_examples=8", "--gin.infer.mode='score'") == 0  # fmt: skip
    scores = [json.loads(line)["score"] for line in score_out.read_text().splitlines()]
    assert len(scores) == 8 and all(s < 0 for s in scores)


def test_nan_guard_stops_and_keeps_last_good_checkpoint(tmp_path, capsys):
    require_devices(8)
    d = tmp_path / "nan"
    rc = run_cli(
        "train", *QUICK, f"--gin.MODEL_DIR='{d}'",
        "--gin.warmup_cosine_schedule.peak_learning_rate=1e30", "--gin.AdamW.clip_norm=None",
    )  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the progress lines
    assert rc == 1
    # Step 3's loss is still finite but its update is not: that is the step that would have
    # been checkpointed (period 3); it is refused, so no checkpoint exists at all.
    assert re.match(r"t5lite train: error: step 3 is not finite \(loss [0-9.]+, ", err), err
    assert "non-finite parameter arrays, first 'params/" in err
    assert "it was not saved. The last good checkpoint is none (no save yet)" in err
    assert not any(n.startswith("checkpoint_") for n in os.listdir(d))
    assert all(not n.endswith(".tmp") for n in os.listdir(d))


def test_misspelled_binding_fails_before_compiling(capsys):
    assert run_cli("train", *QUICK, "--gin.train.num_stepz=3") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "num_stepz" in err[0]


def test_missing_required_value(capsys):
    assert (
        run_cli("train", "--gin_file=runs/pretrain.gin", "--gin_file=models/t5_1_1/tiny.gin") == 1
    )
    err = capsys.readouterr().err
    assert "MODEL_DIR/macro.value set to `%gin.REQUIRED` but not subsequently overridden" in err


def test_console_script_end_to_end(tmp_path):
    """The real entry point in a fresh process, with --host_device_count. Analytic only: the
    same program compiled is test_readme_inspect.py's first command (a minute of the suite)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    out = subprocess.run(
        [sys.executable, "-m", "t5lite.cli.main", "inspect", "--gin_file=inspect.gin",
         "--host_device_count=8", "--gin.inspect.compile=False"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "mesh: data=4 x model=2" in out.stdout
    assert "parameters: 76,961,152" in out.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "t5lite.cli.main", "inspect", "--gin_file=nope.gin"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert bad.returncode == 1
    assert "gin file 'nope.gin' not found" in bad.stderr
