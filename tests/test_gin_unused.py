"""A binding that the run would never read is one error line naming it (and the configurable
the run calls instead) before anything is built; the shipped configs and shared user files
give no false error for train, eval, infer, cache, inspect or plan."""

from __future__ import annotations

import itertools
import textwrap
from pathlib import Path

import gin
import pytest
from conftest import require_devices, run_cli

from t5lite.cli import gin_config
from t5lite.cli import main as cli

QUICK = [
    "--gin_file=quickstart.gin",
    "--host_device_count=8",
    "--gin.TRAIN_STEPS=2",
    "--gin.BATCH_SIZE=8",
    "--gin.warmup_cosine_schedule.warmup_steps=1",
    "--gin.train.evaluation=None",
]
ISSUE_FLAG = "--gin.standard_logical_axis_rules.additional_rules=[('embd', 'data')]"


def _line(gin_file: str, start: str) -> str:
    """`gin_file:N`, N the line of the packaged gin file that starts with `start`."""
    lines = Path(gin_config.find_gin_file(gin_file)).read_text().splitlines()
    return f"{gin_file}:{next(i + 1 for i, t in enumerate(lines) if t.startswith(start))}"


# What the run calls in place of t5x's rules function (the quickstart's partitioning preset).
VIA_MEGATRON = (
    "the run calls preset_rules (Partitioner.logical_axis_rules in "
    f"{_line('partitioning/megatron.gin', 'Partitioner.logical_axis_rules')}): "
    "bind preset_rules.additional_rules"
)
OPTIMIZER = _line("quickstart.gin", "EncoderDecoderModel.optimizer")


def test_the_issues_binding_fails_before_training(tmp_path, capsys):
    """t5x's name for the rules: ignored until now (the run trained with the rule unused)."""
    run = tmp_path / "run"
    assert run_cli("train", *QUICK, f"--gin.MODEL_DIR='{run}'", ISSUE_FLAG) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "t5lite train: error: --gin.standard_logical_axis_rules.additional_rules: "
        "standard_logical_axis_rules is not called by this run, so the binding would be "
        f"ignored; {VIA_MEGATRON}"
    ]
    assert not run.exists()  # before the model directory, let alone a step


def _check(*argv: str) -> list:
    """Parses `t5lite ARGV` and checks its bindings are read, without running it."""
    args, bindings, _ = cli._parse(list(argv))
    with gin.unlock_config():
        gin.clear_config()
    gin_config.parse_gin(args.gin_file, bindings, search_paths=args.gin_search_path)
    return gin_config.check_read(args.command)


def _error(*argv: str) -> str:
    with pytest.raises(gin_config.ConfigError) as e:
        _check(*argv)
    return str(e.value)


REQUIRED = [
    "--gin.MODEL_DIR='/tmp/unused'",
    "--gin.TASK='synthetic_reverse'",
    "--gin.TASK_FEATURE_LENGTHS={'inputs': 16, 'targets': 16}",
]


def test_flags_that_no_part_of_the_run_reads():
    eval_gin = ["--gin_file=runs/eval.gin", "--gin_file=models/t5_1_1/tiny.gin", *REQUIRED]
    ignored = "is not called by this run, so the binding would be ignored"
    # A program the command does not run.
    assert _error("eval", *eval_gin, "--gin.train.num_steps=3") == (
        f"--gin.train.num_steps: train {ignored}"
    )
    # A group that eval does not take: the one it does take has the parameter.
    assert _error("eval", *eval_gin, "--gin.EvalConfig.num_examples=8") == (
        f"--gin.EvalConfig.num_examples: EvalConfig {ignored}; the run calls DataConfig "
        f"(evaluate.data in {_line('runs/eval.gin', 'evaluate.data')}): bind "
        "DataConfig.num_examples"
    )
    # The optimizer the quickstart does not use: a parameter AdamW has too, and one it lacks.
    assert _error("train", *QUICK, "--gin.Adafactor.clip_norm=0.5") == (
        f"--gin.Adafactor.clip_norm: Adafactor {ignored}; the run calls AdamW "
        f"(EncoderDecoderModel.optimizer in {OPTIMIZER}): bind AdamW.clip_norm"
    )
    assert _error("train", *QUICK, "--gin.Adafactor.decay_rate=0.9") == (
        f"--gin.Adafactor.decay_rate: Adafactor {ignored}"
    )
    # A scope the configurable is never called in.
    assert _error("train", *QUICK, "--gin.TASK/AdamW.clip_norm=0.5") == (
        "--gin.TASK/AdamW.clip_norm: AdamW is not called in scope 'TASK' by this run, so the "
        "binding would be ignored; the run calls AdamW (EncoderDecoderModel.optimizer in "
        f"{OPTIMIZER}): bind AdamW.clip_norm"
    )


