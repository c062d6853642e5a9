"""seqio_lite's batched host paths give exactly what the per-example ones gave.

The in-process iterator reads a chunk of examples per `_getitems` call instead of grain's
per-element iterator, and packing places and lays out a batch with numpy over all its examples;
a user expects the same examples in the same rows in the same order.
"""

import functools
import itertools

import numpy as np
import pytest

import seqio_lite as sl
from seqio_lite import feature_converters as fc

_LENGTHS = {"inputs": 12, "targets": 10}


def _reference_batch(conv, examples, batch_size, lengths):
    """Greedy first fit and per-example slice assignment: the layout as first written."""
    rows, fill = [], []
    placed = 0
    for ex in examples:
        need = {g: len(ex[names[0]]) for g, names in conv.groups.items()}
        row = next(
            (i for i, f in enumerate(fill) if all(f[g] + need[g] <= lengths[g] for g in need)),
            None,
        ) if conv.pack else None  # fmt: skip
        if row is None:
            if len(rows) == batch_size:
                break
            rows.append([])
            fill.append(dict.fromkeys(need, 0))
            row = len(rows) - 1
        rows[row].append(ex)
        for g in need:
            fill[row][g] += need[g]
        placed += 1
    out = {}
    for group, names in conv.groups.items():
        length = lengths[group]
        arrays = {n: np.zeros((batch_size, length), np.int32) for n in names}
        seg = np.zeros((batch_size, length), np.int32)
        pos = np.zeros((batch_size, length), np.int32)
        for r, row in enumerate(rows):
            start = 0
            for s, ex in enumerate(row, start=1):
                n = len(ex[names[0]])
                for name in names:
                    arrays[name][r, start : start + n] = ex[name]
                seg[r, start : start + n] = s
                pos[r, start : start + n] = np.arange(n)
                start += n
        out.update(arrays)
        if conv.pack:
            out[f"{group}_segment_ids"], out[f"{group}_positions"] = seg, pos
    return out, placed


# Three groups: a passthrough feature packs as a group of its own (the packer's general path).
_EncDecWithIds = functools.partial(fc.EncDecFeatureConverter, passthrough_features=("ids",))


@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize(
    "conv_cls",
    [fc.EncDecFeatureConverter, fc.LMFeatureConverter, fc.PrefixLMFeatureConverter,
     _EncDecWithIds],
)  # fmt: skip
def test_packing_matches_per_example_reference(conv_cls, pack):
    rng = np.random.default_rng(7)
    conv = conv_cls(pack=pack)
    lengths = {**_LENGTHS, "ids": 9}
    glen = conv.group_lengths(lengths)
    raw = [
        {"inputs": rng.integers(3, 50, rng.integers(0, 15)),
         "targets": rng.integers(3, 50, rng.integers(1, 13)),
         "ids": rng.integers(1, 9, rng.integers(0, 8)).astype(np.int32)}
        for _ in range(300)
    ]  # fmt: skip
    examples = [conv.convert_example(e, lengths) for e in raw]
    batches = 0
    while examples:
        packer = fc.RowPacker(conv, 6, glen)
        placed = 0
        for ex in examples:
            if not packer.add(ex):
                break
            placed += 1
        want, want_placed = _reference_batch(conv, examples, 6, glen)
        got = packer.batch()
        assert placed == want_placed
        for k, v in want.items():
            np.testing.assert_array_equal(got[k], v, err_msg=k)
        examples = examples[placed:]
        batches += 1
    assert batches > 10  # the last, partial batch included


def test_make_batch_refuses_a_row_longer_than_its_length():
    conv = fc.LMFeatureConverter(pack=True)
    ex = conv.convert_example({"targets": np.arange(3, 9)}, {"targets": 8})
    with pytest.raises(ValueError, match="row 0 holds 12 decoder positions; the length is 8"):
        conv.make_batch([[ex, ex]], 2, {"decoder": 8})


