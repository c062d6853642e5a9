"""One parser per command: each `--help` lists that command's flags only, a flag of another
command is one error line, and every command line the README and the docs show still parses."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from t5lite.cli import main as cli

GIN = [
    "--gin_file",
    "--gin_search_path",
    "--host_device_count",
    "--coordinator_address",
    "--num_processes",
    "--process_id",
    "--heartbeat_timeout_s",
]
INSIGHT = ["--topology", "--device", "--wide", "--plot"]
CONVERT = ["--direction", "--hf_dir", "--checkpoint", "--out_dir", "--scan_layers"]
FLAGS = {
    "train": GIN,
    "eval": GIN,
    "infer": GIN,
    "cache": GIN,
    "inspect": GIN + INSIGHT,
    "plan": GIN + INSIGHT,
    "convert": CONVERT,
}
EVERY_FLAG = sorted(set(GIN + INSIGHT + CONVERT))


def _help(command: str, capsys) -> str:
    assert cli.main([command, "--help"]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("command", cli.COMMANDS)
def test_help_lists_the_commands_own_flags_only(command, capsys):
    text = _help(command, capsys)
    assert text.startswith(f"usage: t5lite {command} [-h]")
    listed = sorted(set(re.findall(r"(--[a-z_]+)", text.split("options:")[1].split("\n\n")[0])))
    assert listed == sorted([*FLAGS[command], "--help"])
    # The gin help stays with the commands that read gin; convert has none.
    gin_help = "--gin.NAME=VALUE bindings, values as Python literals"
    assert (gin_help in " ".join(text.split())) == (command != "convert")
    if command != "convert":
        assert "runs/pretrain.gin: MODEL_DIR, TASK, TASK_FEATURE_LENGTHS, TRAIN_STEPS" in text


def test_top_level_help_lists_the_commands(capsys):
    assert cli.main(["--help"]) == 0
    text = capsys.readouterr().out
    for command in cli.COMMANDS:
        assert re.search(rf"^  {command} +\S", text, flags=re.M), command
    assert "`t5lite COMMAND --help` lists a command's flags." in text


# (command line, the one error line)
MISPLACED = [
    (
        ["train", "--direction=import"],
        "t5lite train: error: train does not take --direction (only convert does)",
    ),
    (
        ["train", "--hf_dir", "/tmp/x"],
        "t5lite train: error: train does not take --hf_dir (only convert does)",
    ),
    (
        ["train", "--gin_file=quickstart.gin", "--topology=v5e:4x4"],
        "t5lite train: error: train does not take --topology (only inspect and plan do)",
    ),
    (
        ["eval", "--wide"],
        "t5lite eval: error: eval does not take --wide (only inspect and plan do)",
    ),
    (
        ["cache", "--plot=x.png"],
        "t5lite cache: error: cache does not take --plot (only inspect and plan do)",
    ),
    (
        ["plan", "--scan_layers"],
        "t5lite plan: error: plan does not take --scan_layers (only convert does)",
    ),
    (
        ["convert", "--host_device_count=8"],
        "t5lite convert: error: convert does not take --host_device_count (only train, eval, "
        "infer, inspect, plan and cache do)",
    ),
    (
        ["convert", "--gin.TRAIN_STEPS=3"],
        "t5lite convert: error: convert does not take --gin.TRAIN_STEPS (only train, eval, infer, "
        "inspect, plan and cache do)",
    ),
    (
        ["train", "--no_such_flag=1"],
        "t5lite train: error: unrecognized arguments: --no_such_flag=1",
    ),
]


@pytest.mark.parametrize(("argv", "line"), MISPLACED, ids=[" ".join(a) for a, _ in MISPLACED])
def test_a_flag_of_another_command_is_one_line(argv, line, capsys):
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [line]


def test_flags_before_the_command_still_belong_to_it():
    args, bindings, beam = cli._parse(["--gin_file=a.gin", "inspect", "--wide", "--gin.X=1"])
    assert (args.command, args.gin_file, args.wide, bindings, beam) == (
        "inspect",
        ["a.gin"],
        True,
        ["X=1"],
        [],
    )


def test_cache_hands_unknown_flags_to_beam():
    args, _, beam = cli._parse(["cache", "--gin_file=a.gin", "--runner=FlinkRunner", "--x=1"])
    assert args.gin_file == ["a.gin"] and beam == ["--runner=FlinkRunner", "--x=1"]


def _documented_command_lines() -> list[list[str]]:
    """Every `t5lite COMMAND ...` in the bash blocks of README.md and docs/*.md."""
    root = Path(__file__).resolve().parents[1]
    pages = [root / "README.md", *sorted((root / "docs").glob("**/*.md"))]
    lines = []
    for page in pages:
        for block in re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                # A shell variable (`--process_id=$i` in a loop) stands for a number there.
                words = shlex.split(re.sub(r"\$\w+", "0", line), comments=True)
                for i, word in enumerate(words):
                    if word == "t5lite" and i + 1 < len(words) and words[i + 1] in cli.COMMANDS:
                        lines.append(_until_shell_operator(words[i + 1 :]))
    return lines


def _until_shell_operator(words: list[str]) -> list[str]:
    end = next((j for j, w in enumerate(words) if w in ("&", "&&", ";", "|", "||")), len(words))
    return [w.rstrip(";") for w in words[:end]]


def test_every_documented_command_line_parses():
    lines = _documented_command_lines()
    commands = {line[0] for line in lines}
    assert commands == set(cli.COMMANDS), commands  # every command is shown somewhere
    for line in lines:
        args, _, beam = cli._parse(line)
        assert args.command == line[0], line
        if line[0] != "cache":  # `cache` hands what it does not take to Beam (docs/data.md)
            assert beam == [], line


# Command lines of the test suite that pass flags beside gin (the gin-only ones parse alike).
SUITE_LINES = [
    ["inspect", "--gin_file=inspect.gin", "--host_device_count=8", "--gin.inspect.compile=False"],
    ["inspect", "--gin_file=inspect.gin", "--device=v9"],
    ["inspect", "--gin_file=inspect.gin", "--plot=/tmp/x.png"],
    ["eval", "--host_device_count=8", "--gin_file=runs/eval.gin"],
    [
        "train",
        "--gin_file=quickstart.gin",
        "--coordinator_address=127.0.0.1:1234",
        "--num_processes=2",
        "--process_id=1",
        "--heartbeat_timeout_s=60",
    ],
    ["convert", "--direction=import", "--hf_dir=/tmp/hf", "--out_dir=/tmp/out"],
    ["convert", "--direction=export", "--checkpoint=/tmp/c/checkpoint_1", "--out_dir=/tmp/e"],
    ["train", "--gin_file=user.gin", "--gin_search_path=/tmp/lib"],
]


@pytest.mark.parametrize("line", SUITE_LINES, ids=[" ".join(x[:2]) for x in SUITE_LINES])
def test_the_suites_command_lines_parse(line):
    args, _, beam = cli._parse(line)
    assert args.command == line[0] and beam == []
