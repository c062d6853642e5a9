"""Explicit sharding mode: `Partitioner(shard_mode='explicit')` on Explicit mesh axes trains the
quickstart's T5.1.1 with auto mode's losses, parameters placed by the rules; what it cannot run
is refused up front in one line."""

import dataclasses
import json
import os

import jax
import numpy as np
import pytest
from conftest import require_devices, reverse_batch, run_cli
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from t5lite import partitioning
from t5lite.model import network, optimizers
from t5lite.model.lora import LoRA
from t5lite.model.models import DecoderOnlyModel, EncoderDecoderModel
from t5lite.partitioning import Partitioner, PartitioningError
from t5lite.trainer import Trainer, summarize

# The quickstart's architecture (T5.1.1: gated GELU, relative position biases, untied logits)
# at a size that compiles quickly; heads and vocab divide the quickstart's model axis of 4.
SMALL = network.T5Config(
    vocab_size=32, emb_dim=16, num_heads=4, head_dim=4, mlp_dim=32, num_encoder_layers=1,
    num_decoder_layers=1,
)  # fmt: skip
STEPS = 3


def _train(preset: str, shard_mode: str, cfg=SMALL, num_microbatches: int = 1, mesh_kw=None,
           data_axis="data", **model_kw):  # fmt: skip
    part = Partitioner(
        **(mesh_kw or {"num_partitions": 4}), shard_mode=shard_mode,
        logical_axis_rules=partitioning.preset_rules(preset, data_axis=data_axis),
    )  # fmt: skip
    model = EncoderDecoderModel(cfg, optimizer=optimizers.AdamW(1e-2), **model_kw)
    tr = Trainer(model, part, batch_size=16, lengths={"inputs": 8, "targets": 8},
                 num_microbatches=num_microbatches)  # fmt: skip
    state = tr.init_state()
    placed = jax.tree_util.tree_map(lambda x: x.sharding, state.params)
    batch = tr.global_batch(reverse_batch(16))
    losses = []
    for _ in range(STEPS):
        state, metrics = tr.train_step(state, batch)
        losses.append(summarize(metrics)["loss"])
    return tr, placed, losses