@pytest.mark.parametrize(
    "task, kwargs",
    [
        ("synthetic_all", dict(pack=True, shard_id=1, num_shards=2, batch_size=8)),
        ("synthetic_copy", dict(pack=False, shard_id=2, num_shards=3, batch_size=5)),
        # A finite split ending inside a chunk, with a partial last batch.
        (
            "synthetic_arithmetic",
            dict(pack=True, split="test", num_epochs=1, shard_id=1, num_shards=3, batch_size=16),
        ),
    ],
)
def test_in_process_chunked_reading_matches_grain_iterator(task, kwargs):
    def batches(grain_iterator: bool):
        it = sl.get_dataset(task, {"inputs": 20, "targets": 20}, seed=3, **kwargs)
        # A reading thread makes the iterator read through grain's own per-element iterator
        # (what worker processes use): the reference order.
        it._read_threads = 1 if grain_iterator else 0
        out = [next(it) for _ in range(4)]
        state = it.get_state()
        out += list(itertools.islice(it, 30))
        it.set_state(state)  # resuming mid-stream restarts the reading at the saved position
        out.append(next(it))
        return out, it.get_state()

    got, got_state = batches(False)
    want, want_state = batches(True)
    assert got_state == want_state and len(got) == len(want)
    for g, w in zip(got, want):
        assert g.keys() == w.keys()
        for k in w:
            np.testing.assert_array_equal(g[k], w[k], err_msg=k)


def test_tasks_without_rng_preprocessors_read_as_with_a_generator():
    """A task none of whose post-cache preprocessors takes `rng` is read without drawing a
    generator per element; its batches are those of the same task with one that does."""

    def ignores_rng(example, rng):
        assert isinstance(rng, np.random.Generator)
        return example

    base = sl.get_task_or_mixture("synthetic_reverse")
    tasks = [
        sl.Task(
            "fast_paths",  # one name: the shuffle and stream seeds derive from it
            base.source,
            output_features=base.output_features,
            preprocessors=[
                sl.preprocessors.tokenize,
                sl.preprocessors.append_eos_after_trim,
                *extra,
            ],
        )
        for extra in [[], [ignores_rng]]
    ]
    assert [t.post_cache_uses_rng for t in tasks] == [False, True]
    out = []
    for task in tasks:
        it = sl.get_dataset(task, {"inputs": 20, "targets": 20}, batch_size=8, seed=5)
        out.append(list(itertools.islice(it, 12)))
    for got, want in zip(*out):
        for k in want:
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_a_preprocessor_error_surfaces_and_reading_can_go_on():
    """After an error the iterator reads on from the position its state names (the chunk
    reader that raised is not left behind as an exhausted stream)."""
    calls = {"n": 0}

    def fails_once(example):
        calls["n"] += 1
        if calls["n"] == 50:
            raise RuntimeError("bad example")
        return example

    base = sl.get_task_or_mixture("synthetic_copy")
    task = sl.Task(
        "fast_paths_errors", base.source, output_features=base.output_features,
        preprocessors=[sl.preprocessors.tokenize, fails_once,
                       sl.preprocessors.append_eos_after_trim],
    )  # fmt: skip
    it = sl.get_dataset(task, {"inputs": 20, "targets": 20}, batch_size=4, seed=1)
    with pytest.raises(RuntimeError, match="bad example"):
        for _ in range(100):
            next(it)
    state = it.get_state()
    got = list(itertools.islice(it, 6))
    fresh = sl.get_dataset(task, {"inputs": 20, "targets": 20}, batch_size=4, seed=1)
    fresh.set_state(state)
    want = list(itertools.islice(fresh, 6))
    assert len(got) == len(want) == 6
    for g, w in zip(got, want):
        for k in w:
            np.testing.assert_array_equal(g[k], w[k], err_msg=k)


