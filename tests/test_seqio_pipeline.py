"""seqio_lite: deterministic, resumable, sharded loading; mixing; packing; preprocessors."""

import collections
import functools
import json

import numpy as np
import pytest

import seqio_lite as sl
from seqio_lite import feature_converters as fc
from seqio_lite import loader
from seqio_lite import preprocessors as prep

N_EXAMPLES = 60
_VOCAB = sl.PassThroughVocabulary(size=10_000)


def _id_example(i: int) -> dict:
    # targets start with a unique id token (>= 2), then filler of varying length.
    return {"targets": [i + 2] + [5] * (i % 7)}


def _id_task(name: str, n: int = N_EXAMPLES, offset: int = 0, trim: bool = True) -> sl.Task:
    examples = [_id_example(i + offset) for i in range(n)]
    return sl.Task(
        name,
        sl.InMemorySource({"train": examples}, name=name),
        output_features={"targets": sl.Feature(_VOCAB)},
        preprocessors=[prep.tokenize, prep.append_eos_after_trim if trim else prep.append_eos],
    )


def _ids(batch: dict, converter: fc.FeatureConverter) -> list[int]:
    return [int(ex["decoder_target_tokens"][0]) - 2 for ex in converter.unpack(batch)]


def _take(it, n):
    return [next(it) for _ in range(n)]


def _assert_batches_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


SEQ = {"inputs": 32, "targets": 32}


@pytest.mark.parametrize("pack", [True, False])
def test_same_seed_same_batches_other_seed_differs(pack):
    kw = dict(batch_size=4, seed=3, pack=pack)
    a = _take(sl.get_dataset("synthetic_all", SEQ, **kw), 5)
    b = _take(sl.get_dataset("synthetic_all", SEQ, **kw), 5)
    _assert_batches_equal(a, b)
    c = _take(sl.get_dataset("synthetic_all", SEQ, **{**kw, "seed": 4}), 5)
    assert not np.array_equal(a[0]["encoder_input_tokens"], c[0]["encoder_input_tokens"])


@pytest.mark.parametrize(
    "name,lengths,pack",
    [
        ("synthetic_all", SEQ, True),
        ("synthetic_reverse", SEQ, False),
        ("tiny_corpus_lm", {"targets": 64}, True),
        ("tiny_corpus_span_corruption", {"inputs": 48, "targets": 16}, True),
    ],
)
def test_resume_at_step_k_equals_continuing(name, lengths, pack):
    it = sl.get_dataset(name, lengths, batch_size=3, seed=7, pack=pack)
    _take(it, 4)
    state = json.loads(json.dumps(it.get_state()))  # states survive JSON
    expected = _take(it, 5)
    fresh = sl.get_dataset(name, lengths, batch_size=3, seed=7, pack=pack)
    fresh.set_state(state)
    _assert_batches_equal(_take(fresh, 5), expected)


def test_state_is_small_and_json():
    it = sl.get_dataset("synthetic_all", SEQ, batch_size=8, seed=0)
    _take(it, 3)
    assert len(json.dumps(it.get_state())) < 2048


def test_epochs_reshuffle_and_reseed():
    task = _id_task("ids_epochs")
    conv = fc.LMFeatureConverter(pack=False)
    it = sl.get_dataset(task, {"targets": 16}, batch_size=N_EXAMPLES, num_epochs=2,
                        feature_converter=conv, seed=1)  # fmt: skip
    e1, e2 = (_ids(b, conv) for b in _take(it, 2))
    assert sorted(e1) == sorted(e2) == list(range(N_EXAMPLES))
    assert e1 != e2  # reshuffled each epoch
    with pytest.raises(StopIteration):
        next(it)


@pytest.mark.parametrize("pack", [True, False])
def test_shards_are_disjoint_and_cover_everything(pack):
    task = _id_task(f"ids_shards_{pack}")
    conv = fc.LMFeatureConverter(pack=pack)
    seen = []
    for shard in range(3):
        it = sl.get_dataset(task, {"targets": 16}, batch_size=4, num_epochs=1, shard_id=shard,
                            num_shards=3, feature_converter=conv, seed=5)  # fmt: skip
        ids = [i for b in it for i in _ids(b, conv)]
        seen.append(set(ids))
        assert len(ids) == len(set(ids))
    assert not (seen[0] & seen[1]) and not (seen[0] & seen[2]) and not (seen[1] & seen[2])
    assert set().union(*seen) == set(range(N_EXAMPLES))


