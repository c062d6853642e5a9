"""A user's mistakes through the CLI: exit code 1, exactly one line naming the culprit, before
anything compiles, and nothing written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import file_checksums, require_devices, run_cli

QUICK = [
    "--gin_file=quickstart.gin",
    "--gin.TRAIN_STEPS=3",
    "--gin.train.evaluation=None",
    "--gin.warmup_cosine_schedule.warmup_steps=1",
]

# (extra flags, the error line after "t5lite train: error: ")
CASES = [
    (["--gin.TRAN_STEPS=5"],
     "--gin.TRAN_STEPS: no loaded gin file uses the macro %TRAN_STEPS; did you mean TRAIN_STEPS?"),
    (["--gin.BATCH_SIZ=4"],
     "--gin.BATCH_SIZ: no loaded gin file uses the macro %BATCH_SIZ; did you mean BATCH_SIZE?"),
    (["--gin.MODEL_DIR=runs/x"],
     "--gin.MODEL_DIR=runs/x: gin values are Python literals; quote a string: "
     "--gin.MODEL_DIR=\"'runs/x'\""),
    (["--gin.TASK=synthetic_reverse"],
     "--gin.TASK=synthetic_reverse: gin values are Python literals; quote a string: "
     "--gin.TASK=\"'synthetic_reverse'\""),
    (["--gin.DataConfig.batch_size='32'"],
     "DataConfig.batch_size = '32': expects int, got str"),
    (["--gin.BATCH_SIZE='32'"],
     "DataConfig.batch_size = %BATCH_SIZE = '32': expects int, got str"),
    (["--gin.LogConfig.period=1.5"], "LogConfig.period = 1.5: expects int, got float"),
    (["--gin.DataConfig.pack='no'"], "DataConfig.pack = 'no': expects bool, got str"),
    (["--gin.AdamW.learning_rate='x'"],
     "AdamW.learning_rate = 'x': expects float | a function (@name()), got str"),
    (["--gin.CheckpointConfig.keep='3'"],
     "CheckpointConfig.keep = '3': expects int | None, got str"),
    (["--gin.Datconfig.batch_size=3"],
     "No configurable matching 'Datconfig'. In bindings string line {n} Datconfig.batch_size=3; "
     "did you mean DataConfig?"),
    (["--gin.preset_rules.additional_rules=[('embd', 'data')]"],
     "rules table: no parameter or activation has the logical axis 'embd'; did you mean 'embed'? "
     "(known: abspos_buckets, batch, embed, expert, expert_capacity, expert_group, expert_mlp, "
     "expert_replicas, "
     "heads, joined_kv, kv, kv_heads, kv_length, layers, length, lora_rank, mlp, mlp_activations, "
     "relpos_buckets, stack, unmodeled, vocab)"),
    (["--gin.preset_rules.name='fsdpp'"],
     "unknown partitioning preset 'fsdpp' (did you mean 'fsdp'?); known: activations_2d, "
     "context_parallel, context_parallel_ring, data_parallel, expert_parallel, fsdp, "
     "fully_sharded, megatron, "
     "sequence_parallel, tensor_2d In call to configurable 'preset_rules'"),
    (["--gin_file=no_such.gin"], None),  # names the file and where it looked (checked below)
]  # fmt: skip


MORE_TRAIN_CASES = [
    (["--gin.CheckpointConfig.period='often'"],
     "CheckpointConfig.period = 'often': expects int, got str"),
    (["--gin.DataConfig.task_feature_lengths=[16, 16]"],
     "DataConfig.task_feature_lengths = [16, 16]: expects Mapping, got list"),
    (["--gin.NUM_MICROBATCHES=2.5"],
     "train.num_microbatches = %NUM_MICROBATCHES = 2.5: expects int, got float"),
    (["--gin.train.step_timeout_s='10'"],
     "train.step_timeout_s = '10': expects float | None, got str"),
    (["--gin.EncoderDecoderModel.z_loss='1e-4'"],
     "EncoderDecoderModel.z_loss = '1e-4': expects float, got str"),
    (["--gin.network.T5Config.remat_policy='fulll'"],
     "T5Config.remat_policy = 'fulll': expects one of 'none', 'minimal', 'full', got str"),
    (["--gin.network.T5Config.variant='t5.2'"],
     "T5Config.variant = 't5.2': expects one of 't5.1.1', 't5.1.0', got str"),
    (["--gin.AdamW.clip_norm='1.0'"], "AdamW.clip_norm = '1.0': expects float | None, got str"),
    (["--gin.EncoderDecoderModel.decoding_method='beem'"],
     "decoding_method must be one of ('greedy', 'sample', 'beam'), got 'beem' In call to "
     "configurable 'EncoderDecoderModel' in scope 'MODEL'"),
    (["--gin.NUM_PARTITIONS=3"],
     "create_mesh: num_partitions=3 does not divide the 8 devices present In call to "
     "configurable 'Partitioner'"),
    (["--gin.NUM_PARTITIONS=16"],
     "create_mesh: num_partitions=16 does not divide the 8 devices present In call to "
     "configurable 'Partitioner'"),
    (["--gin.BATCH_SIZE=7"],
     "global batch size 7 is not divisible by the data-parallel size 2 (batch → mesh axes "
     "'data' of mesh {data: 2, model: 4})"),
    (["--gin.NUM_MICROBATCHES=3"], "num_microbatches=3 must divide the batch size 32"),
    (["--gin.TASK_FEATURE_LENGTHS={'inputs': 16}"],
     "DataConfig.task_feature_lengths = {'inputs': 16}: needs a positive length for 'targets' "
     "(and 'inputs' for encoder-decoder and prefix-LM models) In call to configurable "
     "'DataConfig'"),
    (["--gin.TASK_FEATURE_LENGTHS={'targets': 16}"],
     "DataConfig.task_feature_lengths = {'targets': 16}: an encoder-decoder model needs a "
     "length for 'inputs'"),
    (["--gin.VOCAB_SIZE=128"],
     "task 'synthetic_reverse' feature 'inputs' has a vocabulary of 259 ids but the model's "
     "vocab_size is 128"),
]  # fmt: skip
ALL_TRAIN_CASES = CASES + MORE_TRAIN_CASES


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A model directory with a committed checkpoint that every bad command points at."""
    require_devices(8)
    d = tmp_path_factory.mktemp("trained")
    assert run_cli("train", *QUICK, f"--gin.MODEL_DIR='{d}'") == 0
    return d


