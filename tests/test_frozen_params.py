"""Fine-tuning a part of the model: `FrozenParams` freezes parameters by regex over their paths."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from conftest import require_devices, run_cli
from tiny_networks import TINY_T5, full_reversal_batch

from t5lite import partitioning
from t5lite.model import optimizers
from t5lite.model.models import EncoderDecoderModel
from t5lite.trainer import Trainer, summarize


def _paths(tree) -> list[str]:
    return ["/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
                     for k in path)
            for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]  # fmt: skip


def _trainer(optimizer) -> Trainer:
    require_devices(8)
    part = partitioning.Partitioner(num_partitions=2)  # Megatron: data=4 x model=2
    model = EncoderDecoderModel(TINY_T5, optimizer=optimizer)
    return Trainer(model, part, batch_size=8, lengths={"inputs": 8, "targets": 8})


@pytest.mark.parametrize("inner", [optimizers.AdamW(1e-2), optimizers.Adafactor(1e-2)],
                         ids=["adamw", "adafactor"])  # fmt: skip
def test_frozen_parameters_are_bit_identical_and_have_no_optimizer_state(inner):
    tr = _trainer(optimizers.FrozenParams(inner, ["encoder/.*", "token_embedder/.*"]))
    state = tr.init_state()
    before = jax.device_get(state.params)
    batch = full_reversal_batch(tr)
    losses = []
    for _ in range(5):
        state, metrics = tr.train_step(state, batch)
        losses.append(summarize(metrics)["loss"])
    after = jax.device_get(state.params)
    for name in ("encoder", "token_embedder"):
        for a, b in zip(jax.tree_util.tree_leaves(before[name]),
                        jax.tree_util.tree_leaves(after[name])):  # fmt: skip
            assert a.tobytes() == b.tobytes()
    changed = [not np.array_equal(a, b) for a, b in
               zip(jax.tree_util.tree_leaves(before["decoder"]),
                   jax.tree_util.tree_leaves(after["decoder"]))]  # fmt: skip
    assert all(changed) and losses[-1] < losses[0]
    # No statistics for a frozen parameter: every parameter-shaped state leaf is a decoder's.
    state_paths = [p for p in _paths(state.opt_state) if "/decoder/" in p or "/encoder/" in p
                   or "/token_embedder/" in p]  # fmt: skip
    assert state_paths and not [p for p in state_paths if "/encoder/" in p or "token_embedder" in p]
    # ...and the statistics of a trained parameter are sharded like it.
    wi = state.params["decoder"]["layers_0"]["mlp"]["wi_0"]["kernel"]
    leaves = zip(_paths(state.opt_state), jax.tree_util.tree_leaves(state.opt_state))
    suffix = "decoder/layers_0/mlp/wi_0/kernel"
    stats = [leaf for p, leaf in leaves if p.endswith(suffix) and leaf.shape == wi.shape]
    assert stats and all(s.sharding == wi.sharding for s in stats)


def test_frozen_state_is_smaller_than_the_full_optimizer_state():
    full = _trainer(optimizers.AdamW(1e-2)).state_abstract.opt_state
    part = _trainer(optimizers.FrozenParams(optimizers.AdamW(1e-2), ["encoder/.*"]))
    size = lambda t: sum(x.size for x in jax.tree_util.tree_leaves(t))
    enc = sum(x.size for x in jax.tree_util.tree_leaves(part.state_abstract.params["encoder"]))
    assert size(full) - size(part.state_abstract.opt_state) == 2 * enc  # AdamW's mu and nu


def test_patterns_that_match_nothing_or_everything_are_errors():
    with pytest.raises(ValueError, match=r"FrozenParams.patterns: 'encoderr/\.\*' matches no "
                       r"parameter \(paths look like 'decoder/"):  # fmt: skip
        _trainer(optimizers.FrozenParams(optimizers.AdamW(), ["encoderr/.*"]))
    with pytest.raises(ValueError, match="freeze every parameter: nothing would train"):
        _trainer(optimizers.FrozenParams(optimizers.AdamW(), [".*"]))


@pytest.mark.slow
def test_frozen_params_from_gin_checkpoint_and_resume(tmp_path):
    """In gin alone; the masked optimizer state checkpoints and resumes."""
    args = ["train", "--gin_file=quickstart.gin", "--host_device_count=8",
            f"--gin.MODEL_DIR='{tmp_path}'", "--gin.train.evaluation=None",
            "--gin.warmup_cosine_schedule.warmup_steps=1", "--gin.CheckpointConfig.period=1",
            "--gin.EncoderDecoderModel.optimizer=@FrozenParams()",
            "--gin.FrozenParams.optimizer=@AdamW()",
            "--gin.FrozenParams.patterns=['encoder/.*']"]  # fmt: skip
    # Stopped after step 2 of 3, as a preemption would, then resumed: the same TRAIN_STEPS (the
    # schedule's decay, compiled into the step) lets both runs share one compiled train step.
    assert run_cli(*args, "--gin.TRAIN_STEPS=3", "--gin.train.stop_after_steps=2") == 0
    assert run_cli(*args, "--gin.TRAIN_STEPS=3") == 0  # restores the masked optimizer state
    import tensorstore as ts

    def array(step: int, name: str) -> np.ndarray:
        d = tmp_path / f"checkpoint_{step}"
        meta = json.loads((d / "metadata.json").read_text())["arrays"]
        spec = {
            "driver": "zarr3",
            "kvstore": {"driver": "file", "path": str(d / "arrays" / meta[name]["dir"])},
        }
        return ts.open(spec).result().read().result()

    enc = "params/encoder/layers_0/mlp/wi_0/kernel"
    dec = "params/decoder/layers_0/mlp/wi_0/kernel"
    assert array(1, enc).tobytes() == array(3, enc).tobytes()
    assert not np.array_equal(array(1, dec), array(3, dec))
    meta = json.loads((tmp_path / "checkpoint_3" / "metadata.json").read_text())["arrays"]
    assert not [a for a in meta if a.startswith("opt_state") and "/encoder/" in a]