def test_elastic_restore_onto_another_process_count():
    task = _id_task("ids_elastic")
    conv = fc.LMFeatureConverter(pack=False)
    mk = functools.partial(sl.get_dataset, task, {"targets": 16}, batch_size=2, num_epochs=1,
                           feature_converter=conv, seed=2)  # fmt: skip
    # Two processes take 3 steps each, then the run continues on three processes.
    states, consumed = [], set()
    for s in range(2):
        it = mk(shard_id=s, num_shards=2)
        consumed |= {i for b in _take(it, 3) for i in _ids(b, conv)}
        states.append(it.get_state())
    assert all(st["elastic"] for st in states)
    rest = set()
    for s in range(3):
        it = mk(shard_id=s, num_shards=3)
        it.set_state(states[0])
        rest |= {i for b in it for i in _ids(b, conv)}
    assert not consumed & rest and consumed | rest == set(range(N_EXAMPLES))


def test_packed_state_refuses_other_process_count():
    it = sl.get_dataset("synthetic_copy", SEQ, batch_size=2, shard_id=0, num_shards=2)
    next(it)
    other = sl.get_dataset("synthetic_copy", SEQ, batch_size=2, shard_id=0, num_shards=4)
    with pytest.raises(sl.StateMismatchError, match=r"not elastic .* cannot restore shard 0 of 4"):
        other.set_state(it.get_state())


def test_state_refuses_other_pipeline():
    it = sl.get_dataset("synthetic_copy", SEQ, batch_size=2, seed=1)
    next(it)
    other = sl.get_dataset("synthetic_reverse", SEQ, batch_size=2, seed=2)
    with pytest.raises(sl.StateMismatchError, match=r"differs in \['name', 'seed', 'tasks'\]"):
        other.set_state(it.get_state())


