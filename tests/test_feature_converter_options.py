"""seqio's feature-converter options: `bos_id`, `passthrough_features`, `loss_on_targets_only`.

Each is checked packed and unpacked, against the arrays written out by hand.
"""

import numpy as np
import pytest

import seqio_lite as sl
from seqio_lite import feature_converters as fc
from seqio_lite import preprocessors as prep

LENGTHS = {"inputs": 4, "targets": 5}
EXAMPLES = [
    {"inputs": np.array([7, 8]), "targets": np.array([4, 5, 1])},
    {"inputs": np.array([9]), "targets": np.array([6, 1])},
]


def _batch(conv: fc.FeatureConverter, examples, lengths=LENGTHS, batch_size=2):
    packer = fc.RowPacker(conv, batch_size, conv.group_lengths(lengths))
    for e in examples:
        assert packer.add(conv.convert_example(e, lengths))
    return packer.batch()


def test_defaults_keep_todays_behaviour_and_fingerprint():
    for cls in (fc.EncDecFeatureConverter, fc.LMFeatureConverter, fc.PrefixLMFeatureConverter):
        conv = cls(pack=True)
        assert repr(conv) == f"{cls.__name__}(pack=True, overlong='trim')"
        assert conv.bos_id == 0 and conv.passthrough_features == ()
    assert fc.PrefixLMFeatureConverter().loss_on_targets_only is True


@pytest.mark.parametrize("pack", [True, False])
def test_bos_id_starts_every_segment_of_the_decoder_inputs(pack):
    conv = fc.EncDecFeatureConverter(pack=pack, bos_id=3)
    assert "bos_id=3" in repr(conv)  # a different pipeline, a different fingerprint
    batch = _batch(conv, EXAMPLES, {"inputs": 4, "targets": 6})
    inputs = batch["decoder_input_tokens"]
    if pack:
        # targets [4, 5, 1 | 6, 1 | pad]: BOS at each segment start, 0 on padding.
        np.testing.assert_array_equal(inputs[0], [3, 4, 5, 3, 6, 0])
        np.testing.assert_array_equal(inputs[1], [0] * 6)
    else:
        np.testing.assert_array_equal(inputs, [[3, 4, 5, 0, 0, 0], [3, 6, 0, 0, 0, 0]])


@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize("cls", [fc.LMFeatureConverter, fc.PrefixLMFeatureConverter])
def test_bos_id_in_decoder_only_converters(cls, pack):
    conv = cls(pack=pack, bos_id=2)
    batch = _batch(conv, EXAMPLES, {"inputs": 4, "targets": 6})
    targets, inputs = batch["decoder_target_tokens"], batch["decoder_input_tokens"]
    if pack:
        starts = (batch["decoder_positions"] == 0) & (batch["decoder_segment_ids"] > 0)
    else:
        starts = np.zeros_like(targets, bool)
        starts[:, 0] = targets[:, 0] != 0
    assert np.all(inputs[starts] == 2) and starts.sum() == 2
    shifted = np.zeros_like(targets)
    shifted[:, 1:] = targets[:, :-1]
    rest = ~starts & (targets != 0)
    np.testing.assert_array_equal(inputs[rest], shifted[rest])
    assert np.all(inputs[targets == 0] == 0)


@pytest.mark.parametrize("pack", [True, False])
def test_prefix_lm_loss_on_inputs_too(pack):
    lengths = {"inputs": 3, "targets": 3}
    on_all = _batch(fc.PrefixLMFeatureConverter(pack=pack, loss_on_targets_only=False), EXAMPLES,
                    lengths)  # fmt: skip
    on_targets = _batch(fc.PrefixLMFeatureConverter(pack=pack), EXAMPLES, lengths)
    # inputs ++ targets: [7, 8, 4, 5, 1] and [9, 6, 1].
    if pack:
        np.testing.assert_array_equal(on_all["decoder_loss_weights"][0], [1] * 5 + [0])
        np.testing.assert_array_equal(on_targets["decoder_loss_weights"][0], [0, 0, 1, 1, 1, 0])
        # the second example does not fit after the first: it starts the second row
        np.testing.assert_array_equal(on_all["decoder_loss_weights"][1], [1, 1, 1, 0, 0, 0])
        np.testing.assert_array_equal(on_targets["decoder_loss_weights"][1], [0, 1, 1, 0, 0, 0])
    else:
        np.testing.assert_array_equal(
            on_all["decoder_loss_weights"], [[1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0]]
        )
        np.testing.assert_array_equal(
            on_targets["decoder_loss_weights"], [[0, 0, 1, 1, 1, 0], [0, 1, 1, 0, 0, 0]]
        )
    # Nothing else changes: same tokens, same causal-attention prefix.
    for k in ("decoder_target_tokens", "decoder_input_tokens", "decoder_causal_attention"):
        np.testing.assert_array_equal(on_all[k], on_targets[k], err_msg=k)
    assert "loss_on_targets_only=False" in repr(fc.PrefixLMFeatureConverter(
        loss_on_targets_only=False))  # fmt: skip


