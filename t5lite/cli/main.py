"""The t5lite command line: `t5lite train | eval | infer | cache | inspect | plan | convert`.

Intentionally thin: it parses flags and gin, then calls one library function.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

COMMANDS = ("train", "eval", "infer", "inspect", "plan", "convert", "cache")
_GIN_COMMANDS = ("train", "eval", "infer", "cache", "inspect", "plan")
_INSIGHT = ("inspect", "plan")

_HELP = {
    "train": "train a model (resumes from the latest checkpoint in MODEL_DIR)",
    "eval": "evaluate a checkpoint on a task's metrics",
    "infer": "write a checkpoint's predictions or scores to a file",
    "cache": "tokenize a task once with Apache Beam (other flags go to Beam)",
    "inspect": "how a configuration is split: memory, communication, fit (nothing allocated)",
    "plan": "search mesh shapes x rules x remat for the fastest layout that fits",
    "convert": "Hugging Face checkpoint <-> t5lite checkpoint",
}

_USAGE = """
gin: --gin_file=FILE (repeatable; the working directory, then the packaged configs/) and
--gin.NAME=VALUE bindings, values as Python literals: --gin.TRAIN_STEPS=1000,
--gin.MODEL_DIR="'/tmp/run'", --gin.DataConfig.pack=False, --gin.preset_rules.name="'fsdp'".