def test_a_users_file_binding_names_its_file_and_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "user.gin").write_text(
        "include 'quickstart.gin'\n# t5x's rules function, as a t5x config would bind it\n"
        "standard_logical_axis_rules.additional_rules = [('embd', 'data')]\n"
    )
    assert _error("train", "--gin_file=user.gin", "--host_device_count=8") == (
        "user.gin:3: standard_logical_axis_rules.additional_rules: standard_logical_axis_rules "
        f"is not called by this run, so the binding would be ignored; {VIA_MEGATRON}"
    )
    # The same line is no error where the file makes the run call it.
    (tmp_path / "user.gin").write_text(
        "include 'quickstart.gin'\n"
        "Partitioner.logical_axis_rules = @standard_logical_axis_rules()\n"
        "standard_logical_axis_rules.additional_rules = [('embed', None)]\n"
    )
    assert _check("train", "--gin_file=user.gin") == []


MODELS = [
    "models/t5_1_1/tiny.gin",
    "models/t5_1_1/small.gin",
    "models/t5_1_1/xxl.gin",
    "models/decoder_only/tiny.gin",
    "models/decoder_only/llama_7b.gin",
]
PARTITIONING = sorted(
    p.name for p in (Path(gin_config._CONFIG_DIRS[-1]) / "partitioning").glob("*.gin")
)
RUNS = {"pretrain": "train", "finetune": "train", "eval": "eval", "infer": "infer"}


def _shipped_command_lines() -> list[list[str]]:
    lines = []
    for (run, command), model, part in itertools.product(RUNS.items(), MODELS, PARTITIONING):
        argv = [
            command,
            f"--gin_file=runs/{run}.gin",
            f"--gin_file={model}",
            f"--gin_file=partitioning/{part}",
            *REQUIRED,
        ]
        argv += {"train": ["--gin.TRAIN_STEPS=3"], "infer": ["--gin.OUTPUT_FILE='/tmp/o'"]}.get(
            command, []
        )
        if "decoder_only" in model:
            argv += [
                "--gin.MODEL=@DecoderOnlyModel()",
                "--gin.DecoderOnlyModel.network_config=@network.DecoderOnlyConfig()",
            ]
            argv += ["--gin.DecoderOnlyModel.optimizer=@AdamW()"] if command == "train" else []
        lines.append(argv)
    lines.append(
        [
            "cache",
            "--gin_file=runs/pretrain.gin",
            "--gin_file=models/t5_1_1/tiny.gin",
            *REQUIRED,
            "--gin.TRAIN_STEPS=3",
        ]
    )
    lines += [
        ["inspect", "--gin_file=inspect.gin"],
        ["plan", "--gin_file=plan.gin"],
        ["train", "--gin_file=quickstart.gin"],
        ["train", "--gin_file=examples/t5x_t5_1_1_small.gin", *REQUIRED[:1]],
    ]
    return lines


def _exists(gin_file: str) -> bool:
    try:
        return bool(gin_config.find_gin_file(gin_file))
    except gin_config.ConfigError:
        return False


def test_no_false_error_with_the_shipped_configs():
    """Every run file x model x partitioning preset, each command, and the README's lines."""
    from test_cli_parsers import _documented_command_lines

    documented = [  # those whose gin files exist before the README's blocks have run
        line
        for line in _documented_command_lines()
        if line[0] != "convert"
        and all(_exists(a.removeprefix("--gin_file=")) for a in line if a.startswith("--gin_file="))
    ]
    lines = _shipped_command_lines() + documented
    assert len(lines) > 180
    for line in lines:
        assert _check(*line) == [], line


