"""Shared test set-up: 8 fake CPU devices, set before JAX is imported anywhere."""

import os
import tempfile

# NOTE: must run before the first `import jax` of the test session; conftest.py is imported by
# pytest before any test module, so this is the one place that can guarantee it.
_flags = os.environ.get("XLA_FLAGS", "")
if "--xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
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