"""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line (`t5lite train: error: ...`), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parsers() -> dict[str, argparse.ArgumentParser]:
    """One parser per command, each with only the flags that command takes."""
    from t5lite.cli.gin_config import describe_configs  # reads files only: JAX stays unloaded

    parsers = {}
    for command in COMMANDS:
        gin = command in _GIN_COMMANDS
        p = _Parser(
            prog=f"t5lite {command}",
            description=_HELP[command],
            epilog=_USAGE + describe_configs() if gin else None,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        if gin:
            _add_gin_flags(p)
        if command in _INSIGHT:
            _add_insight_flags(p)
        if command == "convert":
            _add_convert_flags(p)
        parsers[command] = p
    return parsers


def _add_gin_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--gin_file",
        action="append",
        default=[],
        help="repeatable; searched in the working directory, then the packaged configs/",
    )
    p.add_argument(
        "--gin_search_path",
        action="append",
        default=[],
        help="repeatable; more folders for --gin_file, `include` and gin `import`s of Python "
        "modules",
    )
    p.add_argument(
        "--host_device_count",
        type=int,
        default=None,
        help="fake N CPU devices (sets XLA_FLAGS before JAX starts)",
    )
    p.add_argument("--coordinator_address", help="HOST:PORT of process 0 (multi-process runs)")
    p.add_argument("--num_processes", type=int)
    p.add_argument("--process_id", type=int)
    p.add_argument(
        "--heartbeat_timeout_s",
        type=int,
        default=100,
        help="stop when a peer process is silent this long",
    )


def _add_insight_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--topology", help="compile for a TPU slice, e.g. v5e:16x16")
    p.add_argument(
        "--device",
        help="judge fit and speed by this accelerator's figures (v5p, v5e, v6e, v4, h100, "
        "h200, a100, ...)",
    )
    p.add_argument("--wide", action="store_true", help="every array on its own row, no width limit")
    p.add_argument(
        "--plot",
        metavar="FILE.png|svg",
        help="chart memory by category and communication by mesh axis (the [plot] extra)",
    )


def _add_convert_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--direction",
        choices=("import", "export"),
        default="import",
        help="Hugging Face -> t5lite (import) or back (export)",
    )
    p.add_argument("--hf_dir", help="import: Hugging Face checkpoint directory")
    p.add_argument("--checkpoint", help="export: a t5lite checkpoint_<step> directory")
    p.add_argument("--out_dir", help="output directory")
    p.add_argument("--scan_layers", action="store_true", help="import: stacked layers")


def _takes(parser: argparse.ArgumentParser, command: str, flag: str) -> bool:
    """Whether `command` takes `flag` (`--gin.` standing for any binding)."""
    if flag == "--gin.":
        return command in _GIN_COMMANDS
    return any(flag in a.option_strings for a in parser._actions)


def _misplaced_flag(command: str, argv: Sequence[str], parsers: dict) -> str | None:
    """The error for the first flag that another command takes but `command` does not."""
    for arg in argv:
        name = arg.split("=", 1)[0]
        flag = "--gin." if name.startswith("--gin.") else name
        if not name.startswith("--") or _takes(parsers[command], command, flag):
            continue
        takers = [c for c in COMMANDS if _takes(parsers[c], c, flag)]
        if takers:
            who = f"{', '.join(takers[:-1])} and {takers[-1]} do" if takers[1:] else takers[0]
            return f"{command} does not take {name} (only {who}{'' if takers[1:] else ' does'})"
    return None


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str], list[str]]:
    """(the command's flags, its `--gin.` bindings, what `cache` hands to Beam)."""
    parsers = _parsers()
    top = _Parser(
        prog="t5lite",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="commands:\n"
        + "\n".join(f"  {c:<8} {_HELP[c]}" for c in COMMANDS)
        + "\n\n`t5lite COMMAND --help` lists a command's flags.",
    )
    top.add_argument("command", choices=COMMANDS)
    # The command comes first; flags before it are the command's too (as with one parser).
    command = next((a for a in argv if a in COMMANDS), None)
    if command is None or any(a in ("-h", "--help") for a in argv[: argv.index(command)]):
        top.parse_args([a for a in argv if a in ("-h", "--help")][:1])  # --help, or one line
    rest = argv[: argv.index(command)] + argv[argv.index(command) + 1 :]
    p = parsers[command]
    misplaced = _misplaced_flag(command, rest, parsers)
    if misplaced:
        p.error(misplaced)
    # `--gin.NAME=VALUE` bindings, t5x style; everything else goes to the command's parser.
    bindings = [a.removeprefix("--gin.") for a in rest if a.startswith("--gin.")]
    args, unknown = p.parse_known_args([a for a in rest if not a.startswith("--gin.")])
    if unknown and command != "cache":  # `cache` hands other flags to Apache Beam
        p.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.command = command
    return args, bindings, unknown


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args, bindings, unknown = _parse(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as e:  # --help (0), or a usage mistake already printed on one line (2)
        return e.code if isinstance(e.code, int) else 2
    if args.command != "convert":
        try:  # a misspelt device or plot file fails here, before JAX starts
            insight_flags = _insight_flags(args)
        except ValueError as e:
            print(f"t5lite {args.command}: error: {e}", file=sys.stderr)
            return 1
        _fake_host_devices(args)
    from t5lite import distributed  # imports JAX: only after XLA_FLAGS is set
    from t5lite.checkpoint import CheckpointError
    from t5lite.cli import gin_config as gin_utils
    from t5lite.partitioning import PartitioningError
    from t5lite.programs.run_lock import RunLockError
    from t5lite.programs.train import TrainingError

    # User mistakes (bad bindings, layouts, checkpoints, values) end in one line naming the
    # culprit; T5LITE_DEBUG=1 shows the traceback instead. Other exceptions keep theirs.
    user_errors = (
        gin_utils.ConfigError,
        PartitioningError,
        CheckpointError,
        TrainingError,
        RunLockError,
        FileExistsError,
        FileNotFoundError,
        ValueError,
    )
    if os.environ.get("T5LITE_DEBUG"):
        user_errors = ()
    try:
        if args.command == "convert":
            _convert(args)
        else:
            _run_program(args, bindings, unknown, insight_flags)
    except user_errors as e:
        print(f"t5lite {args.command}: error: {gin_utils.one_line(e)}", file=sys.stderr)
        return 1
    except TypeError as e:  # gin calling a configurable without a required argument
        missing = None if os.environ.get("T5LITE_DEBUG") else gin_utils.missing_arguments(e)
        if missing is None:
            raise
        print(f"t5lite {args.command}: error: {missing}", file=sys.stderr)
        return 1
    except Exception as e:
        distributed.exit_on_peer_failure(args.command, e)
        raise
    return 0


def _convert(args: argparse.Namespace) -> None:
    from t5lite.hf import convert

    if not args.out_dir or not (args.hf_dir if args.direction == "import" else args.checkpoint):
        raise ValueError("convert needs --out_dir and --hf_dir (import) or --checkpoint (export)")
    if args.direction == "import":
        print(convert.hf_to_t5lite(args.hf_dir, args.out_dir, scan_layers=args.scan_layers))
    else:
        print(convert.t5lite_to_hf(args.checkpoint, args.out_dir))


def _run_program(
    args: argparse.Namespace, bindings: list[str], unknown: list[str], insight_flags: dict
) -> None:
    """Parses gin, joins the other processes and runs the command's program."""
    from t5lite import distributed
    from t5lite.cli import gin_config as gin_utils

    # Before joining: bad configs fail fast, and so does a binding that nothing would read.
    gin_utils.parse_gin(args.gin_file, bindings, search_paths=args.gin_search_path)
    pending = gin_utils.check_read(args.command)
    distributed.initialize(
        args.coordinator_address,
        args.num_processes,
        args.process_id,
        heartbeat_timeout_s=args.heartbeat_timeout_s,
    )
    _start_backends_quietly()
    from t5lite.cli import registry as reg

    fn = {
        "train": reg.train,
        "eval": reg.evaluate,
        "infer": reg.infer,
        "cache": reg.cache,
        "inspect": reg.inspect,
        "plan": reg.plan,
    }[args.command]
    kwargs: dict = {}
    if args.command == "cache":  # the training run's data; Beam options from the flags
        kwargs.update(data=reg.DataConfig(), pipeline_args=unknown)
    if args.command in _INSIGHT and args.topology:
        kwargs["topology"] = args.topology
    kwargs.update(insight_flags)
    if args.command == "train":  # config.gin: what this run used, written once it is set up
        kwargs["operative_config"] = gin_utils.operative_config
    fn(**kwargs)
    gin_utils.check_called(pending)  # flags on a user's configurables: called by now


def _fake_host_devices(args: argparse.Namespace) -> None:
    """Sets XLA_FLAGS for --host_device_count (or a --topology's device count) before JAX."""
    # The gin-built mesh needs as many devices as the topology has.
    if getattr(args, "topology", None) and not args.host_device_count:
        from t5lite.insight.topology import num_devices

        args.host_device_count = num_devices(args.topology)
    if args.host_device_count:
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = (
            f"{flags} --xla_force_host_platform_device_count={args.host_device_count}"
        )
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        # XLA:CPU blocks one thread of a pool of max(cores, devices) per collective in flight,
        # and a scanned loop holding collectives (a pipeline's ticks, scanned layers) can keep
        # two or three in flight per device: a pool of one thread per fake device runs dry and
        # the step aborts at XLA's rendezvous timeout. PJRT_NPROC sizes that pool.
        os.environ.setdefault("PJRT_NPROC", str(4 * args.host_device_count))


def _insight_flags(args: argparse.Namespace) -> dict:
    """inspect/plan keyword arguments from --device, --wide and --plot; ValueError naming the
    flag when --device names no known chip or --plot cannot be drawn."""
    if args.command not in _INSIGHT:
        return {}
    flags = {"device": args.device, "wide": args.wide or None, "plot": args.plot}
    flags = {k: v for k, v in flags.items() if v}
    if args.device:
        from t5lite.insight.hardware import chip_named

        chip_named(args.device)
    if args.plot:
        from t5lite.insight.plot import check_plot_path

        check_plot_path(args.plot)
    return flags


def _start_backends_quietly() -> None:
    """Starts JAX's backends with stderr held back on a machine without TPUs.

    The `[tpu]` extra installs libtpu to compile for TPU topologies ahead of time; on any other
    machine it prints ~5 lines of metadata warnings whenever JAX starts its backends. They are
    shown only if starting fails.
    """
    if os.environ.get("JAX_PLATFORMS") or glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
        return  # a chosen platform, or TPU hardware whose messages matter
    import jax

    from t5lite.insight.topology import quiet_stderr

    failed = None
    with quiet_stderr() as captured:
        try:
            jax.devices()
        except Exception as e:  # shown below with what libtpu said
            failed = e
    if failed is not None:
        sys.stderr.write("".join(captured))
        raise failed


def console_main() -> None:
    sys.exit(main())


if __name__ == "__main__":
    console_main()