def test_no_false_error_with_shared_user_files(tmp_path, monkeypatch):
    """The README's pattern: one task file (and an imported model.gin that offers a
    vocabulary) for train, eval, infer and cache; bindings that only train reads are no error
    for eval, those a later flag picks are no error either."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "task.gin").write_text(
        textwrap.dedent("""\
        TASK = @walk/JsonlTask()
        walk/JsonlTask.name = 'walk'
        walk/JsonlTask.files = {'train': 'train.jsonl', 'validation': 'validation.jsonl'}
        other/TextLinesTask.name = 'other'
        other/TextLinesTask.files = {'train': 'lines.txt'}
        TASK_FEATURE_LENGTHS = {'inputs': 16, 'targets': 8}
        TRAIN_STEPS = 30
        BATCH_SIZE = 16
        train.evaluation = @EvalConfig()
        EvalConfig.num_examples = 32
        CheckpointConfig.period = 10
        AdamW.weight_decay = 0.01
        DataConfig.cache_dir = '/tmp/cache'
        """)
    )
    (tmp_path / "model.gin").write_text(
        textwrap.dedent("""\
        import t5lite.cli.registry
        MODEL = @EncoderDecoderModel()
        EncoderDecoderModel.network_config = @network.T5Config()
        network.T5Config.vocab_size = 384
        HF_VOCABULARY = @hf/seqio_lite.SentencePieceVocabulary()
        hf/seqio_lite.SentencePieceVocabulary.model_file = 'spiece.model'
        hf/seqio_lite.SentencePieceVocabulary.extra_ids = 100
        """)
    )
    common = ["--gin_file=model.gin", "--gin_file=task.gin", "--gin.MODEL_DIR='/tmp/run'"]
    assert _check("train", "--gin_file=runs/finetune.gin", *common) == []
    assert _check("eval", "--gin_file=runs/eval.gin", *common) == []
    assert _check("infer", "--gin_file=runs/infer.gin", *common, "--gin.OUTPUT_FILE='o'") == []
    assert _check("cache", "--gin_file=runs/pretrain.gin", *common) == []


def test_a_flag_on_a_users_configurable_is_checked_once_the_run_ends(tmp_path, monkeypatch):
    """A user module's configurable may be called by user code (not only by gin): the flag is
    checked against what was called by the end of the run."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_scaling.py").write_text(
        "import gin\n\n@gin.configurable\ndef my_scale(x, factor=1):\n    return x * factor\n"
    )
    (tmp_path / "user.gin").write_text("import my_scaling\ninclude 'quickstart.gin'\n")
    pending = _check("train", "--gin_file=user.gin", "--gin.my_scale.factor=3")
    with pytest.raises(gin_config.ConfigError) as e:
        gin_config.check_called(pending)
    assert str(e.value) == (
        "--gin.my_scale.factor: my_scale was not called by this run, so the binding was ignored"
    )
    import my_scaling

    assert my_scaling.my_scale(2) == 6  # user code calls it: the binding was read
    gin_config.check_called(pending)


def test_a_flag_on_a_users_configurable_that_the_run_never_called(tmp_path, monkeypatch, capsys):
    """Through the CLI: the program runs (analytic inspect), then the flag is the one error."""
    require_devices(8)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_unused_scaling.py").write_text(
        "import gin\n\n@gin.configurable\ndef my_unused_scale(x, factor=1):\n"
        "    return x * factor\n"
    )
    (tmp_path / "user.gin").write_text("import my_unused_scaling\ninclude 'inspect.gin'\n")
    rc = run_cli(
        "inspect",
        "--gin_file=user.gin",
        "--host_device_count=8",
        "--gin.inspect.compile=False",
        "--gin.my_unused_scale.factor=3",
    )
    out, err = capsys.readouterr()
    assert "parameters: 76,961,152" in out  # the program ran
    assert rc == 1 and err.strip().splitlines()[-1] == (
        "t5lite inspect: error: --gin.my_unused_scale.factor: my_unused_scale was not called by "
        "this run, so the binding was ignored"
    )