# Megatron is the quickstart's table; the other two compile four more programs (~30 s of CPU).
@pytest.mark.parametrize(
    "preset",
    [
        pytest.param("data_parallel", marks=pytest.mark.slow),
        "megatron",
        pytest.param("fsdp", marks=pytest.mark.slow),
    ],
)
def test_explicit_mode_trains_like_auto_mode(preset):
    require_devices(8)
    _, auto_placed, auto_losses = _train(preset, "auto")
    tr, placed, losses = _train(preset, "explicit")
    mesh = tr.partitioner.mesh
    assert mesh.axis_types == (AxisType.Explicit, AxisType.Explicit)
    assert dict(mesh.shape) == {"data": 2, "model": 4}
    # Parameters are born (and stay) where the rules put them: the rules' NamedShardings on
    # the Explicit mesh, with auto mode's PartitionSpecs.
    rules_shardings = tr.partitioner.shardings(tr.state_abstract.params, tr.params_axes)
    flat = jax.tree_util.tree_leaves(placed)
    assert flat == jax.tree_util.tree_leaves(rules_shardings)
    assert all(isinstance(s, NamedSharding) and s.mesh is mesh for s in flat)
    assert [s.spec for s in flat] == [s.spec for s in jax.tree_util.tree_leaves(auto_placed)]
    wi = placed["encoder"]["layers_0"]["mlp"]["wi_0"]["kernel"].spec
    assert wi == {"data_parallel": P(None, None), "megatron": P(None, "model"),
                  "fsdp": P("data", "model")}[preset]  # fmt: skip
    # NOTE: rtol 1e-6, not bit equality: the two partitioners may order a sharded reduction
    # (a gradient's all-reduce, a row-parallel partial sum) differently, which moves the last
    # bits of float32 sums (observed on CPU: megatron and fsdp bit-identical, data_parallel
    # 9e-8 relative by step 3).
    np.testing.assert_allclose(losses, auto_losses, rtol=1e-6, atol=0)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize(
    "variant",
    [
        "scanned_microbatched",
        pytest.param("lora_multislice", marks=pytest.mark.slow),
    ],
)
def test_explicit_mode_with_what_real_runs_add(variant):
    """What a real run adds to the quickstart, on Explicit axes under FSDP's table: layers under
    nn.scan with gradient accumulation over microbatches (the split must not slice a sharded
    dimension); or LoRA adapters over a frozen base (LoRA needs unscanned layers) on the docs'
    multi-slice recipe (a hybrid DCN x ICI mesh, batch over replica and data). Losses equal
    auto mode's; parameters sit where auto mode puts them."""
    require_devices(8)
    if variant == "lora_multislice":  # multi-slice recipe: 2 slices (DCN) x 4 devices on `model`
        mesh_kw = {"ici_mesh_shape": (1, 1, 4), "dcn_mesh_shape": (2, 1, 1)}
        kw = dict(mesh_kw=mesh_kw, data_axis=("replica", "data"), lora=LoRA(rank=2, alpha=4.0))
    else:
        cfg = dataclasses.replace(SMALL, num_encoder_layers=2, num_decoder_layers=2,
                                  scan_layers=True)  # fmt: skip
        kw = dict(cfg=cfg, num_microbatches=2)
    _, auto_placed, auto_losses = _train("fsdp", "auto", **kw)
    tr, placed, losses = _train("fsdp", "explicit", **kw)
    assert set(tr.partitioner.mesh.axis_types) == {AxisType.Explicit}
    assert [s.spec for s in jax.tree_util.tree_leaves(placed)] == [
        s.spec for s in jax.tree_util.tree_leaves(auto_placed)
    ]
    if variant == "lora_multislice":
        assert dict(tr.partitioner.mesh.shape) == {"replica": 2, "data": 1, "model": 4}
        # The batch spans both slices; FSDP's weight split stays inside a slice (never over DCN).
        assert tr.batch_shardings["encoder_input_tokens"].spec == P(("replica", "data"), None)
        wi = placed["encoder"]["layers_0"]["mlp"]["wi_0"]["kernel"].spec
        assert wi == P("data", "model")
        lora_a = placed["encoder"]["layers_0"]["attention"]["query"]["kernel_lora_a"].spec
        assert lora_a == P("data", None)  # the kernel's input axis (embed), then lora_rank
    else:  # the stacked layers' leading axis is unsharded, the rest as the rules say
        wi = placed["encoder"]["layers"]["mlp"]["wi_0"]["kernel"].spec
        assert wi == P(None, "data", "model")
    np.testing.assert_allclose(losses, auto_losses, rtol=1e-6, atol=0)
    assert losses[-1] < losses[0]


def test_a_user_mesh_must_match_the_mode():
    require_devices(8)
    made = jax.make_mesh((2, 4), ("data", "model"))  # Explicit axes by default since JAX 0.9
    with pytest.raises(PartitioningError) as e:
        Partitioner(mesh=made)
    assert str(e.value) == (
        "mesh axes ['data', 'model'] are AxisType.Explicit, and Partitioner.shard_mode is "
        "'auto': pass shard_mode='explicit', or build the mesh with "
        "axis_types=(jax.sharding.AxisType.Auto,) * 2 (e.g. jax.make_mesh(shape, names, "
        "axis_types=...)), or use t5lite.create_mesh"
    )
    assert Partitioner(mesh=made, shard_mode="explicit").mesh is made
    # An Auto mesh (create_mesh's) is rebuilt with Explicit axes on the same devices.
    auto = partitioning.create_mesh(num_partitions=4)
    explicit = Partitioner(mesh=auto, shard_mode="explicit").mesh
    assert explicit.axis_types == (AxisType.Explicit,) * 2
    assert explicit.devices.tolist() == auto.devices.tolist()
    assert Partitioner(mesh=auto).mesh is auto
    mixed = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Explicit))
    with pytest.raises(PartitioningError) as e:
        Partitioner(mesh=mixed, shard_mode="explicit")
    assert str(e.value) == (
        "mesh axes ['data'] are AxisType.Auto and ['model'] AxisType.Explicit; "
        "shard_mode='explicit' needs axis_types=(jax.sharding.AxisType.Explicit,) * 2"
    )
    with pytest.raises(PartitioningError) as e:
        Partitioner(mesh=auto, shard_mode="Explicit")
    assert str(e.value) == "Partitioner.shard_mode='Explicit' is not one of auto, explicit"


