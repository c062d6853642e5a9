"""The t5lite command line: `t5lite train | eval | infer | cache | inspect | plan | convert`.

Intentionally thin: it parses flags and gin, then calls one library function.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
from collections.abc import Sequence

COMMANDS = ("train", "eval", "infer", "inspect", "plan", "convert", "cache")


_USAGE = """
gin: --gin_file=FILE (repeatable; the working directory, then the packaged configs/) and
--gin.NAME=VALUE bindings, values as Python literals: --gin.TRAIN_STEPS=1000,
--gin.MODEL_DIR="'/tmp/run'", --gin.DataConfig.pack=False, --gin.preset_rules.name="'fsdp'".

"""


def _parser() -> argparse.ArgumentParser:
    from t5lite.cli.gin_config import describe_configs  # reads files only: JAX stays unloaded

    p = argparse.ArgumentParser(
        prog="t5lite", description=__doc__, epilog=_USAGE + describe_configs(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    p.add_argument("command", choices=COMMANDS)
    p.add_argument("--gin_file", action="append", default=[], help="repeatable; searched in "
                   "the working directory, then the packaged configs/")  # fmt: skip
    p.add_argument("--gin_search_path", action="append", default=[],
                   help="repeatable; more folders for --gin_file, `include` and gin `import`s "
                   "of Python modules")  # fmt: skip
    p.add_argument("--host_device_count", type=int, default=None,
                   help="fake N CPU devices (sets XLA_FLAGS before JAX starts)")  # fmt: skip
    p.add_argument("--topology", help="inspect/plan: compile for a TPU slice, e.g. v5e:16x16")
    p.add_argument("--device", help="inspect/plan: judge fit and speed by this accelerator's "
                   "figures (v5p, v5e, v6e, v4, h100, h200, a100, ...)")  # fmt: skip
    p.add_argument("--wide", action="store_true",
                   help="inspect/plan: every array on its own row, no width limit")  # fmt: skip
    p.add_argument("--plot", metavar="FILE.png|svg",
                   help="inspect/plan: chart memory by category and communication by mesh axis "
                   "(the [plot] extra)")  # fmt: skip
    p.add_argument("--coordinator_address", help="HOST:PORT of process 0 (multi-process runs)")
    p.add_argument("--num_processes", type=int)
    p.add_argument("--process_id", type=int)
    p.add_argument("--heartbeat_timeout_s", type=int, default=100,
                   help="stop when a peer process is silent this long")  # fmt: skip
    p.add_argument("--direction", choices=("import", "export"), default="import",
                   help="convert: Hugging Face -> t5lite (import) or back (export)")  # fmt: skip
    p.add_argument("--hf_dir", help="convert import: Hugging Face checkpoint directory")
    p.add_argument("--checkpoint", help="convert export: a t5lite checkpoint_<step> directory")
    p.add_argument("--out_dir", help="convert: output directory")
    p.add_argument("--scan_layers", action="store_true", help="convert import: stacked layers")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # `--gin.NAME=VALUE` bindings, t5x style; everything else goes to argparse.
    bindings = [a.removeprefix("--gin.") for a in argv if a.startswith("--gin.")]
    parser = _parser()
    args, unknown = parser.parse_known_args([a for a in argv if not a.startswith("--gin.")])
    if unknown and args.command != "cache":  # `cache` hands other flags to Apache Beam
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:  # a misspelt device or plot file fails here, before JAX starts
        insight_flags = _insight_flags(parser, args)
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
    user_errors = (gin_utils.ConfigError, PartitioningError, CheckpointError, TrainingError,
                   RunLockError, FileExistsError, FileNotFoundError, ValueError)  # fmt: skip
    if os.environ.get("T5LITE_DEBUG"):
        user_errors = ()
    try:
        if args.command == "convert":
            from t5lite.hf import convert

            if not args.out_dir or not (
                args.hf_dir if args.direction == "import" else args.checkpoint
            ):
                raise ValueError(
                    "convert needs --out_dir and --hf_dir (import) or --checkpoint (export)"
                )
            if args.direction == "import":
                print(convert.hf_to_t5lite(args.hf_dir, args.out_dir, scan_layers=args.scan_layers))
            else:
                print(convert.t5lite_to_hf(args.checkpoint, args.out_dir))
            return 0
        gin_utils.parse_gin(
            args.gin_file, bindings, search_paths=args.gin_search_path
        )  # before joining: bad configs fail fast
        distributed.initialize(args.coordinator_address, args.num_processes, args.process_id,
                               heartbeat_timeout_s=args.heartbeat_timeout_s)  # fmt: skip
        _start_backends_quietly()
        from t5lite.cli import registry as reg

        fn = {"train": reg.train, "eval": reg.evaluate, "infer": reg.infer, "cache": reg.cache,
              "inspect": reg.inspect, "plan": reg.plan}[args.command]  # fmt: skip
        kwargs: dict = {}
        if args.command == "cache":  # the training run's data; Beam options from the flags
            kwargs.update(data=reg.DataConfig(), pipeline_args=unknown)
        if args.topology and args.command in ("inspect", "plan"):
            kwargs["topology"] = args.topology
        kwargs.update(insight_flags)
        if args.command == "train":  # config.gin: what this run used, written once it is set up
            kwargs["operative_config"] = gin_utils.operative_config
        fn(**kwargs)
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


def _fake_host_devices(args: argparse.Namespace) -> None:
    """Sets XLA_FLAGS for --host_device_count (or a --topology's device count) before JAX."""
    if args.topology and not args.host_device_count:  # the gin-built mesh needs as many devices
        from t5lite.insight.topology import num_devices

        args.host_device_count = num_devices(args.topology)
    if args.host_device_count:
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = (
            f"{flags} --xla_force_host_platform_device_count={args.host_device_count}"
        )
        os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _insight_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """inspect/plan keyword arguments from --device, --wide and --plot; ValueError naming the
    flag when --device names no known chip or --plot cannot be drawn."""
    flags = {"device": args.device, "wide": args.wide or None, "plot": args.plot}
    flags = {k: v for k, v in flags.items() if v}
    if flags and args.command not in ("inspect", "plan"):
        parser.error(f"--{next(iter(flags))} is for inspect and plan only")
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
