"""Checkpoints: round trip, resharding, async, atomic commit, keep policy, bad input."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorstore as ts
from conftest import require_devices
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from t5lite.checkpoint import (
    FORMAT_VERSION,
    CheckpointError,
    CheckpointManager,
    committed_steps,
    restore_checkpoint,
    staging,
)
from t5lite.checkpoint import tensorstore_io as tsio

HELPER = Path(__file__).with_name("checkpoint_helper.py")
REPO = HELPER.parent.parent


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    params: dict
    opt_state: dict


def mesh(shape):
    require_devices(8)
    return jax.make_mesh(shape, ("data", "model"))


def make_state(m, with_nan: bool = False) -> TrainState:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 32), dtype=np.float32)
    w[0, 1] = -0.0  # bit-exactness, not just closeness
    if with_nan:  # restoring it needs allow_non_finite=True
        w[0, 0] = np.nan
    emb = rng.standard_normal((64, 8), dtype=np.float32)
    put = lambda x, spec: jax.device_put(x, NamedSharding(m, spec))
    return TrainState(
        step=put(np.array(7, np.int32), P()),
        params={
            "dense": {"kernel": put(w, P("data", "model")), "bias": put(w[0], P("model"))},
            "embed": put(emb, P("model", None)),
            "scale": put(rng.standard_normal(8).astype(jnp.bfloat16), P()),
        },
        opt_state={"mu": put(w * 2, P(None, "model")), "count": put(np.arange(4), P("data"))},
    )


LOGICAL = {
    "step": P(),
    "params": {
        "dense": {"kernel": P("embed", "mlp"), "bias": P("mlp")},
        "embed": P("vocab", "embed"),
        "scale": P("embed"),
    },
}


def abstract(state, specs_for=None, m=None):
    """ShapeDtypeStructs of `state`, resharded to `specs_for(path)` on mesh `m` if given."""

    def f(path, x):
        sh = x.sharding if m is None else NamedSharding(m, specs_for(jax.tree_util.keystr(path)))
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)

    return jax.tree_util.tree_map_with_path(f, state)


def assert_bit_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


def test_round_trip_bit_exact(tmp_path):
    m = mesh((2, 4))
    state = make_state(m, with_nan=True)
    extra = {"step": 7, "rng": [0, 42], "data": {"epoch": 1, "offsets": [3, 5]}}
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(7, state, extra=extra, logical_axes=LOGICAL)
        mgr.wait()
        assert mgr.latest_step() == 7 and mgr.all_steps() == [7]
        restored, got_extra = mgr.restore(abstract(state), allow_non_finite=True)
    assert isinstance(restored, TrainState)
    assert_bit_equal(restored, state)
    assert got_extra == extra
    for x, y in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        assert x.sharding == y.sharding
    # The layout is plain: metadata is JSON, each array opens with plain tensorstore.
    d = tmp_path / "checkpoint_7"
    meta = json.loads((d / "metadata.json").read_text())
    assert meta["format_version"] == FORMAT_VERSION and meta["step"] == 7
    kernel = meta["arrays"]["params/dense/kernel"]
    assert kernel["logical_axes"] == ["embed", "mlp"] and kernel["shape"] == [16, 32]
    assert meta["tree"]["params"]["dense"]["kernel"] == "params/dense/kernel"
    store = ts.open(
        {
            "driver": "zarr3",
            "kvstore": {"driver": "file", "path": str(d / "arrays" / kernel["dir"])},
        }
    ).result()
    assert (
        np.asarray(store.read().result()).tobytes()
        == np.asarray(state.params["dense"]["kernel"]).tobytes()
    )
    # No target: nested dicts of numpy arrays as stored.
    raw, _ = CheckpointManager(tmp_path).restore(None, allow_non_finite=True)
    assert (
        np.asarray(raw["params"]["embed"]).tobytes() == np.asarray(state.params["embed"]).tobytes()
    )


@pytest.mark.parametrize("shape", [(8, 1), (1, 8), (4, 2)])
def test_restore_on_other_meshes_and_rules(tmp_path, shape):
    state = make_state(mesh((2, 4)))
    mgr = CheckpointManager(tmp_path, async_save=False)
    mgr.save(1, state)
    m2 = mesh(shape)
    # Different rules: swap which mesh axis shards which dimension.
    rules = {
        "['params']['dense']['kernel']": P("model", "data"),
        "['params']['embed']": P(("data", "model"), None),
        "['opt_state']['mu']": P("data", None),
    }
    target = abstract(state, lambda k: rules.get(k, P()), m2)
    restored, _ = mgr.restore(target)
    assert_bit_equal(restored, state)
    for x, t in zip(jax.tree.leaves(restored), jax.tree.leaves(target)):
        assert x.sharding == t.sharding


def test_dtype_cast_params_only_and_assignment_map(tmp_path):
    m = mesh((2, 4))
    state = make_state(m)
    mgr = CheckpointManager(tmp_path, async_save=False)
    mgr.save(3, state, extra={"step": 3})
    kernel = state.params["dense"]["kernel"]

    # fp32 -> bf16 on restore.
    target = abstract(state)
    target = target.replace(
        params={
            **target.params,
            "embed": jax.ShapeDtypeStruct((64, 8), jnp.bfloat16, sharding=kernel.sharding),
        }
    )
    restored, _ = mgr.restore(target)
    assert restored.params["embed"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        restored.params["embed"], np.asarray(state.params["embed"]).astype(jnp.bfloat16)
    )

    # Params only: optimizer state and step keep their fresh values, no extra state.
    fresh = jax.tree.map(jnp.zeros_like, state)
    restored, extra = mgr.restore(fresh, params_only=True)
    assert extra is None
    assert_bit_equal(restored.params, state.params)
    assert_bit_equal(restored.opt_state, fresh.opt_state)
    assert int(restored.step) == 0

    # A renamed parameter via the regex assignment map; a new parameter falls back to init.
    new = {"mlp": {"wi": jnp.zeros_like(kernel)}, "new_bias": jnp.ones(3)}
    with pytest.raises(CheckpointError, match=r"'params/mlp/wi'.*missing"):
        mgr.restore({"params": new}, with_extra=False)
    amap = [(r"params/mlp/wi", r"params/dense/kernel"), (r"params/new_.*", None)]
    restored, _ = mgr.restore({"params": new}, assignment_map=amap)
    assert_bit_equal(restored["params"]["mlp"]["wi"], kernel)
    np.testing.assert_array_equal(restored["params"]["new_bias"], np.ones(3))
    # Non-strict: missing parameters keep their initial value.
    restored, _ = mgr.restore(
        {"params": {"dense": {"kernel": kernel * 0}, "extra_w": jnp.ones(2)}}, strict=False
    )
    assert_bit_equal(restored["params"]["dense"]["kernel"], kernel)
    np.testing.assert_array_equal(restored["params"]["extra_w"], np.ones(2))
    with pytest.raises(
        CheckpointError, match=r"target 'params/extra_w' is not restored.*no initial value"
    ):
        mgr.restore({"params": {"extra_w": jax.ShapeDtypeStruct((2,), jnp.float32)}}, strict=False)


def test_async_saves_hold_their_step_despite_donation(tmp_path):
    m = mesh((2, 4))
    sh = NamedSharding(m, P("data", "model"))
    x = jax.device_put(np.zeros((64, 64), np.float32), sh)
    host = {"counter": np.zeros(4, np.int64)}
    # Donation lets XLA overwrite the buffers the previous save copied from.
    step_fn = jax.jit(lambda s: s + 1.0, donate_argnums=0, out_shardings=sh)
    mgr = CheckpointManager(tmp_path, async_save=True)
    for step in range(1, 6):
        x = step_fn(x)
        host["counter"][:] = step
        mgr.save(step, {"x": x, "host": host["counter"]}, extra={"step": step})
        host["counter"][:] = -1  # mutate the numpy leaf right after save returns
    mgr.wait()
    for step in range(1, 6):
        tgt = {
            "x": jax.ShapeDtypeStruct((64, 64), jnp.float32, sharding=sh),
            "host": np.zeros(4, np.int64),
        }
        got, extra = mgr.restore(tgt, step=step)
        assert extra == {"step": step}
        np.testing.assert_array_equal(got["x"], np.full((64, 64), step, np.float32))
        np.testing.assert_array_equal(got["host"], np.full(4, step))


def test_device_copy_save_survives_donation_in_the_next_call(tmp_path):
    """On CPU `save` only dispatches the shard copies; the step dispatched right after it
    donates (and overwrites in place) the saved arrays, yet each checkpoint holds its own step's
    values. The runtime's copies are not kept as the next save's host buffers."""
    m = mesh((2, 4))
    specs = {"w": P("data", "model"), "r": P(None, "model")}  # `r` replicated over `data`
    shard = {k: NamedSharding(m, v) for k, v in specs.items()}
    # 4 MiB per array: copies that take a while next to the dispatch of the next step.
    state = {k: jax.device_put(np.zeros((1024, 1024), np.float32), sh) for k, sh in shard.items()}
    step_fn = jax.jit(lambda s: jax.tree.map(lambda x: x + 1.0, s), donate_argnums=0)
    mgr = CheckpointManager(tmp_path, async_save=True)
    for step in range(1, 4):
        state = step_fn(state)
        mgr.save(step, state)
        donated = state
        state = step_fn(state)
        assert all(x.is_deleted() for x in jax.tree.leaves(donated))  # donation took place
    mgr.wait()
    # The writer waited for device copies; each array written once (replica 0 of `r` only).
    assert "stage_wait_s" in mgr.last_save_stats and mgr._spare == {}
    assert mgr.last_save_stats["bytes"] == 2 * 1024 * 1024 * 4
    for step in range(1, 4):
        got, _ = mgr.restore({k: np.zeros((1024, 1024), np.float32) for k in shard}, step=step)
        for k in shard:
            # saved after 2 * step - 1 updates, the next update donated it
            np.testing.assert_array_equal(got[k], np.full((1024, 1024), 2 * step - 1, np.float32))


@pytest.mark.parametrize("keep", [True, False])
def test_saves_stage_into_the_previous_saves_host_buffers(tmp_path, keep):
    """Staging reuses the last committed save's host copy (no fresh pages to fault in) unless
    told not to keep it; a changed sharding stages afresh. Every step still restores exactly."""
    m = mesh((2, 4))
    put = lambda v, spec: jax.device_put(np.full((64, 64), v, np.float32), NamedSharding(m, spec))
    mgr = CheckpointManager(tmp_path, async_save=True, keep_host_buffers=keep, device_copy=False)
    mgr.save(1, {"x": put(1, P("data", "model"))})
    mgr.wait()
    first = mgr._spare.get("x")
    mgr.save(2, {"x": put(2, P("data", "model"))})
    mgr.wait()
    assert (first is not None) == keep and (mgr._spare.get("x") is first)
    mgr.save(3, {"x": put(3, P("model", "data"))})
    mgr.wait()
    assert (mgr._spare.get("x") is not None) == keep and (
        mgr._spare.get("x") is not first or not keep
    )
    for step in (1, 2, 3):
        got, _ = mgr.restore({"x": np.zeros((64, 64), np.float32)}, step=step)
        np.testing.assert_array_equal(got["x"], np.full((64, 64), step, np.float32))


def test_async_failure_surfaces_at_wait(tmp_path):
    mgr = CheckpointManager(tmp_path, async_save=True)
    mgr.save(1, {"s": np.array(["not", "numeric"])})  # zarr3 cannot store unicode strings
    with pytest.raises(CheckpointError, match=r"checkpoint_1\.tmp"):
        mgr.wait()
    assert mgr.all_steps() == []
    mgr.save(1, {"s": np.arange(3)})  # the failed attempt's temp dir is replaced
    mgr.close()
    assert mgr.all_steps() == [1]


def test_keep_last_n_and_keep_period(tmp_path):
    mgr = CheckpointManager(tmp_path, save_period=2, keep=2, keep_period=4, async_save=True)
    state = {"w": jnp.arange(4.0)}
    for step in range(1, 12):
        mgr.maybe_save(step, state, is_final=step == 11)
    mgr.close()
    # Saved 2,4,6,8,10 and final 11; keep the last two plus multiples of 4.
    assert mgr.all_steps() == [4, 8, 10, 11]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"checkpoint_{s}" for s in (10, 11, 4, 8)]


def test_existing_step_is_never_overwritten(tmp_path):
    mgr = CheckpointManager(tmp_path, async_save=False)
    mgr.save(5, {"w": jnp.ones(3)})
    with pytest.raises(CheckpointError, match="checkpoint_5 already exists"):
        mgr.save(5, {"w": jnp.zeros(3)})
    got, _ = mgr.restore({"w": jnp.zeros(3)})
    np.testing.assert_array_equal(got["w"], np.ones(3))


def test_uncommitted_dirs_are_ignored_and_cleaned(tmp_path):
    mgr = CheckpointManager(tmp_path, async_save=False)
    mgr.save(1, {"w": jnp.ones(3)})
    (tmp_path / "checkpoint_2.tmp" / "arrays").mkdir(parents=True)
    (tmp_path / "checkpoint_3").mkdir()  # no COMMIT: not ours to trust (nor to delete)
    assert mgr.latest_step() == 1
    got, _ = mgr.restore({"w": jnp.zeros(3)})
    np.testing.assert_array_equal(got["w"], np.ones(3))
    assert not (tmp_path / "checkpoint_2.tmp").exists()
    with pytest.raises(CheckpointError, match="checkpoint_3 is not committed"):
        mgr.restore({"w": jnp.zeros(3)}, step=3)


# --- bad input: one clear error naming the array, nothing deleted ---------------------------


@pytest.fixture
def saved(tmp_path):
    m = mesh((2, 4))
    # 8 MiB kernel -> several chunks of at most 1 MiB.
    w = jax.device_put(
        np.arange(2048 * 1024, dtype=np.float32).reshape(2048, 1024),
        NamedSharding(m, P("data", "model")),
    )
    mgr = CheckpointManager(tmp_path, async_save=False, chunk_bytes=1 << 20)
    mgr.save(1, {"params": {"w": w, "b": jnp.ones(4)}})
    d = tmp_path / "checkpoint_1"
    files_before = sorted(str(p) for p in d.rglob("*"))
    yield mgr, {"params": {"w": w, "b": jnp.ones(4)}}, d
    assert sorted(str(p) for p in d.rglob("*")) == files_before  # nothing deleted


def chunk_files(d: Path, leaf: str = "params.w") -> list[Path]:
    return sorted(p for p in (d / "arrays" / leaf / "c").rglob("*") if p.is_file())


def test_bad_missing_directory(tmp_path):
    mgr = CheckpointManager(tmp_path / "empty")
    with pytest.raises(CheckpointError, match=r"no committed checkpoint in .*empty"):
        mgr.restore({"w": jnp.ones(1)})
    with pytest.raises(CheckpointError, match=r"checkpoint directory .*nowhere does not exist"):
        mgr.restore({"w": jnp.ones(1)}, step=tmp_path / "nowhere")


def test_bad_truncated_chunk(saved):
    mgr, state, d = saved
    f = chunk_files(d)[3]
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(
        CheckpointError, match=r"array 'params/w' cannot be read.*(Not enough data|truncat)"
    ):
        mgr.restore(state)


def test_bad_corrupt_chunk(saved):
    mgr, state, d = saved
    f = chunk_files(d)[1]
    data = bytearray(f.read_bytes())
    data[1234] ^= 0x10
    f.write_bytes(bytes(data))
    with pytest.raises(
        CheckpointError, match=r"array 'params/w' cannot be read.*[Dd]igest mismatch"
    ):
        mgr.restore(state)


def test_bad_missing_chunk(saved):
    mgr, state, d = saved
    f = chunk_files(d)[0]
    data = f.read_bytes()
    f.unlink()
    try:
        with pytest.raises(CheckpointError, match=r"array 'params/w' cannot be read.*missing"):
            mgr.restore(state)
    finally:
        f.write_bytes(data)


def test_bad_shape_and_dtype_mismatch(saved):
    mgr, state, _ = saved
    with pytest.raises(
        CheckpointError,
        match=r"array 'params/b' has shape \(4,\), target 'params/b' expects \(5,\)",
    ):
        mgr.restore({"params": {**state["params"], "b": jnp.ones(5)}})
    with pytest.raises(
        CheckpointError,
        match=r"array 'params/b' has dtype float32, target 'params/b' expects int32",
    ):
        mgr.restore({"params": {**state["params"], "b": jnp.ones(4, jnp.int32)}})


def test_bad_newer_format_version(saved):
    mgr, state, d = saved
    f = d / "metadata.json"
    original = f.read_text()
    meta = json.loads(original)
    meta["format_version"] = FORMAT_VERSION + 1
    f.write_text(json.dumps(meta))
    try:
        with pytest.raises(CheckpointError, match=f"format version {FORMAT_VERSION + 1}, newer"):
            mgr.restore(state)
    finally:
        f.write_text(original)


# --- crash safety and preemption, in subprocesses ---------------------------------------------


def child_env() -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def wait_ready(proc: subprocess.Popen, word: str = "READY") -> None:
    line = proc.stdout.readline()
    assert word in line, (
        f"child said {line!r}; stderr: {proc.stderr.read() if proc.poll() is not None else ''}"
    )


def test_sigkill_during_save_leaves_previous_checkpoint(tmp_path):
    from checkpoint_helper import state_at

    m = mesh((2, 4))
    rnd = random.Random(0)
    partial = 0
    for trial in range(3):
        d = tmp_path / f"t{trial}"
        proc = subprocess.Popen(
            [sys.executable, str(HELPER), "loop", str(d)],
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        wait_ready(proc)  # step 1 is committed; saves of steps 2, 3, ... run back to back
        time.sleep(rnd.uniform(0.0, 0.6))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        steps = committed_steps(d)
        partial += bool(list(d.glob("*.tmp")))
        assert steps and steps == list(range(1, steps[-1] + 1))
        mgr = CheckpointManager(d)
        target = abstract(state_at(1, m))
        restored, extra = mgr.restore(target)
        assert_bit_equal(restored, state_at(steps[-1], m))
        assert extra == {"step": steps[-1]}
        assert not list(d.glob("*.tmp"))  # the partial save was cleaned up
    assert partial >= 1  # at least one kill landed inside a save


def test_sigterm_saves_and_exits_cleanly(tmp_path):
    from checkpoint_helper import state_at

    proc = subprocess.Popen(
        [sys.executable, str(HELPER), "train", str(tmp_path)],
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_ready(proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    step = int(out.split("PREEMPTED")[1])
    assert committed_steps(tmp_path) == [step]
    m = mesh((2, 4))
    restored, extra = CheckpointManager(tmp_path).restore(abstract(state_at(1, m, n=2)))
    assert_bit_equal(restored, state_at(step, m, n=2))
    assert extra == {"step": step}


def _two_helper_processes(mode: str, directory: Path) -> list[subprocess.Popen]:
    """Starts `checkpoint_helper.py MODE` as processes 0 and 1 of one 2 x 4-device runtime."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = child_env()
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    return [
        subprocess.Popen(
            [sys.executable, str(HELPER), mode, str(directory), str(port), str(pid)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for pid in range(2)
    ]


def _outputs(procs: list[subprocess.Popen], timeout: float = 120) -> list[tuple[str, str]]:
    """(stdout, stderr) of every process; on a timeout, kills them all and fails with what each
    printed (a hang in one process shows as a timeout in its peer, which waits at shutdown)."""
    try:
        return [p.communicate(timeout=timeout) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        tails = [f"process {i}: {o[-1500:]!r} {e[-1500:]!r}" for i, (o, e) in
                 enumerate(p.communicate() for p in procs)]  # fmt: skip
        pytest.fail(f"timed out after {timeout} s:\n" + "\n".join(tails))


def test_two_processes_save_one_restores(tmp_path):
    from checkpoint_helper import multi_state

    procs = _two_helper_processes("multi", tmp_path)
    for p, (out, err) in zip(procs, _outputs(procs)):
        assert p.returncode == 0 and "DONE" in out, err[-3000:]
        # Each process wrote its params' chunks itself; `rows` shares chunks across processes.
        assert "DONE direct=4 tensorstore=1" in out
    m = mesh((4, 2))
    target = abstract(multi_state(m))
    restored, extra = CheckpointManager(tmp_path).restore(target)
    assert_bit_equal(restored, multi_state(m))
    assert extra == {"step": 7, "pid_count": 2}


@pytest.mark.parametrize("nan_row", [None, 40], ids=["finite", "nan_in_one_process_half"])
def test_two_processes_restore_and_agree_on_non_finite(tmp_path, nan_row):
    """Each process reads and checks only its own half of the rows; a NaN in one half makes
    both processes refuse the checkpoint with the same error (the verdicts are combined)."""
    from checkpoint_helper import state_at

    m = mesh((2, 4))
    state = state_at(7, m, n=4)
    if nan_row is not None:
        w = np.asarray(state["params"]["w2"]).copy()
        w[nan_row, 5] = np.nan
        state["params"]["w2"] = jax.device_put(w, state["params"]["w2"].sharding)
    CheckpointManager(tmp_path, async_save=False).save(7, state)
    outs = _outputs(_two_helper_processes("multi_restore", tmp_path))
    # (Gloo prints its own lines to stdout.)
    lines = [
        next((x for x in out.splitlines() if x.startswith(("RESTORED", "REFUSED"))), err[-2000:])
        for out, err in outs
    ]
    if nan_row is None:
        total = sum(float(np.asarray(v).sum()) for v in state["params"].values())
        assert all(line.startswith("RESTORED ") for line in lines), lines
        assert sum(float(line.split()[1]) for line in lines) == pytest.approx(total, rel=1e-6)
    else:
        assert (
            lines[0]
            == lines[1]
            == (
                f"REFUSED checkpoint {tmp_path / 'checkpoint_7'}: array 'params/w2' holds NaN or "
                "Inf (a diverged run?); restore an earlier checkpoint, or pass "
                "allow_non_finite=True to read it anyway"
            )
        ), lines


def test_a_failed_write_on_one_process_fails_the_save_everywhere(tmp_path):
    """No process waits forever for a peer whose write failed, and nothing is committed."""
    procs = _two_helper_processes("multi_fail", tmp_path)
    outs = [out for out, _ in _outputs(procs)]
    assert "writing checkpoint" in outs[0] and "failed on another process; not committed" in outs[0]
    assert "disk full (simulated)" in outs[1]
    assert not (tmp_path / "checkpoint_7").exists()
    assert CheckpointManager(tmp_path).latest_step() is None


def test_chunk_shape_is_mesh_independent():
    assert tsio.chunk_shape_for((2048, 1024), 4, 1 << 20) == [512, 512]
    assert tsio.chunk_shape_for((3, 5), 4, 1 << 20) == [3, 5]
    assert tsio.chunk_shape_for((), 4) == []
    assert tsio.chunk_shape_for((0, 7), 4) == [1, 7]


def test_chunks_spanning_several_shards_round_trip(tmp_path):
    # Chunks (16, 16) hold four (8, 8) shards each: writes into one chunk must merge, not clobber.
    m = mesh((2, 4))
    x = np.random.default_rng(1).standard_normal((16, 32), dtype=np.float32)
    y = np.arange(6 * 24, dtype=np.int32).reshape(6, 24)
    state = {
        "x": jax.device_put(x, NamedSharding(m, P("data", "model"))),
        "y": jax.device_put(y, NamedSharding(m, P(None, "model"))),
    }
    mgr = CheckpointManager(tmp_path, async_save=False, chunk_bytes=1024)
    mgr.save(1, state)
    meta = json.loads((tmp_path / "checkpoint_1" / "metadata.json").read_text())
    zarr = json.loads(
        (
            tmp_path / "checkpoint_1" / "arrays" / meta["arrays"]["x"]["dir"] / "zarr.json"
        ).read_text()
    )
    assert zarr["chunk_grid"]["configuration"]["chunk_shape"] == [16, 16]
    restored, _ = mgr.restore(abstract(state, lambda k: P("model", "data"), mesh((4, 2))))
    assert_bit_equal(restored, state)


def _files(root: Path) -> dict[str, bytes]:
    return {str(f.relative_to(root)): f.read_bytes() for f in root.rglob("*") if f.is_file()}


@pytest.mark.parametrize(
    "dtype,shape,spec,chunk_bytes,direct",
    [
        (np.float32, (64, 48), P("data", "model"), 256, True),  # 2 x 4 chunks per shard
        (np.float32, (64, 48), P("model", None), 256, True),  # chunks strided in their shard
        (jnp.bfloat16, (32, 16), P("data", None), 64, True),  # 2-byte ml_dtype
        (np.float32, (5, 7), P(), 64, True),  # chunks (5, 2): the last one is padded
        (np.bool_, (16, 8), P(), 1 << 20, True),
        (np.int32, (32, 32), P("data", "model"), 4096, True),  # one chunk filled by 8 shards
        (np.float32, (24, 10), P("data", None), 64, True),  # chunks (3, 5) inside (12, 10) shards
        (np.float32, (12,), P(), 1 << 20, True),
    ],
)
@pytest.mark.parametrize("checksum", [True, False])
def test_direct_chunk_writes_are_tensorstores_bytes(
    tmp_path, dtype, shape, spec, chunk_bytes, direct, checksum
):
    """The direct writer produces byte for byte the files TensorStore writes for the same
    pieces, and leaves to TensorStore the arrays whose chunks span several shards."""
    m = mesh((2, 4))
    host = (np.random.default_rng(3).standard_normal(shape) * 4).astype(dtype)
    h = staging.stage_to_host(jax.device_put(host, NamedSharding(m, spec)))
    stats: dict = {}
    ctx = tsio.make_context()
    tsio.write_arrays([(str(tmp_path / "a"), h)], ctx, chunk_bytes, checksum, stats=stats)
    assert (stats["direct_arrays"], stats["tensorstore_arrays"]) == (int(direct), int(not direct))
    ref = [(str(tmp_path / "b"), h)]
    ts_writes = tsio._start_tensorstore_writes(ref, ctx, chunk_bytes, checksum)
    tsio._finish_tensorstore_writes(ref, ts_writes)
    assert _files(tmp_path / "a") == _files(tmp_path / "b")
    back = tsio.read_arrays([(str(tmp_path / "a"), shape, dtype, None)], ctx)[0]
    assert back.tobytes() == host.tobytes()
    if checksum and direct:  # the stored crc32c is checked on read
        f = max(p for p in (tmp_path / "a" / "c").rglob("*") if p.is_file())
        f.write_bytes(f.read_bytes()[:-1] + bytes([f.read_bytes()[-1] ^ 1]))
        with pytest.raises(ValueError):
            tsio.read_arrays([(str(tmp_path / "a"), shape, dtype, None)], ctx)


def test_numpy_and_scalar_leaves_restore_as_numpy(tmp_path):
    mgr = CheckpointManager(tmp_path, async_save=False)
    mgr.save(2, {"count": 5, "table": np.arange(6, dtype=np.int64).reshape(2, 3)})
    got, _ = mgr.restore({"count": 0, "table": np.zeros((2, 3), np.int64)})
    assert int(got["count"]) == 5 and isinstance(got["table"], np.ndarray)
    np.testing.assert_array_equal(got["table"], np.arange(6).reshape(2, 3))


def test_bad_unsaveable_leaf_names_the_array(tmp_path):
    mgr = CheckpointManager(tmp_path, async_save=False)
    with pytest.raises(CheckpointError, match=r"cannot save array 'state/rng'.*key_data"):
        mgr.save(1, {"state": {"rng": jax.random.key(0), "w": jnp.ones(2)}})
    assert mgr.all_steps() == []


def test_pending_async_save_finishes_before_exit(tmp_path):
    from checkpoint_helper import state_at

    out = subprocess.run(
        [sys.executable, str(HELPER), "exit", str(tmp_path)],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert committed_steps(tmp_path) == [3]
    m = mesh((2, 4))
    restored, _ = CheckpointManager(tmp_path).restore(abstract(state_at(3, m)))
    assert_bit_equal(restored, state_at(3, m))


def test_all_zero_arrays_round_trip(tmp_path):
    """Zarr elides fill-value chunks by default; an all-zero array must still restore."""
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    sh = NamedSharding(mesh, P("data", "model"))
    state = {"zeros": jax.device_put(np.zeros((16, 32), np.float32), sh),
             "count": jax.device_put(np.zeros((), np.int32))}  # fmt: skip
    mgr = CheckpointManager(tmp_path, async_save=False)
    mgr.save(1, state)
    target = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )
    restored, _ = mgr.restore(target)
    mgr.close()
    np.testing.assert_array_equal(restored["zeros"], np.zeros((16, 32), np.float32))
    assert restored["zeros"].sharding == sh
    assert int(restored["count"]) == 0


def _write_with_tensorstore(path: Path, x: np.ndarray, chunks, codecs=None) -> None:
    spec = tsio.array_spec(str(path), x.shape, x.dtype)
    spec["metadata"]["chunk_grid"]["configuration"]["chunk_shape"] = list(chunks)
    if codecs is not None:
        spec["metadata"]["codecs"] = codecs
    ts.open(spec, create=True).result().write(x).result()


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.float16])
def test_direct_reads_place_check_and_flag_every_chunk(tmp_path, dtype):
    """The direct reader fills every shard as TensorStore would (whole chunks read in place,
    clipped and padded edge chunks copied) and flags a NaN or Inf in whichever chunk it lies,
    per array; a codec it does not decode goes through TensorStore, unchecked."""
    m = mesh((2, 4))
    x = (np.random.default_rng(5).standard_normal((24, 10)) * 4).astype(dtype)
    _write_with_tensorstore(tmp_path / "x", x, (4, 10))  # whole rows: some read in place
    _write_with_tensorstore(tmp_path / "e", x, (5, 4))  # edge chunks padded in both dims
    zstd = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "zstd"}]
    _write_with_tensorstore(tmp_path / "z", x, (6, 5), zstd)
    shardings = [
        NamedSharding(m, s) for s in (P("model", None), P(None, "data"), P(("data", "model")))
    ]
    ctx = tsio.make_context()
    items = [(str(tmp_path / "x"), x.shape, dtype, s) for s in shardings]
    items += [(str(tmp_path / "e"), x.shape, dtype, s) for s in shardings]
    items += [
        (str(tmp_path / "x"), x.shape, dtype, None),
        (str(tmp_path / "z"), x.shape, dtype, shardings[0]),
    ]
    stats, finite = {}, []
    got = tsio.read_arrays(items, ctx, stats=stats, finite=finite)
    for y, (*_, sh) in zip(got, items):
        assert np.asarray(y).tobytes() == x.tobytes()
        if sh is not None:
            assert y.sharding == sh
    assert (stats["direct_arrays"], stats["tensorstore_arrays"]) == (7, 1)
    assert 0 < stats["chunks_copied"] < stats["chunks"]
    assert finite == [True] * 7 + [None]
    for i, bad in [(0, np.nan), (23, np.inf), (13, -np.inf)]:  # first, padded edge, middle rows
        y = x.copy()
        y[i, 9 - i % 3] = bad
        _write_with_tensorstore(tmp_path / f"bad{i}", y, (5, 4))
        flags: list = []
        items = [(str(tmp_path / f"bad{i}"), y.shape, dtype, s) for s in shardings]
        items.append((str(tmp_path / "x"), x.shape, dtype, shardings[1]))
        tsio.read_arrays(items, ctx, finite=flags)
        assert flags == [False, False, False, True]