@pytest.mark.parametrize("preset", ["sequence_parallel", "context_parallel"])
def test_length_sharding_tables_are_refused_up_front(preset):
    require_devices(8)
    with pytest.raises(PartitioningError) as e:
        Partitioner(
            num_partitions=4, logical_axis_rules=partitioning.preset_rules(preset),
            shard_mode="explicit",
        )  # fmt: skip
    assert str(e.value) == (
        "shard_mode='explicit' cannot use a rules table that shards 'length' (rule ('length', "
        "'model'); the sequence_parallel and context_parallel presets): an attention mask "
        "[batch, length, length] would need that mesh axis on two dimensions; use "
        "shard_mode='auto' for these layouts"
    )


def test_an_untypable_train_step_fails_when_the_trainer_is_built():
    """Grouped-query attention splits model-sharded heads into (kv groups, heads per group),
    a reshape JAX cannot type on Explicit axes: one line, before any step runs."""
    require_devices(8)
    cfg = network.DecoderOnlyConfig(
        vocab_size=32, emb_dim=16, num_heads=4, num_kv_heads=2, head_dim=4, mlp_dim=32,
        num_layers=1,
    )  # fmt: skip
    part = Partitioner(num_partitions=4, shard_mode="explicit")
    with pytest.raises(PartitioningError) as e:
        Trainer(DecoderOnlyModel(cfg), part, batch_size=16, lengths={"targets": 8})
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(
        "shard_mode='explicit': the train step cannot be typed on Explicit axes at "
        "model/attention.py:"
    )
    assert "This reshape is not supported" in msg
    assert msg.endswith("(use shard_mode='auto' for this model and layout)")


def _train_losses(model_dir) -> dict[int, float]:
    with open(os.path.join(model_dir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if r["split"] == "train"}


@pytest.mark.slow
def test_cli_quickstart_in_explicit_mode(tmp_path, capsys):
    """`t5lite train --gin_file=quickstart.gin --gin.Partitioner.shard_mode="'explicit'"`:
    auto mode's losses, and the end-of-training evaluation decodes (in an auto_axes region)."""
    require_devices(8)
    quick = [
        "--gin_file=quickstart.gin", "--gin.TRAIN_STEPS=3", "--gin.BATCH_SIZE=8",
        "--gin.TASK_FEATURE_LENGTHS={'inputs': 8, 'targets': 8}", "--gin.LogConfig.period=1",
        "--gin.CheckpointConfig.period=3", "--gin.warmup_cosine_schedule.warmup_steps=1",
        "--gin.NUM_ENCODER_LAYERS=1", "--gin.NUM_DECODER_LAYERS=1",
    ]  # fmt: skip
    auto, explicit = tmp_path / "auto", tmp_path / "explicit"
    assert run_cli("train", *quick, "--gin.train.evaluation=None", f"--gin.MODEL_DIR='{auto}'") == 0
    explicit_run = [
        f"--gin.MODEL_DIR='{explicit}'", "--gin.Partitioner.shard_mode='explicit'",
        "--gin.EvalConfig.num_examples=8",
    ]  # fmt: skip
    assert run_cli("train", *quick, *explicit_run) == 0
    a, x = _train_losses(auto), _train_losses(explicit)
    assert sorted(x) == [1, 2, 3]
    np.testing.assert_allclose([x[s] for s in (1, 2, 3)], [a[s] for s in (1, 2, 3)], rtol=1e-6)
    with open(os.path.join(explicit, "metrics.jsonl")) as f:
        evals = [r for r in map(json.loads, f) if r["split"] != "train"]
    assert evals, "the end-of-training evaluation wrote no metrics"


def test_cli_unknown_shard_mode_is_one_line(tmp_path, capsys):
    require_devices(8)
    code = run_cli(
        "train", "--gin_file=quickstart.gin", f"--gin.MODEL_DIR='{tmp_path}'",
        "--gin.Partitioner.shard_mode='explict'",
    )  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert code != 0
    assert len(err.splitlines()) == 1, err
    assert err.startswith(
        "t5lite train: error: Partitioner.shard_mode='explict' is not one of auto, explicit"
    )