@pytest.mark.parametrize(("flags", "line"), ALL_TRAIN_CASES, ids=[c[0][0] for c in ALL_TRAIN_CASES])
def test_train_mistakes_end_in_one_line_and_change_nothing(flags, line, trained, capsys):
    before = file_checksums(trained)
    # TRAIN_STEPS=6: without the mistake this would resume and write checkpoints.
    rc = run_cli("train", *QUICK, f"--gin.MODEL_DIR='{trained}'", "--gin.TRAIN_STEPS=6", *flags)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1, err
    if line is None:
        assert err[0].startswith("t5lite train: error: gin file 'no_such.gin' not found in ")
    else:  # {n}: the line of the bindings string gin names (the flags before it count)
        n = sum(f.startswith("--gin.") for f in QUICK) + 3  # + MODEL_DIR, TRAIN_STEPS, the flag
        assert err[0] == f"t5lite train: error: {line}".replace("{n}", str(n))
    assert file_checksums(trained) == before  # nothing good on disk changed


QUICKSTART_DATA = ["--gin_file=models/t5_1_1/tiny.gin", "--gin.VOCAB_SIZE=384",
                   "--gin.TASK='synthetic_reverse'",
                   "--gin.TASK_FEATURE_LENGTHS={'inputs': 16, 'targets': 16}"]  # fmt: skip