def test_non_finite_after_a_cast_is_refused(tmp_path):
    """Stored values are finite but overflow the target dtype: the reader does not check casts,
    the jitted check after it does."""
    mgr = CheckpointManager(tmp_path, async_save=False)
    mgr.save(1, {"w": jnp.array([1.0, 7e4], jnp.float32)})
    with pytest.raises(CheckpointError, match=r"array 'w' holds NaN or Inf"):
        mgr.restore({"w": jax.ShapeDtypeStruct((2,), jnp.float16, sharding=None)})
    got, _ = mgr.restore({"w": jax.ShapeDtypeStruct((2,), jnp.float32, sharding=None)})
    assert np.asarray(got["w"]).tolist() == [1.0, 7e4]


@pytest.mark.parametrize(
    "mesh_shape,spec,reads,copied",
    # (2048, 1024) in chunks of (512, 512), read once per distinct shard range, and `b`'s one.
    [((2, 4), P("model", None), 4 * 2 + 1, 0), ((8, 1), P(None, "data"), 8 * 4 + 1, 8 * 4)],
    ids=["read_in_place_row_by_row", "read_whole_and_copied_in_part"],
)
def test_bad_corrupt_chunk_names_the_file(saved, mesh_shape, spec, reads, copied):
    """A chunk narrower than its shard is read in place as one block per row; a chunk wider
    than its shard is read into a scratch buffer and copied in part: the checksum is checked
    either way, and the one-line error names the array and the file."""
    _, state, d = saved
    f = chunk_files(d)[2]
    data = bytearray(f.read_bytes())
    data[-9] ^= 0x01
    f.write_bytes(bytes(data))
    target = abstract(state, lambda k: spec if "'w'" in k else P(), mesh(mesh_shape))
    stats: dict = {}
    with pytest.raises(CheckpointError) as e:
        restore_checkpoint(d, target, stats=stats)
    msg = str(e.value)
    assert "\n" not in msg and "array 'params/w' cannot be read" in msg
    assert f"chunk {f}: crc32c digest mismatch" in msg
    f.write_bytes(bytes(data[:-9]) + bytes([data[-9] ^ 0x01]) + bytes(data[-8:]))
    got, _ = restore_checkpoint(d, target, stats=stats)
    assert_bit_equal(got, state)
    assert (stats["chunks"], stats["chunks_copied"]) == (reads, copied)
