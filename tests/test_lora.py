"""LoRA: adapters on chosen kernels shard with the rules, train alone, and merge on export."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from conftest import require_devices
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tiny_networks import TINY_T5, full_reversal_batch

from t5lite import partitioning
from t5lite.checkpoint import CheckpointManager
from t5lite.model import lora, optimizers
from t5lite.model.models import EncoderDecoderModel
from t5lite.trainer import Trainer, summarize

ADAPT = lora.LoRA(rank=4, alpha=8.0, targets=r".*/(query|value|wi_0|wo)/kernel")
MLP = ("decoder", "layers_0", "mlp")


def _trainer(preset: str) -> Trainer:
    require_devices(8)
    rules = partitioning.preset_rules(preset)
    part = partitioning.Partitioner(num_partitions=2, logical_axis_rules=rules)  # data=4 x model=2
    model = EncoderDecoderModel(TINY_T5, optimizer=optimizers.AdamW(3e-2), lora=ADAPT)
    return Trainer(model, part, batch_size=8, lengths={"inputs": 8, "targets": 8})


def _get(tree, *keys):
    for k in keys:
        tree = tree[k]
    return tree


def _flat(tree) -> dict[str, np.ndarray]:
    leaves = jax.tree_util.tree_flatten_with_path(jax.device_get(tree))[0]
    key = lambda k: str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
    return {"/".join(key(k) for k in path): x for path, x in leaves}


@pytest.mark.parametrize("preset", ["megatron", "fsdp"])
def test_lora_trains_adapters_only_on_a_sharded_mesh(preset):
    tr = _trainer(preset)
    mesh = tr.partitioner.mesh
    embed = "data" if preset == "fsdp" else None  # FSDP shards parameters' embed over data
    # The factors take the adapted kernel's axes plus a replicated `lora_rank`.
    mlp = _get(tr.state_shardings.params, *MLP)
    wi, wo = mlp["wi_0"], mlp["wo"]
    assert tr.params_axes["decoder"]["layers_0"]["mlp"]["wi_0"]["kernel_lora_a"] == P(
        "embed", "lora_rank"
    )
    assert wi["kernel"] == NamedSharding(mesh, P(embed, "model"))
    assert wi["kernel_lora_a"] == NamedSharding(mesh, P(embed, None))
    assert wi["kernel_lora_b"] == NamedSharding(mesh, P(None, "model"))
    assert wo["kernel_lora_a"] == NamedSharding(mesh, P("model", None))
    assert wo["kernel_lora_b"] == NamedSharding(mesh, P(None, embed))
    q = _get(tr.state_shardings.params, "encoder", "layers_0", "attention", "query")
    assert q["kernel_lora_b"] == NamedSharding(mesh, P(None, "model", None))  # [r, heads, kv]

    state = tr.init_state()
    before = _flat(state.params)
    batch, losses = full_reversal_batch(tr), []
    for _ in range(8):
        state, metrics = tr.train_step(state, batch)
        losses.append(summarize(metrics)["loss"])
    after = _flat(state.params)
    assert losses[-1] < 0.9 * losses[0]
    base = [p for p in before if not lora.is_factor(p)]
    # query + value of 3 attentions (the decoder's self and cross), wi_0 + wo of 2 MLPs.
    assert len(base) == len(before) - 2 * 10
    for p in base:
        assert before[p].tobytes() == after[p].tobytes(), p
    assert all(not np.array_equal(before[p], after[p]) for p in before if p.endswith("_lora_b"))
    # Only the factors have optimizer state.
    stats = [p for p, x in _flat(state.opt_state).items() if np.ndim(x) >= 1]
    assert len(stats) == 2 * 20 and all(lora.is_factor(p) for p in stats)  # Adam's mu and nu


def test_merged_export_matches_the_adapted_model(tmp_path):
    tr = _trainer("megatron")
    state = tr.init_state()
    batch = full_reversal_batch(tr)
    for _ in range(3):
        state, _ = tr.train_step(state, batch)
    model = tr.model
    params = jax.device_get(state.params)
    adapted = np.asarray(model._logits(params, batch, None))
    merged = lora.merge(ADAPT, params)
    assert not any(lora.is_factor(p) for p in _flat(merged))
    plain = EncoderDecoderModel(TINY_T5)  # the base architecture, no adapters
    np.testing.assert_allclose(
        np.asarray(plain._logits(merged, batch, None)), adapted, atol=1e-5, rtol=1e-5
    )
    # And the adapters did change the model.
    base = np.asarray(plain._logits(lora.without_factors(params), batch, None))
    assert np.abs(base - adapted).max() > 1e-3

    # `t5lite convert` export of a LoRA checkpoint writes the merged weights; transformers
    # computes the adapted model's logits from them.
    torch = pytest.importorskip("torch", reason="needs the [hf] extra")
    transformers = pytest.importorskip("transformers", reason="needs the [hf] extra")
    from t5lite.hf import convert

    mgr = CheckpointManager(tmp_path / "run", async_save=False)
    extra = {"network_config": {"type": "T5Config", **dataclasses.asdict(TINY_T5)},
             "lora": dataclasses.asdict(ADAPT)}  # fmt: skip
    mgr.save(3, state, extra=extra)
    mgr.close()
    out = convert.t5lite_to_hf(mgr.step_dir(3), tmp_path / "hf")
    hf = transformers.T5ForConditionalGeneration.from_pretrained(out).eval()
    with torch.no_grad():
        logits = hf(
            input_ids=torch.tensor(np.asarray(batch["encoder_input_tokens"]), dtype=torch.long),
            decoder_input_ids=torch.tensor(
                np.asarray(batch["decoder_input_tokens"]), dtype=torch.long
            ),
        ).logits.numpy()
    np.testing.assert_allclose(logits, adapted, atol=1e-4)


def test_targets_that_match_nothing_or_no_dense_kernel_are_errors():
    require_devices(8)
    part = partitioning.Partitioner(num_partitions=2)

    def build(targets):
        model = EncoderDecoderModel(TINY_T5, lora=lora.LoRA(targets=targets))
        return Trainer(model, part, batch_size=8, lengths={"inputs": 8, "targets": 8})

    with pytest.raises(ValueError, match=r"LoRA.targets: '.\*/qurey/kernel' matches no parameter"):
        build(r".*/qurey/kernel")
    with pytest.raises(ValueError, match=r"encoder/relpos_bias/rel_embedding has axes"):
        build(r"encoder/relpos_bias/rel_embedding")