EVAL_INFER_CASES = [
    ("eval", ["--gin_file=runs/eval.gin", "--gin_file=models/t5_1_1/tiny.gin"],
     "MODEL_DIR/macro.value set to `%gin.REQUIRED` but not subsequently overridden."),
    ("eval", ["--gin_file=runs/eval.gin", *QUICKSTART_DATA, "--gin.DataConfig.split='valid'"],
     "FunctionSource 'synthetic_reverse' has no split 'valid'; available: ['test', 'train', "
     "'validation']"),
    ("eval", ["--gin_file=runs/eval.gin", *QUICKSTART_DATA, "--gin.TASK='synthetic_revers'"],
     None),
    ("infer", ["--gin_file=runs/infer.gin", *QUICKSTART_DATA, "--gin.OUTPUT_FILE='/tmp/o.jsonl'",
               "--gin.infer.mode='generate'"],
     "infer mode must be 'predict' or 'score', got 'generate'"),
    ("infer", ["--gin_file=runs/infer.gin", *QUICKSTART_DATA, "--gin.OUTPUT_FILE=/tmp/o.jsonl"],
     "--gin.OUTPUT_FILE=/tmp/o.jsonl: gin values are Python literals; quote a string: "
     "--gin.OUTPUT_FILE=\"'/tmp/o.jsonl'\""),
]  # fmt: skip


@pytest.mark.parametrize(("command", "flags", "line"), EVAL_INFER_CASES,
                         ids=[f"{c[0]}-{c[1][-1]}" for c in EVAL_INFER_CASES])  # fmt: skip
def test_eval_and_infer_mistakes(command, flags, line, trained, capsys):
    before = file_checksums(trained)
    model_dir = [] if "REQUIRED" in (line or "") else [f"--gin.MODEL_DIR='{trained}'"]
    rc = run_cli(command, "--host_device_count=8", *flags, *model_dir)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1, err
    if line is None:
        assert "no task or mixture named 'synthetic_revers'; did you mean" in err[0]
    else:
        assert err[0] == f"t5lite {command}: error: {line}"
    assert file_checksums(trained) == before


def test_an_eval_without_a_checkpoint_and_an_infer_of_a_missing_step(trained, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run_cli("eval", "--gin_file=runs/eval.gin", *QUICKSTART_DATA,
                   f"--gin.MODEL_DIR='{empty}'") == 1  # fmt: skip
    assert capsys.readouterr().err.strip().splitlines() == [
        f"t5lite eval: error: no committed checkpoint in {empty}"
    ]
    assert run_cli("infer", "--gin_file=runs/infer.gin", *QUICKSTART_DATA,
                   f"--gin.MODEL_DIR='{trained}'", f"--gin.OUTPUT_FILE='{tmp_path / 'o.jsonl'}'",
                   "--gin.infer.checkpoint_step=7") == 1  # fmt: skip
    assert capsys.readouterr().err.strip().splitlines() == [
        f"t5lite infer: error: checkpoint directory {trained / 'checkpoint_7'} does not exist"
    ]
    assert not (tmp_path / "o.jsonl").exists()


def test_an_unknown_task_name(tmp_path, capsys):
    model_dir = tmp_path / "run"
    rc = run_cli("train", *QUICK, f"--gin.MODEL_DIR='{model_dir}'", "--gin.TASK='synthetic_revers'")
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1, err
    assert err[0].startswith(
        "t5lite train: error: no task or mixture named 'synthetic_revers'; did you mean "
        "'synthetic_reverse'? (registered: "
    )
    assert not model_dir.exists()


def test_a_mistake_found_after_the_run_lock_leaves_no_model_directory(tmp_path, capsys):
    """The batch that does not split over the mesh is found when the trainer is built, after
    the run lock made the model directory: the lock's release removes the empty directory."""
    model_dir = tmp_path / "run"
    rc = run_cli("train", *QUICK, f"--gin.MODEL_DIR='{model_dir}'", "--gin.BATCH_SIZE=7")
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and err == [
        "t5lite train: error: global batch size 7 is not divisible by the data-parallel size 2 "
        "(batch → mesh axes 'data' of mesh {data: 2, model: 4})"
    ]
    assert not model_dir.exists()


def test_inspect_with_a_train_config_names_what_to_bind(capsys):
    """`inspect` on the quickstart's train config (no inspect.gin): its keyword-only arguments
    are Python's error, not gin's; still one line naming the bindings."""
    rc = run_cli("inspect", "--gin_file=quickstart.gin", "--host_device_count=8")
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and err == [
        "t5lite inspect: error: inspect.model, inspect.task_feature_lengths, inspect.batch_size: "
        "required, but no value is bound"
    ]


def test_a_gin_import_that_is_not_found(tmp_path, capsys, monkeypatch):
    (tmp_path / "user.gin").write_text("import no_such_module_xyz\ninclude 'quickstart.gin'\n")
    monkeypatch.chdir(tmp_path)
    assert run_cli("train", "--gin_file=user.gin") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "t5lite train: error: No module named 'no_such_module_xyz' In file \"user.gin\", line 1 "
        f"import no_such_module_xyz: looked in the working directory ({tmp_path}) and the "
        "installed packages"
    ]


