"""seqio_lite: vocabularies, sources, bad input, and the no-TensorFlow promise."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import seqio_lite as sl
from seqio_lite import sources, tasks
from seqio_lite.vocabularies import train_sentencepiece


def test_import_does_not_pull_tensorflow():
    code = "import sys, seqio_lite, seqio_lite.cache_tasks; print('tensorflow' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# -- vocabularies ------------------------------------------------------------------------------


def test_byte_vocabulary_ids_and_round_trip():
    v = sl.ByteVocabulary()
    assert v.vocab_size == 259 and v.pad_id == 0 and v.eos_id == 1 and v.unk_id == 2
    assert v.encode("a") == [ord("a") + 3]
    text = "héllo, wörld ✓"
    assert v.decode(v.encode(text)) == text
    np.testing.assert_array_equal(v.encode_np(text), v.encode(text))
    # decode stops at EOS and drops padding.
    assert v.decode([*v.encode("ab"), 1, *v.encode("cd")]) == "ab"
    assert v.decode([0, *v.encode("ab"), 0]) == "ab"


def test_sentencepiece_round_trip_and_sentinel_order():
    v = sl.SentencePieceVocabulary(tasks.SPM_MODEL, extra_ids=100)
    assert v.vocab_size == 256 + 100
    assert v.sentinel_id(0) == v.vocab_size - 1 and v.sentinel_id(99) == 256
    text = "The clever fox found a jar of honey."
    assert v.decode(v.encode(text)) == text
    ids = v.encode("the fox <extra_id_0> a jar <extra_id_1>")
    assert v.vocab_size - 1 in ids and v.vocab_size - 2 in ids
    assert v.encode(v.decode(ids)) == ids
    assert v.decode([*v.encode("the fox"), 1, *v.encode("lamb")]) == "the fox"


def test_train_sentencepiece_on_local_text(tmp_path):
    path = train_sentencepiece(
        [os.path.join(tasks.TINY_CORPUS_DIR, "validation.txt")],
        tmp_path / "m",
        vocab_size=100,
        normalization_rule_name="identity",
    )
    v = sl.SentencePieceVocabulary(path)
    assert v.vocab_size == 100
    assert v.decode(v.encode("The wise owl")) == "The wise owl"
    with pytest.raises(FileNotFoundError, match="no such text file"):
        train_sentencepiece([tmp_path / "nope.txt"], tmp_path / "m2", 100)


def test_passthrough_vocabulary():
    v = sl.PassThroughVocabulary(size=50)
    assert v.encode([3, 4, 5]) == [3, 4, 5] and v.encode("3 4 5") == [3, 4, 5]
    assert v.decode([3, 4, 1, 7]) == "3 4"
    with pytest.raises(ValueError, match="out of range"):
        v.encode([50])


# -- sources -----------------------------------------------------------------------------------


def test_text_and_jsonl_sources(tmp_path):
    (tmp_path / "a.txt").write_text("one\n\ntwo\nthree\n")
    src = sl.TextLineSource({"train": str(tmp_path / "*.txt")})
    data = src.open("train")
    assert [data[i]["text"] for i in range(len(data))] == ["one", "two", "three"]

    lines = [json.dumps({"x": i}) for i in range(5)]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    js = sl.JsonlSource({"train": str(tmp_path / "d.jsonl")}).open("train")
    assert [js[i]["x"] for i in range(len(js))] == list(range(5))


def test_malformed_jsonl_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"x": 1}\n{"x": 2\n{"x": 3}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: malformed JSON line"):
        sl.JsonlSource({"train": str(path)}).open("train")
    skipping = sl.JsonlSource({"train": str(path)}, skip_malformed=True)
    data = skipping.open("train")
    assert [data[i]["x"] for i in range(len(data))] == [1, 3]
    assert skipping.num_skipped("train") == 1


def test_missing_file_unknown_and_empty_split(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"No file matches .*nothing-\*\.txt.*'train'"):
        sl.TextLineSource({"train": str(tmp_path / "nothing-*.txt")}).open("train")
    (tmp_path / "empty.txt").write_text("\n\n")
    src = sl.TextLineSource({"train": str(tmp_path / "empty.txt")}, name="e")
    with pytest.raises(ValueError, match="Split 'train' of TextLineSource 'e' is empty"):
        src.open("train")
    with pytest.raises(ValueError, match="has no split 'test'; available: \\['train'\\]"):
        src.open("test")


def test_parquet_source(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table({"text": [f"t{i}" for i in range(10)], "n": list(range(10))})
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=3)
    data = sl.ParquetSource({"train": str(tmp_path / "d.parquet")}).open("train")
    assert len(data) == 10
    assert data[7] == {"text": "t7", "n": 7}
    assert [data[i]["n"] for i in (9, 0, 4)] == [9, 0, 4]


def test_array_record_source_round_trips_examples(tmp_path):
    from array_record.python.array_record_module import ArrayRecordWriter

    examples = [{"ids": np.arange(i, dtype=np.int32), "s": f"e{i}", "k": i} for i in range(6)]
    w = ArrayRecordWriter(str(tmp_path / "x.array_record"), "group_size:1")
    for ex in examples:
        w.write(sources.encode_example(ex))
    w.close()
    data = sl.ArrayRecordSource({"train": str(tmp_path / "*.array_record")}).open("train")
    assert len(data) == 6
    for i, ex in enumerate(examples):
        got = data[i]
        np.testing.assert_array_equal(got["ids"], ex["ids"])
        assert got["ids"].dtype == np.int32 and got["s"] == ex["s"] and got["k"] == ex["k"]


def test_fingerprints_are_stable_and_change_with_data(tmp_path):
    (tmp_path / "a.txt").write_text("one\ntwo\n")
    fp1 = sl.TextLineSource({"train": str(tmp_path / "a.txt")}).fingerprint("train")
    fp2 = sl.TextLineSource({"train": str(tmp_path / "a.txt")}).fingerprint("train")
    (tmp_path / "a.txt").write_text("one\ntwo\nthree\n")
    fp3 = sl.TextLineSource({"train": str(tmp_path / "a.txt")}).fingerprint("train")
    assert fp1 == fp2 != fp3
    m1 = sl.InMemorySource({"train": [{"a": 1}]}).fingerprint("train")
    m2 = sl.InMemorySource({"train": [{"a": 2}]}).fingerprint("train")
    assert m1 != m2


def test_hf_dataset_source(tmp_path):
    datasets = pytest.importorskip("datasets", reason="Hugging Face `datasets` not installed")
    datasets.Dataset.from_dict({"text": ["a", "b", "c"]}).save_to_disk(str(tmp_path / "hf"))
    src = sl.HFDatasetSource(str(tmp_path / "hf"))
    data = src.open("train")
    assert [data[i]["text"] for i in range(3)] == ["a", "b", "c"]


def test_embedded_tasks_are_registered_and_deterministic():
    for name in ["synthetic_copy", "synthetic_reverse", "synthetic_arithmetic", "tiny_corpus_lm",
                 "tiny_corpus_lm_sp", "tiny_corpus_span_corruption"]:  # fmt: skip
        assert name in sl.TaskRegistry
    assert tasks.arithmetic_example("train", 7) == tasks.arithmetic_example("train", 7)
    ex = tasks.reverse_example("validation", 3)
    assert ex["targets"] == ex["inputs"][::-1]
    a = tasks.arithmetic_example("test", 11)
    assert str(eval(a["inputs"])) == a["targets"]  # our own digits