@pytest.mark.parametrize("rates", [(1, 1, 1), (1, 2, 3), (0.5, 0.25, 0.25)])
def test_mixture_proportions_are_exact(rates):
    tasks = [_id_task(f"mix{i}", n=1000, offset=1000 * i) for i in range(3)]
    mix = sl.Mixture("mix", list(zip(tasks, rates)))
    conv = fc.LMFeatureConverter(pack=False)
    ints = loader.integer_proportions(rates)
    period = sum(ints)
    it = sl.get_dataset(mix, {"targets": 16}, batch_size=period, feature_converter=conv, seed=0)
    for batch in _take(it, 4):
        counts = collections.Counter(i // 1000 for i in _ids(batch, conv))
        assert [counts[t] for t in range(3)] == ints  # every window of one period is exact


def test_mixture_rate_num_examples_with_temperature():
    small, big = _id_task("small", n=10), _id_task("big", n=40, offset=100)
    mix = sl.Mixture("temp", [small, big], default_rate=sl.rate_num_examples(temperature=2.0))
    rates = dict((t.name, r) for t, r in mix.tasks_and_rates())
    assert rates["big"] == pytest.approx(2 * rates["small"])  # sqrt(40 / 10)


def test_num_workers_give_identical_batches():
    a = _take(sl.get_dataset("synthetic_reverse", SEQ, batch_size=4, seed=9), 3)
    it = sl.get_dataset("synthetic_reverse", SEQ, batch_size=4, seed=9, num_workers=2)
    try:
        _assert_batches_equal(_take(it, 3), a)
    finally:
        it.close()


# -- feature converters and packing ------------------------------------------------------------


def _random_examples(rng, n, with_inputs=True):
    out = []
    for _ in range(n):
        ex = {"targets": rng.integers(2, 100, size=int(rng.integers(1, 12))).astype(np.int32)}
        if with_inputs:
            ex["inputs"] = rng.integers(2, 100, size=int(rng.integers(1, 12))).astype(np.int32)
        out.append(ex)
    return out


@pytest.mark.parametrize(
    "conv_cls", [fc.EncDecFeatureConverter, fc.LMFeatureConverter, fc.PrefixLMFeatureConverter]
)
def test_packing_round_trips_and_never_leaks(conv_cls):
    rng = np.random.default_rng(0)
    lengths = {"inputs": 16, "targets": 16}
    conv = conv_cls(pack=True)
    glen = conv.group_lengths(lengths)
    examples = [conv.convert_example(e, lengths) for e in _random_examples(rng, 40)]
    packer = fc.RowPacker(conv, 4, glen)
    placed = []
    for ex in examples:
        if not packer.add(ex):
            break
        placed.append(ex)
    batch = packer.batch()
    assert max(len(r) for r in packer.rows) > 1  # something was actually packed
    # Round trip: unpacking gives back every placed example, row by row.
    unpacked = conv.unpack(batch)
    order = [ex for row in packer.rows for ex in row]
    assert len(unpacked) == len(order) == len(placed)
    for got, want in zip(unpacked, order):
        for k in want:
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    # No leak: each segment's decoder input starts with 0 and is its own targets shifted.
    for g in conv.GROUPS:
        seg, pos = batch[f"{g}_segment_ids"], batch[f"{g}_positions"]
        for r in range(seg.shape[0]):
            for s in range(1, seg[r].max() + 1):
                idx = np.nonzero(seg[r] == s)[0]
                np.testing.assert_array_equal(pos[r][idx], np.arange(idx.size))
            assert np.all(pos[r][seg[r] == 0] == 0)
    seg = batch["decoder_segment_ids"]
    tgt, inp = batch["decoder_target_tokens"], batch["decoder_input_tokens"]
    for r in range(seg.shape[0]):
        starts = np.nonzero((seg[r] > 0) & (batch["decoder_positions"][r] == 0))[0]
        assert np.all(inp[r][starts] == 0)
        same = (seg[r][1:] == seg[r][:-1]) & (seg[r][1:] > 0)
        np.testing.assert_array_equal(inp[r][1:][same], tgt[r][:-1][same])


def test_prefix_lm_loss_on_targets_only():
    conv = fc.PrefixLMFeatureConverter(pack=False)
    ex = conv.convert_example(
        {"inputs": np.array([7, 8, 9]), "targets": np.array([4, 5, 1])}, {"inputs": 4, "targets": 4}
    )
    batch = conv.make_batch([[ex]], 2, conv.group_lengths({"inputs": 4, "targets": 4}))
    assert batch["decoder_target_tokens"].shape == (2, 8)
    assert "decoder_segment_ids" not in batch
    row = {k: v[0, :6] for k, v in batch.items()}
    np.testing.assert_array_equal(row["decoder_target_tokens"], [7, 8, 9, 4, 5, 1])
    np.testing.assert_array_equal(row["decoder_input_tokens"], [0, 7, 8, 9, 4, 5])
    np.testing.assert_array_equal(row["decoder_loss_weights"], [0, 0, 0, 1, 1, 1])
    np.testing.assert_array_equal(row["decoder_causal_attention"], [1, 1, 1, 1, 0, 0])
    assert not batch["decoder_loss_weights"][1].any()  # the padding row


def _prefix_lm_rows(pack, examples, lengths, batch_size=1):
    conv = fc.PrefixLMFeatureConverter(pack=pack)
    packer = fc.RowPacker(conv, batch_size, conv.group_lengths(lengths))
    for e in examples:
        assert packer.add(conv.convert_example({k: np.array(v) for k, v in e.items()}, lengths))
    return packer.batch()


def _assert_rows(batch, expected):
    assert sorted(batch) == sorted(expected)
    for k, v in expected.items():
        np.testing.assert_array_equal(batch[k][0], v, err_msg=k)


def test_prefix_lm_seqio_cases():
    """seqio's feature_converters_test.py: test_prefix_lm_unpacked, test_prefix_lm_packed,
    test_empty_inputs (packed) and test_prefix_lm_unpacked_trivial_targets (empty targets: one
    padding target keeps the position after the inputs, where decoding starts)."""
    _assert_rows(
        _prefix_lm_rows(
            False, [{"inputs": [9, 4, 6, 1], "targets": [3, 9, 1]}], {"inputs": 5, "targets": 4}
        ),
        {
            "decoder_target_tokens": [9, 4, 6, 1, 3, 9, 1, 0, 0],
            "decoder_input_tokens": [0, 9, 4, 6, 1, 3, 9, 0, 0],  # seqio: 1 after EOS
            "decoder_loss_weights": [0, 0, 0, 0, 1, 1, 1, 0, 0],
            "decoder_causal_attention": [1, 1, 1, 1, 1, 0, 0, 0, 0],
        },
    )
    _assert_rows(
        _prefix_lm_rows(
            True,
            [
                {"inputs": [7, 8, 5, 1], "targets": [3, 9, 1]},
                {"inputs": [8, 4, 9, 3, 1], "targets": [4, 1]},
            ],
            {"inputs": 8, "targets": 7},
        ),
        {
            "decoder_target_tokens": [7, 8, 5, 1, 3, 9, 1, 8, 4, 9, 3, 1, 4, 1, 0],
            "decoder_input_tokens": [0, 7, 8, 5, 1, 3, 9, 0, 8, 4, 9, 3, 1, 4, 0],
            "decoder_loss_weights": [0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 0],
            "decoder_positions": [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5, 6, 0],
            "decoder_segment_ids": [1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 0],
            "decoder_causal_attention": [1, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0],
        },
    )
    _assert_rows(
        _prefix_lm_rows(
            True,
            [
                {"inputs": [1], "targets": [1, 2]},
                {"inputs": [], "targets": [3, 4]},
                {"inputs": [2, 3, 4, 5, 6], "targets": [5, 6]},
            ],
            {"inputs": 7, "targets": 7},
        ),
        {
            "decoder_target_tokens": [1, 1, 2, 3, 4, 2, 3, 4, 5, 6, 5, 6, 0, 0],
            "decoder_input_tokens": [0, 1, 1, 0, 3, 0, 2, 3, 4, 5, 6, 5, 0, 0],
            "decoder_loss_weights": [0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 0, 0],
            "decoder_segment_ids": [1, 1, 1, 2, 2, 3, 3, 3, 3, 3, 3, 3, 0, 0],
            "decoder_positions": [0, 1, 2, 0, 1, 0, 1, 2, 3, 4, 5, 6, 0, 0],
            "decoder_causal_attention": [1, 1, 0, 1, 0, 1, 1, 1, 1, 1, 1, 0, 0, 0],
        },
    )
    trivial = {"inputs": [9, 4, 6, 1], "targets": []}
    _assert_rows(
        _prefix_lm_rows(False, [trivial], {"inputs": 5, "targets": 4}),
        {
            "decoder_target_tokens": [9, 4, 6, 1, 0, 0, 0, 0, 0],
            "decoder_input_tokens": [0, 9, 4, 6, 1, 0, 0, 0, 0],
            "decoder_loss_weights": [0, 0, 0, 0, 0, 0, 0, 0, 0],
            "decoder_causal_attention": [1, 1, 1, 1, 1, 0, 0, 0, 0],
        },
    )
    # Packed, the padding target is dropped, as seqio's packing drops it (its packers keep a
    # feature's non-zero tokens). seqio then keeps the mask's extra entry, one position to the
    # right of the example's tokens (here: on padding, with loss weight 1 there); t5lite keeps
    # the example's own entries only (docs/differences.md).
    _assert_rows(
        _prefix_lm_rows(True, [trivial], {"inputs": 5, "targets": 4}),
        {
            "decoder_target_tokens": [9, 4, 6, 1, 0, 0, 0, 0, 0],
            "decoder_input_tokens": [0, 9, 4, 6, 0, 0, 0, 0, 0],
            "decoder_loss_weights": [0, 0, 0, 0, 0, 0, 0, 0, 0],
            "decoder_segment_ids": [1, 1, 1, 1, 0, 0, 0, 0, 0],
            "decoder_positions": [0, 1, 2, 3, 0, 0, 0, 0, 0],
            "decoder_causal_attention": [1, 1, 1, 1, 0, 0, 0, 0, 0],
        },
    )


def test_prefix_lm_empty_targets_decode_from_the_whole_prompt():
    """A row with empty targets (what a predict-only example has) decodes as the same inputs
    with targets do: the model's prompt runs to the last input token."""
    import jax

    from t5lite.model import models, network

    cfg = network.DecoderOnlyConfig(
        vocab_size=32, emb_dim=16, num_heads=2, num_kv_heads=2, head_dim=8, mlp_dim=32, num_layers=1
    )
    model = models.DecoderOnlyModel(network_config=cfg, eos_id=-1)  # decode to the end
    lengths = {"inputs": 5, "targets": 4}
    inputs = [9, 4, 6, 1]
    batch = _prefix_lm_rows(
        False,
        [{"inputs": inputs, "targets": []}, {"inputs": inputs, "targets": [3, 9, 1]}],
        lengths,
        2,
    )
    params = jax.jit(model.init)(jax.random.PRNGKey(0), batch)["params"]
    decodes = np.asarray(jax.jit(model.predict_batch)(params, batch))
    np.testing.assert_array_equal(decodes[0], decodes[1])


def test_overlong_examples_trim_drop_or_error():
    long = {"inputs": np.arange(2, 30), "targets": np.arange(2, 5)}
    lengths = {"inputs": 8, "targets": 8}
    trimmed = fc.EncDecFeatureConverter(overlong="trim").convert_example(long, lengths)
    np.testing.assert_array_equal(trimmed["encoder_input_tokens"], np.arange(2, 10))
    assert fc.EncDecFeatureConverter(overlong="drop").convert_example(long, lengths) == {}
    with pytest.raises(ValueError, match="Feature 'inputs' has length 28 > sequence_length 8"):
        fc.EncDecFeatureConverter(overlong="error").convert_example(long, lengths)
    # append_eos_after_trim keeps EOS at the end of a trimmed feature.
    feats = {"targets": sl.Feature(_VOCAB)}
    out = prep.append_eos_after_trim({"targets": np.arange(2, 30)}, feats, {"targets": 5})
    np.testing.assert_array_equal(out["targets"], [2, 3, 4, 5, 1])


def test_dropped_examples_are_counted_and_not_elastic():
    task = _id_task("ids_drop", trim=False)
    conv = fc.LMFeatureConverter(pack=False, overlong="drop")
    it = sl.get_dataset(task, {"targets": 5}, batch_size=4, num_epochs=1, feature_converter=conv)
    ids = [i for b in it for i in _ids(b, conv)]
    state = it.get_state()
    # Examples with more than 4 tokens (id + filler + EOS > 5) are dropped, never trimmed.
    assert sorted(ids) == [i for i in range(N_EXAMPLES) if 1 + i % 7 + 1 <= 5]
    assert state["dropped"] == N_EXAMPLES - len(ids) and not state["elastic"]


# -- preprocessors -----------------------------------------------------------------------------


def test_span_corruption_reconstructs_the_text():
    vocab = sl.ByteVocabulary(extra_ids=100)
    feats = {"inputs": sl.Feature(vocab), "targets": sl.Feature(vocab)}
    tokens = np.arange(3, 203, dtype=np.int32)
    ex = prep.span_corruption({"targets": tokens}, {"inputs": 64, "targets": 32}, feats,
                              np.random.default_rng(0))  # fmt: skip
    inputs, targets = ex["inputs"], ex["targets"]
    assert inputs.size <= 63  # room for EOS
    sentinels = set(range(vocab.vocab_size - 100, vocab.vocab_size))
    # Interleave: replace each sentinel in inputs by the span that follows it in targets.
    spans, cur = {}, None
    for t in targets:
        if int(t) in sentinels:
            cur = int(t)
            spans[cur] = []
        else:
            spans[cur].append(int(t))
    rebuilt = []
    for t in inputs:
        rebuilt.extend(spans[int(t)] if int(t) in spans else [int(t)])
    window = np.asarray(rebuilt)
    start = int(window[0]) - 3
    np.testing.assert_array_equal(window, tokens[start : start + window.size])
    noise = sum(len(s) for s in spans.values()) / window.size
    assert 0.1 < noise < 0.2


def test_user_preprocessor_gets_per_example_seeds():
    def add_noise(example, rng):
        return {**example, "targets": np.append(example["targets"], rng.integers(2, 1000))}

    task = sl.Task(
        "ids_rng",
        sl.InMemorySource({"train": [_id_example(i) for i in range(8)]}),
        output_features={"targets": sl.Feature(_VOCAB)},
        preprocessors=[prep.tokenize, add_noise],
    )
    conv = fc.LMFeatureConverter(pack=False)
    mk = functools.partial(sl.get_dataset, task, {"targets": 16}, batch_size=8, num_epochs=2,
                           feature_converter=conv, shuffle=False)  # fmt: skip
    e1, e2 = _take(mk(), 2)
    again = next(mk())
    np.testing.assert_array_equal(e1["decoder_target_tokens"], again["decoder_target_tokens"])
    assert not np.array_equal(e1["decoder_target_tokens"], e2["decoder_target_tokens"])