def test_a_gin_file_imports_a_module_from_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "my_tasks.py").write_text("import t5lite.cli.registry\nLOADED = True\n")
    (tmp_path / "user.gin").write_text("import my_tasks\ninclude 'quickstart.gin'\n")
    monkeypatch.chdir(tmp_path)
    from t5lite.cli import gin_config

    gin_config.parse_gin(["user.gin"], [])
    import my_tasks

    assert my_tasks.LOADED


@pytest.mark.parametrize("kind", ["file", "under_a_file"])
def test_an_unusable_model_directory(kind, tmp_path, capsys):
    precious = tmp_path / "a_file"
    precious.write_text("precious")
    if kind == "file":
        target, want = precious, f"model directory {precious}: File exists"
    else:  # e.g. a typo'd parent that is a file; root, who ignores permissions, fails here too
        target = precious / "run"
        want = f"model directory {target}: Not a directory"
    assert run_cli("train", *QUICK, f"--gin.MODEL_DIR='{target}'") == 1
    assert capsys.readouterr().err.strip().splitlines() == [f"t5lite train: error: {want}"]
    assert precious.read_text() == "precious"


def test_a_rule_that_cannot_apply_is_a_warning_at_train_start():
    import t5lite.programs.train as train_program
    from t5lite import (
        EncoderDecoderModel,
        Partitioner,
        T5Config,
        Trainer,
        create_mesh,
        standard_logical_axis_rules,  # fmt: skip
    )

    require_devices(8)
    config = T5Config(vocab_size=128, emb_dim=16, num_heads=2, head_dim=8, mlp_dim=32,
                      num_encoder_layers=1, num_decoder_layers=1)  # fmt: skip
    model = EncoderDecoderModel(config)
    rules = [("embed", "model"), *standard_logical_axis_rules(1, 1)]  # embed takes `model` first
    part = Partitioner(create_mesh(num_partitions=2), logical_axis_rules=rules)
    trainer = Trainer(model, part, batch_size=8, lengths={"inputs": 8, "targets": 8})
    lines = []

    class Writer:
        def info(self, text):
            lines.append(text)

    train_program._warn_replicated(trainer, Writer())
    assert len(lines) == 1
    assert (
        lines[0].startswith("warning: ")
        and "parameter arrays keep a dimension replicated" in lines[0]
    )
    assert "`t5lite inspect` lists them" in lines[0]


def test_a_checkpoint_that_does_not_fit_fails_before_compiling(tmp_path, capsys):
    require_devices(8)
    args = [*QUICK, f"--gin.MODEL_DIR='{tmp_path}'", "--gin.CheckpointConfig.period=3"]
    assert run_cli("train", *args) == 0
    capsys.readouterr()
    # The same directory with a wider model: refused from metadata.json, nothing compiled.
    assert run_cli("train", *args, "--gin.TRAIN_STEPS=6", "--gin.MLP_DIM=512") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"t5lite train: error: checkpoint {tmp_path / 'checkpoint_3'}: array 'params/"
    )
    assert "has shape" in err[0] and "expects" in err[0] and "512" in err[0]


def test_progress_lines_and_a_finished_run(tmp_path, capsys):
    require_devices(8)
    args = [*QUICK, f"--gin.MODEL_DIR='{tmp_path}'"]
    assert run_cli("train", *args) == 0
    out = capsys.readouterr().err  # the log goes to stderr
    assert "compiling the train step, then steps 1 to 3" in out
    assert "compiled; the first step took " in out
    assert f"done: step 3, {tmp_path / 'checkpoint_3'}, " in out
    assert run_cli("train", *args) == 0  # rerun: says so, trains nothing
    out = capsys.readouterr().err  # the log goes to stderr
    assert f"{tmp_path} is complete: trained to step 3 of 3; nothing to do" in out
    assert "compiling" not in out


