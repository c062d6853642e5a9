"""Shared test set-up: 8 fake CPU devices, set before JAX is imported anywhere."""

import collections
import os
import tempfile

# NOTE: must run before the first `import jax` of the test session; conftest.py is imported by
# pytest before any test module, so this is the one place that can guarantee it.
_flags = os.environ.get("XLA_FLAGS", "")
if "--xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA:CPU runs a collective by blocking a thread of one pool, sized max(cores, devices): 8 threads
# for 8 fake devices on a small host. A scanned loop whose body holds collectives lets the step
# go on to the next collective while the loop's are pending, so a device can hold two or three
# threads at once and the pool runs dry with peers' collectives still queued (an abort at XLA's
# rendezvous timeout). PJRT_NPROC (read by XLA's DefaultThreadPoolSize) sizes the pool; the CLI's
# --host_device_count sets the same (t5lite/cli/main.py).
os.environ.setdefault("PJRT_NPROC", str(4 * 8))
# Compiled programs go to an on-disk cache shared by every test, xdist worker and CLI subprocess
# (they inherit the environment): most tests compile the same few small models, and compiling
# is most of the suite's time. Entries are keyed by the program, the XLA flags and the jaxlib
# version, so a stale entry is never used; a torn entry is recompiled with a warning.
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    os.path.join(tempfile.gettempdir(), f"t5lite-tests-xla-cache-{os.getuid()}"),
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# T5LITE_COUNT_COMPILES=1 (=test: per test): the terminal summary lists, per test file, the
# programs this process compiled (written to the compile cache: with an empty cache, every
# program compiled), the cache hits and the seconds spent in XLA's compile. Compiling is most
# of the suite's cold time, so this is what to read before making a test file cheaper (CLI
# subprocesses are not counted: they are other processes).
_COMPILES: dict[str, list[float]] = {}
_CURRENT_FILE = ["(collection)"]


def _count(name: str, seconds: float = 0.0) -> None:
    row = _COMPILES.setdefault(_CURRENT_FILE[0], [0, 0, 0.0])
    if name == "/jax/compilation_cache/cache_misses":
        row[0] += 1
    elif name == "/jax/compilation_cache/cache_hits":
        row[1] += 1
    elif name == "/jax/core/compile/backend_compile_duration":
        row[2] += seconds


if os.environ.get("T5LITE_COUNT_COMPILES"):
    jax.monitoring.register_event_listener(lambda name, **_: _count(name))
    jax.monitoring.register_event_duration_secs_listener(lambda name, s, **_: _count(name, s))

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(item):
        # T5LITE_COUNT_COMPILES=test: per test rather than per file.
        test = os.environ["T5LITE_COUNT_COMPILES"] == "test"
        _CURRENT_FILE[0] = item.nodeid if test else item.location[0]

    def pytest_terminal_summary(terminalreporter):
        terminalreporter.section("compiled programs (written to the cache / cache hits / s)")
        for f, (written, hits, secs) in sorted(_COMPILES.items()):
            terminalreporter.write_line(f"{f}: {written} / {hits} / {secs:.1f} s")


# The suite's longest files, longest first (CI's --durations, 2 workers), started before all
# others. Under `--dist loadfile` xdist queues whole files, by default those with the most
# tests first: these few-test files, each minutes of docs commands or TPU compiles, came last,
# and one worker ran the last of them while the other had nothing left to do. After them the
# rest keep xdist's order, most tests first, so the last files queued are short ones.
LONGEST_FILES = (
    "test_insight_accuracy.py",
    "test_readme.py",
    "test_readme_inspect.py",
    "test_tpu_memory.py",
    "test_readme_own_data.py",
    "test_moe_learns.py",
    "test_multihost.py",
    "test_tpu_memory_moe.py",
    "test_walkthrough.py",
    "test_benchmarks_smoke.py",
    "test_preemption.py",
    "test_tpu_memory_v5p.py",
    "test_ring_tpu_memory.py",
    "test_recovery.py",
    "test_splash_attention.py",
    "test_pipeline_bubble.py",
    "test_pipeline_tpu_memory.py",
    "test_divergence.py",
    "test_user_data_runs.py",
    "test_moe_memory.py",
    "test_tpu_aot.py",
)