@pytest.mark.parametrize("pack", [True, False])
def test_passthrough_features_reach_the_batch(pack):
    conv = fc.EncDecFeatureConverter(pack=pack, passthrough_features=["weights", "ids"])
    examples = [
        {**EXAMPLES[0], "weights": np.array([0.5, 0.25]), "ids": np.array([11])},
        {**EXAMPLES[1], "weights": np.array([2.0, 1.0, 3.0]), "ids": np.array([12, 13])},
    ]
    lengths = {**LENGTHS, "weights": 6, "ids": 3}
    batch = _batch(conv, examples, lengths)
    assert batch["weights"].dtype == np.float64 and batch["ids"].dtype == np.int64
    if pack:
        np.testing.assert_array_equal(batch["weights"][0], [0.5, 0.25, 2.0, 1.0, 3.0, 0.0])
        np.testing.assert_array_equal(batch["ids"][0], [11, 12, 13])
        np.testing.assert_array_equal(batch["weights_segment_ids"][0], [1, 1, 2, 2, 2, 0])
        np.testing.assert_array_equal(batch["ids_positions"][0], [0, 0, 1])
        assert not batch["weights"][1].any()
    else:
        np.testing.assert_array_equal(
            batch["weights"], [[0.5, 0.25, 0, 0, 0, 0], [2.0, 1.0, 3.0, 0, 0, 0]]
        )
        np.testing.assert_array_equal(batch["ids"], [[11, 0, 0], [12, 13, 0]])
        assert "weights_segment_ids" not in batch
    # Round trip, and the model features are what they are without passthrough features.
    plain = _batch(fc.EncDecFeatureConverter(pack=pack), EXAMPLES, LENGTHS)
    for k, v in plain.items():
        np.testing.assert_array_equal(batch[k], v, err_msg=k)
    back = conv.unpack(batch)
    np.testing.assert_array_equal(back[1]["weights"], [2.0, 1.0, 3.0])


def test_passthrough_features_trim_and_need_a_length():
    conv = fc.LMFeatureConverter(pack=False, passthrough_features=["extra"])
    lengths = {"targets": 4, "extra": 2}
    ex = conv.convert_example({"targets": [4, 1], "extra": [1, 2, 3, 4]}, lengths)
    np.testing.assert_array_equal(ex["extra"], [1, 2])
    with pytest.raises(ValueError, match="lacks passthrough features \\['extra'\\]"):
        conv.group_lengths({"targets": 4})
    with pytest.raises(ValueError, match="needs task feature 'extra'"):
        conv.convert_example({"targets": [4, 1]}, {"targets": 4, "extra": 2})
    with pytest.raises(ValueError, match="clash"):
        fc.LMFeatureConverter(passthrough_features=["targets"])


@pytest.mark.parametrize("pack", [True, False])
def test_options_through_get_dataset(pack):
    vocab = sl.PassThroughVocabulary(size=100)
    rows = [{"targets": [i + 2, 5], "score": [i]} for i in range(6)]
    task = sl.Task(
        "fc_options_task",
        sl.InMemorySource({"train": rows}, name="fc_options_task"),
        output_features={"targets": sl.Feature(vocab)},
        preprocessors=[prep.tokenize, prep.append_eos],
    )
    conv = fc.LMFeatureConverter(pack=pack, bos_id=7, passthrough_features=["score"])
    it = sl.get_dataset(task, {"targets": 4, "score": 2}, batch_size=3, shuffle=False,
                        num_epochs=1, feature_converter=conv)  # fmt: skip
    batches = list(it)
    scores = (
        sorted(int(s) for b in batches for s in b["score"][b["score_segment_ids"] > 0])
        if pack
        else sorted(int(b["score"][r, 0]) for b in batches for r in range(3))
    )
    assert scores == list(range(6))
    for b in batches:
        t, i = b["decoder_target_tokens"], b["decoder_input_tokens"]
        assert np.all(i[:, 0][t[:, 0] > 0] == 7)