def _subprocess_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    return subprocess.run([sys.executable, "-m", "t5lite", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip


def test_help_describes_gin_presets_and_required_macros(tmp_path):
    out = _subprocess_cli("train", "--help", cwd=tmp_path)
    assert out.returncode == 0
    text = " ".join(out.stdout.split())
    assert "--gin.NAME=VALUE bindings, values as Python literals" in text
    configs = Path(__file__).resolve().parents[1] / "configs" / "partitioning"
    shipped = sorted(p.name for p in configs.glob("*.gin"))
    assert {"megatron.gin", "pipeline.gin", "tensor_3d.gin"} <= set(shipped)
    assert "partitioning/: " + ", ".join(shipped) in text  # every shipped preset, in order
    assert "runs/pretrain.gin: MODEL_DIR, TASK, TASK_FEATURE_LENGTHS, TRAIN_STEPS" in text


def test_no_libtpu_noise_on_a_machine_without_tpus(tmp_path):
    # JAX_PLATFORMS unset, as for a user: JAX starts every backend it finds, libtpu included.
    out = _subprocess_cli(
        "train", "--gin_file=quickstart.gin", "--gin.NUM_PARTITIONS=1", "--gin.TRAIN_STEPS=2",
        "--gin.BATCH_SIZE=4", "--gin.warmup_cosine_schedule.warmup_steps=1",
        "--gin.train.evaluation=None", f"--gin.MODEL_DIR='{tmp_path / 'run'}'", cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    # What libtpu prints when it starts without TPU metadata (seen before this was fixed).
    markers = ("TPU_WORKER_HOSTNAMES", "TPU accelerator type", "libtpu.so", "InitGoogle")
    noise = [line for line in out.stderr.splitlines() if any(m in line for m in markers)]
    assert noise == []
    assert "done: step 2" in out.stderr


def test_an_empty_data_file_is_named(tmp_path, capsys, monkeypatch):
    # A user's task, registered by a module that the gin file imports from the working directory.
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "my_empty_tasks.py").write_text(  # a name no other test imports
        "import seqio_lite\n"
        "from seqio_lite import preprocessors as prep, sources\n"
        "vocab = seqio_lite.ByteVocabulary()\n"
        "seqio_lite.TaskRegistry.add(seqio_lite.Task(\n"
        "    'my_empty_lm', sources.TextLineSource({'train': 'empty.txt'}),\n"
        "    output_features={'targets': seqio_lite.Feature(vocab)},\n"
        "    preprocessors=[lambda ex: {'targets': ex['text']}, prep.tokenize]), overwrite=True)\n"
    )
    (tmp_path / "user.gin").write_text("import my_empty_tasks\ninclude 'quickstart.gin'\n")
    monkeypatch.chdir(tmp_path)
    rc = run_cli(
        "train", "--gin_file=user.gin", "--host_device_count=8", "--gin.TASK='my_empty_lm'",
        "--gin.MODEL=@DecoderOnlyModel()", "--gin.DecoderOnlyModel.optimizer=@AdamW()",
        "--gin.TASK_FEATURE_LENGTHS={'targets': 16}", f"--gin.MODEL_DIR='{tmp_path / 'r'}'",
        "--gin.train.evaluation=None",
    )  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and err == [
        "t5lite train: error: Split 'train' of TextLineSource 'TextLineSource' is empty (empty.txt)"
    ], err


def test_gin_search_path_finds_files_includes_and_modules(tmp_path, monkeypatch):
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "my_search_tasks.py").write_text("LOADED = True\n")
    (lib / "base.gin").write_text("include 'quickstart.gin'\nTRAIN_STEPS = 7\n")
    (lib / "user.gin").write_text("import my_search_tasks\ninclude 'base.gin'\n")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    import gin

    from t5lite.cli import gin_config

    gin_config.parse_gin(["user.gin"], [], search_paths=[str(lib)])
    import my_search_tasks

    assert my_search_tasks.LOADED and gin.query_parameter("TRAIN_STEPS/macro.value") == 7