def pytest_configure(config):
    # xdist's own order (most tests first) would undo the collection's order below.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    """The files of LONGEST_FILES first, in its order; then the rest, most tests first (the
    sort is stable: each file's tests keep their order)."""
    tests = collections.Counter(item.path.name for item in items)
    first = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda it: (first.get(it.path.name, len(first)), -tests[it.path.name]))


def require_devices(n: int) -> None:
    """Skips the calling test when fewer than `n` devices exist."""
    if jax.device_count() < n:
        pytest.skip(f"needs {n} devices, only {jax.device_count()} present")


@pytest.fixture
def devices8():
    require_devices(8)
    return jax.devices()[:8]


def run_cli(*argv: str) -> int:
    """`t5lite ARGV...` in this process, with gin's global config cleared before and after."""
    import gin

    from t5lite.cli import main

    with gin.unlock_config():
        gin.clear_config()
    try:
        return main.main(list(argv))
    finally:
        with gin.unlock_config():
            gin.clear_config()


def file_checksums(d, only: str = "") -> dict[str, str]:
    """sha256 of every file under `d` (whose path contains `only`): "nothing good changed"."""
    import hashlib
    from pathlib import Path

    d = Path(d)
    return {
        str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(d.rglob("*"))
        if p.is_file() and only in str(p)
    }


def reverse_batch(n: int, seed: int = 0, ragged: bool = False) -> dict:
    """An unpacked encoder-decoder batch of `n` reversal examples, inputs length 8, the last two
    target positions padding (and, with `ragged`, every third row's targets cut after 3 tokens,
    so rows differ in their number of real tokens)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    inputs = rng.integers(2, 32, size=(n, 8)).astype(np.int32)
    targets = inputs[:, ::-1].copy()
    targets[:, -2:] = 0
    if ragged:
        targets[::3, 3:] = 0
    dec_in = np.concatenate([np.zeros((n, 1), np.int32), targets[:, :-1]], axis=1)
    return {
        "encoder_input_tokens": inputs,
        "decoder_input_tokens": dec_in,
        "decoder_target_tokens": targets,
        "decoder_loss_weights": (targets > 0).astype(np.int32),
    }


def tpu_compile_result(
    script: str, *args: str, host_devices: int = 0, timeout: int = 300
) -> dict | list:
    """Runs `script` (with `args` in its `sys.argv[1:]`) in a fresh interpreter on the host
    backend alone (its TPU devices come from a topology: the test session's fake CPU devices
    must not meet the TPU plugin), with `host_devices` fake CPU devices if the script builds a
    mesh over them first, and returns the JSON it printed after `RESULT `."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["JAX_PLATFORMS"] = "cpu"
    if host_devices:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={host_devices}"
    out = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


QUICK_TRAIN = [
    "--gin_file=quickstart.gin",
    "--gin.BATCH_SIZE=8",
    "--gin.TASK_FEATURE_LENGTHS={'inputs': 16, 'targets': 16}",
    "--gin.train.evaluation=None",
    "--gin.LogConfig.period=1",
    "--gin.warmup_cosine_schedule.warmup_steps=2",
    # NOTE: the schedule's constants are compiled into the train step, and the quickstart decays
    # over TRAIN_STEPS: a fixed decay lets runs of any length share one compiled step (and the
    # on-disk compile cache's entry) instead of compiling one per TRAIN_STEPS.
    "--gin.warmup_cosine_schedule.decay_steps=40",
]
"""`t5lite train` flags for a quick quickstart run: short rows, a log line every step, no
evaluation, a learning-rate schedule independent of TRAIN_STEPS (add TRAIN_STEPS, MODEL_DIR and
the checkpoint period)."""