@pytest.mark.parametrize("ids_dtype", [np.int32, np.int64, np.uint8])
@pytest.mark.parametrize("length", [None, 4, 40])
def test_eos_after_trim_and_byte_encoding_match_the_generic_numpy_ops(ids_dtype, length):
    """EOS written into the output array and the one-ufunc byte encoding give the arrays
    (values and dtype) of `np.append` + `astype` and of widen-then-add, for every byte value."""
    vocab = sl.ByteVocabulary()
    text = bytes(range(256)).decode("latin-1")  # every byte value (2-byte UTF-8 above 127)
    want_ids = np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32) + 3
    got_ids = vocab.encode_np(text)
    assert got_ids.dtype == np.int32
    np.testing.assert_array_equal(got_ids, want_ids)
    features = {"targets": sl.Feature(vocab), "raw": sl.Feature(vocab, add_eos=False)}
    ids = (want_ids % 250).astype(ids_dtype)
    lengths = None if length is None else {"targets": length, "raw": length}
    out = sl.preprocessors.append_eos_after_trim({"targets": ids, "raw": ids}, features, lengths)
    cut = ids if length is None else ids[: length - 1]
    want = np.append(cut, vocab.eos_id).astype(np.int32)
    assert out["targets"].dtype == want.dtype
    np.testing.assert_array_equal(out["targets"], want)
    raw = ids if length is None else ids[:length]
    np.testing.assert_array_equal(out["raw"], raw.astype(np.int32))
    assert out["raw"].dtype == np.int32


def test_the_bound_post_cache_steps_pass_what_each_signature_asks_for():
    """`Task.post_cache_fn` binds each preprocessor's keyword arguments once: the same ones
    `call_preprocessor` passes per call, by signature (`**kwargs` gets all three)."""
    seen: dict[str, list] = {}

    def plain(ex):
        seen["plain"] = []
        return ex

    def lengths_only(ex, sequence_length):
        seen["lengths_only"] = [sequence_length]
        return ex

    def features_and_rng(ex, output_features, rng):
        seen["features_and_rng"] = [sorted(output_features), rng]
        return {**ex, "targets": ex["text"]}

    def anything(ex, **kwargs):
        seen["anything"] = sorted(kwargs)
        return ex

    vocab = sl.ByteVocabulary()
    task = sl.Task(
        "bound_steps_probe", sl.sources.FunctionSource(lambda s, i: {"text": "ab"}, {"train": 3}),
        output_features={"targets": sl.Feature(vocab)},
        preprocessors=[plain, lengths_only, features_and_rng, anything,
                       functools.partial(sl.preprocessors.tokenize, copy_pretokenized=False)],
    )  # fmt: skip
    lengths = {"targets": 8}
    rng = np.random.default_rng(0)
    out = task.post_cache_fn(lengths)({"text": "ab"}, rng)
    assert seen == {
        "plain": [], "lengths_only": [lengths], "features_and_rng": [["targets"], rng],
        "anything": ["output_features", "rng", "sequence_length"],
    }  # fmt: skip
    np.testing.assert_array_equal(out["targets"], vocab.encode_np("ab"))
    assert task.preprocess_post_cache({"text": "ab"}, rng, lengths).keys() == out.keys()

    dropping = sl.Task("bound_steps_drop", task.source, task.output_features,
                       preprocessors=[lambda ex: None, plain])  # fmt: skip
    seen.clear()
    assert dropping.post_cache_fn(lengths)({"text": "ab"}, None) is None and seen == {}
    lacking = sl.Task("bound_steps_lack", task.source, task.output_features, preprocessors=[plain])
    with pytest.raises(ValueError, match=(
        r"^Task 'bound_steps_lack': example lacks required feature\(s\) \['targets'\] after "
        r"preprocessing \(has \['text'\]\)$"
    )):  # fmt: skip
        lacking.post_cache_fn(lengths)({"text": "ab"}, None)
