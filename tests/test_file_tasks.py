"""Tasks defined in gin alone (seqio_lite.file_tasks): every source kind, objectives, vocabularies,
mixtures, and bad data files refused in one line that names the file and line."""

from __future__ import annotations

import json
import os

import gin
import numpy as np
import pytest
from conftest import run_cli

import seqio_lite
from seqio_lite import file_tasks

LENGTHS = {"inputs": 16, "targets": 8}
PAIRS = [(f"q{i}", f"a{i}") for i in range(12)]


def _gin_data(tmp_path, gin_text: str, name: str = "data.gin") -> seqio_lite.Task:
    """Parses a gin file the way the CLI does and returns the task `DataConfig.task` names."""
    from t5lite.cli import gin_config
    from t5lite.cli import registry as reg

    (tmp_path / name).write_text(gin_text)
    with gin.unlock_config():
        gin.clear_config()
    try:
        gin_config.parse_gin([str(tmp_path / name)], [])
        data = reg.DataConfig()
    finally:
        with gin.unlock_config():
            gin.clear_config()
    return seqio_lite.get_task_or_mixture(data.task)


def _write_jsonl(path, records) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _texts(task: seqio_lite.Task, split: str, lengths=LENGTHS) -> list[tuple[str, str]]:
    vocab = task.output_features["targets"].vocabulary
    return [
        (vocab.decode(ex["inputs"]) if "inputs" in ex else "", vocab.decode(ex["targets"]))
        for ex in seqio_lite.preprocessed_examples(task, split, lengths)
    ]


DATA_GIN = """
import t5lite.cli.registry
DataConfig.task = %TASK
DataConfig.task_feature_lengths = {'inputs': 16, 'targets': 8}
DataConfig.batch_size = 4
"""


def test_jsonl_task_in_gin(tmp_path):
    _write_jsonl(tmp_path / "train-0.jsonl", [{"q": q, "a": a} for q, a in PAIRS[:6]])
    _write_jsonl(tmp_path / "train-1.jsonl", [{"q": q, "a": a} for q, a in PAIRS[6:]])
    _write_jsonl(tmp_path / "valid.jsonl", [{"q": "vq", "a": "va", "extra": 1}])
    task = _gin_data(tmp_path, DATA_GIN + f"""
TASK = @gin_jsonl/JsonlTask()
gin_jsonl/JsonlTask.name = 'gin_jsonl'
gin_jsonl/JsonlTask.files = {{'train': '{tmp_path}/train-*.jsonl',
                              'validation': '{tmp_path}/valid.jsonl'}}
gin_jsonl/JsonlTask.inputs_field = 'q'
gin_jsonl/JsonlTask.targets_field = 'a'
gin_jsonl/JsonlTask.metrics = ['exact_match', 'bleu']
""")  # fmt: skip
    assert task.name == "gin_jsonl"
    assert _texts(task, "train") == PAIRS  # both files, in glob order
    assert _texts(task, "validation") == [("vq", "va")]
    assert [m.__name__ for m in task.metric_fns] == ["exact_match", "bleu"]
    assert task.supports_caching  # `t5lite cache` can tokenize it once
    batch = next(seqio_lite.get_dataset(task, LENGTHS, batch_size=4, shuffle=False, pack=False))
    assert batch["encoder_input_tokens"].shape == (4, 16)


def test_text_lines_task_lm_and_span_corruption_in_gin(tmp_path):
    docs = ["the cat sat on the mat", "a dog ran far away", "birds sing at dawn"]
    (tmp_path / "docs.txt").write_text("\n".join(docs) + "\n\n")  # the empty line is no document
    task = _gin_data(tmp_path, DATA_GIN + f"""
TASK = @gin_lines/TextLinesTask()
gin_lines/TextLinesTask.name = 'gin_lines'
gin_lines/TextLinesTask.files = {{'train': '{tmp_path}/docs.txt'}}
""")  # fmt: skip
    assert sorted(task.output_features) == ["targets"]
    assert [t for _, t in _texts(task, "train", {"targets": 64})] == docs
    assert [m.__name__ for m in task.metric_fns] == ["perplexity"]  # the LM default

    sc = _gin_data(tmp_path, DATA_GIN + f"""
TASK = @gin_lines_sc/TextLinesTask()
gin_lines_sc/TextLinesTask.name = 'gin_lines_sc'
gin_lines_sc/TextLinesTask.files = {{'train': '{tmp_path}/docs.txt'}}
gin_lines_sc/TextLinesTask.objective = 'span_corruption'
""")  # fmt: skip
    vocab = sc.output_features["inputs"].vocabulary
    assert vocab.extra_ids == 100  # the byte vocabulary gets T5's sentinels
    ex = next(iter(seqio_lite.preprocessed_examples(sc, "train", {"inputs": 32, "targets": 32})))
    sentinel = vocab.vocab_size - 1
    assert sentinel in ex["inputs"] and sentinel in ex["targets"]


def test_prefix_lm_objective_splits_each_document(tmp_path):
    (tmp_path / "docs.txt").write_text("abcdefghijklmnopqrstuvwxyz\n" * 8)
    name = file_tasks.text_lines_task(
        "prefix_docs", {"train": str(tmp_path / "docs.txt")}, objective="prefix_lm"
    )
    task = seqio_lite.get_task_or_mixture(name)
    cuts = set()
    for ex in seqio_lite.preprocessed_examples(task, "train", {"inputs": 10, "targets": 10}):
        inputs, targets = ex["inputs"][:-1], ex["targets"][:-1]  # without EOS
        whole = bytes((np.concatenate([inputs, targets]) - 3).astype(np.uint8)).decode()
        assert whole in "abcdefghijklmnopqrstuvwxyz"  # one contiguous window, prefix first
        assert 1 <= len(inputs) <= 9 and 1 <= len(targets) <= 9  # within each length
        assert len(targets) == 9 or len(whole) == 18  # as much as fits
        cuts.add(len(inputs))
    assert len(cuts) > 1  # the split point is drawn per example


def test_parquet_task_in_gin(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"src": [q for q, _ in PAIRS], "tgt": [a for _, a in PAIRS], "n": [1] * 12})
    pq.write_table(table, tmp_path / "train.parquet", row_group_size=5)
    task = _gin_data(tmp_path, DATA_GIN + f"""
TASK = @gin_parquet/ParquetTask()
gin_parquet/ParquetTask.name = 'gin_parquet'
gin_parquet/ParquetTask.files = {{'train': '{tmp_path}/*.parquet'}}
gin_parquet/ParquetTask.inputs_field = 'src'
gin_parquet/ParquetTask.targets_field = 'tgt'
""")  # fmt: skip
    assert _texts(task, "train") == PAIRS


def test_hf_dataset_task_in_gin(tmp_path):
    datasets = pytest.importorskip("datasets")
    dd = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict(
                {"question": [q for q, _ in PAIRS], "answer": [a for _, a in PAIRS]}
            ),
            "validation": datasets.Dataset.from_dict({"question": ["vq"], "answer": ["va"]}),
        }
    )
    dd.save_to_disk(str(tmp_path / "hf"))
    task = _gin_data(tmp_path, DATA_GIN + f"""
TASK = @gin_hf/HFDatasetTask()
gin_hf/HFDatasetTask.name = 'gin_hf'
gin_hf/HFDatasetTask.path = '{tmp_path}/hf'
gin_hf/HFDatasetTask.inputs_field = 'question'
gin_hf/HFDatasetTask.targets_field = 'answer'
""")  # fmt: skip
    assert _texts(task, "train") == PAIRS
    assert _texts(task, "validation") == [("vq", "va")]


def test_mixture_with_rates_in_gin(tmp_path):
    _write_jsonl(tmp_path / "a.jsonl", [{"q": "a", "a": "a"}] * 10)
    _write_jsonl(tmp_path / "b.jsonl", [{"q": "b", "a": "b"}] * 10)
    mix = _gin_data(tmp_path, DATA_GIN + f"""
TASK = @gin_mix/Mixture()
gin_mix/Mixture.name = 'gin_mix'
gin_mix/Mixture.tasks = [(@gin_a/JsonlTask(), 3), (@gin_b/JsonlTask(), 1)]
gin_a/JsonlTask.name = 'gin_a'
gin_a/JsonlTask.files = {{'train': '{tmp_path}/a.jsonl'}}
gin_a/JsonlTask.inputs_field = 'q'
gin_a/JsonlTask.targets_field = 'a'
gin_b/JsonlTask.name = 'gin_b'
gin_b/JsonlTask.files = {{'train': '{tmp_path}/b.jsonl'}}
gin_b/JsonlTask.inputs_field = 'q'
gin_b/JsonlTask.targets_field = 'a'
""")  # fmt: skip
    assert isinstance(mix, seqio_lite.Mixture)
    assert [(t.name, r) for t, r in mix.tasks_and_rates()] == [("gin_a", 0.75), ("gin_b", 0.25)]
    it = seqio_lite.get_dataset(mix, LENGTHS, batch_size=40, pack=False)
    first = next(it)["encoder_input_tokens"][:, 0] - 3  # byte ids are offset by 3
    assert sorted(np.bincount(first, minlength=99)[[ord("a"), ord("b")]]) == [10, 30]


def test_trained_sentencepiece_vocabulary(tmp_path, monkeypatch):
    pytest.importorskip("sentencepiece")
    monkeypatch.setenv("SEQIO_LITE_HOME", str(tmp_path / "home"))
    rng = np.random.default_rng(0)
    words = ["cafe", "bad", "dead", "face", "fade", "bead", "deaf", "babe"]
    lines = [" ".join(rng.choice(words, 12)) for _ in range(300)]
    (tmp_path / "docs.txt").write_text("\n".join(lines) + "\n")
    task = _gin_data(tmp_path, DATA_GIN + f"""
TASK = @gin_spm/TextLinesTask()
gin_spm/TextLinesTask.name = 'gin_spm'
gin_spm/TextLinesTask.files = {{'train': '{tmp_path}/docs.txt'}}
gin_spm/TextLinesTask.vocabulary = @TrainedSentencePiece()
TrainedSentencePiece.vocab_size = 18
""")  # fmt: skip
    vocab = task.output_features["targets"].vocabulary
    assert isinstance(vocab, seqio_lite.SentencePieceVocabulary)
    assert vocab.vocab_size == 18
    assert os.path.dirname(vocab.model_file).startswith(str(tmp_path / "home"))
    assert vocab.decode(vocab.encode(lines[0])) == lines[0]
    assert len(vocab.encode(lines[0])) < len(lines[0]) / 2  # pieces, not characters
    stamp = os.path.getmtime(vocab.model_file)
    file_tasks._defined.pop("gin_spm")  # defined again (another process): reused, not retrained
    seqio_lite.TaskRegistry.remove("gin_spm")
    again = _gin_data(tmp_path, (tmp_path / "data.gin").read_text(), "again.gin")
    assert again.output_features["targets"].vocabulary.model_file == vocab.model_file
    assert os.path.getmtime(vocab.model_file) == stamp

    file_tasks._defined.pop("gin_spm")
    seqio_lite.TaskRegistry.remove("gin_spm")
    with pytest.raises(ValueError, match=r"task 'gin_spm': TrainedSentencePiece.vocab_size = 100 "
                       r"is too large for this data \(at most 18\)"):  # fmt: skip
        _gin_data(
            tmp_path,
            (tmp_path / "data.gin").read_text() + "TrainedSentencePiece.vocab_size = 100\n",
            "big.gin",
        )


def test_rank_classification_rows_and_metric(tmp_path):
    records = [
        {"q": "2+2", "choices": ["3", "4", "5"], "label": 1},
        {"q": "1+1", "choices": ["2", "11"], "label": 0},
        {"q": "3+3", "choices": ["33", "6", "9", "0"], "label": 1},
    ]
    _write_jsonl(tmp_path / "mc.jsonl", records)
    name = file_tasks.jsonl_task(
        "mc_rows", {"train": str(tmp_path / "mc.jsonl"), "validation": str(tmp_path / "mc.jsonl")},
        inputs_field="q", choices_field="choices", label_field="label",
    )  # fmt: skip
    task = seqio_lite.get_task_or_mixture(name)
    # train: each example once, with its correct answer; eval: one row per choice
    assert _texts(task, "train") == [("2+2", "4"), ("1+1", "2"), ("3+3", "6")]
    rows = _texts(task, "validation")
    assert rows == [(r["q"], c) for r in records for c in r["choices"]]
    # A scorer that prefers the correct rows of examples 0 and 2 and a wrong row of example 1.
    prefer = {("2+2", "4"), ("1+1", "11"), ("3+3", "6")}
    evaluator = seqio_lite.Evaluator(name, LENGTHS, batch_size=4)
    vocab = task.output_features["targets"].vocabulary

    def score_fn(batch):
        out = []
        for enc, dec in zip(batch["encoder_input_tokens"], batch["decoder_target_tokens"]):
            pair = (vocab.decode(enc), vocab.decode(dec))
            out.append(0.0 if pair in prefer else -1.0)
        return out

    result = evaluator.evaluate(score_fn=score_fn)
    assert result == {"mc_rows": {"accuracy": pytest.approx(200 / 3)}}


def test_score_metrics_against_numpy():
    targets = ["x", "y", "z"]
    scores = [-2.0, -4.0, -6.0]
    assert seqio_lite.evaluation.log_likelihood(targets, scores) == {"log_likelihood": -4.0}
    ppl = seqio_lite.evaluation.perplexity(targets, scores, num_tokens=[2, 4, 6])
    assert ppl["perplexity"] == pytest.approx(np.exp(12 / 12))
    rc = seqio_lite.evaluation.rank_classification(
        [(0, False), (0, True), (1, True), (1, False)], [-3.0, -1.0, -5.0, -4.0]
    )
    assert rc == {"accuracy": 50.0}
    normalised = seqio_lite.evaluation.rank_classification(
        [(0, False), (0, True)], [-3.0, -4.0], num_tokens=[1, 8], normalize_by_target_length=True
    )
    assert normalised == {"accuracy": 100.0}  # -0.5 per token beats -3


# --- settings a user gets wrong: one line naming the culprit ----------------------------------


def test_bad_settings_name_the_setting(tmp_path):
    _write_jsonl(tmp_path / "t.jsonl", [{"q": "a", "a": "b"}])
    files = {"train": str(tmp_path / "t.jsonl")}
    cases = [
        (dict(inputs_field="q", targets_field="a", metrics=["exact"]),
         "task 'bad': metric 'exact' is unknown (did you mean 'exact_match'?)"),
        (dict(inputs_field="q", targets_field="a", objective="prefix"),
         "task 'bad': objective 'prefix' is unknown (did you mean 'prefix_lm'?)"),
        (dict(inputs_field="q", objective="inputs_targets"),
         "task 'bad': objective 'inputs_targets' needs targets_field"),
        (dict(inputs_field="q", text_field="a"),
         "task 'bad': inputs_field = 'q' is not read by objective 'lm'"),
        (dict(text_field="q", objective="span_corruption",
              vocabulary=seqio_lite.ByteVocabulary()),
         "task 'bad': span_corruption needs sentinel ids but the vocabulary has extra_ids = 0"),
    ]  # fmt: skip
    for kwargs, message in cases:
        with pytest.raises(ValueError) as e:
            file_tasks.jsonl_task("bad", files, **kwargs)
        assert str(e.value).startswith(message), e.value
    with pytest.raises(ValueError, match="'synthetic_copy' is already registered"):
        file_tasks.jsonl_task("synthetic_copy", files, inputs_field="q", targets_field="a")


BAD_FILES = [
    # (file name, content, the error line after "t5lite train: error: ")
    ("empty.jsonl", "",
     "Split 'train' of JsonlSource 'user_data' is empty ({d}/empty.jsonl)"),
    ("broken.jsonl", '{"q": "a", "a": "b"}\n{"q": "a", "a": \n',
     "{d}/broken.jsonl:2: malformed JSON line: Expecting value: line 1 column 17 (char 16)"),
    ("missing.jsonl", '{"q": "a", "a": "b"}\n\n{"q": "a", "answer": "b"}\n',
     "{d}/missing.jsonl:3: missing field 'a' (the record has ['answer', 'q'])"),
    ("typed.jsonl", '{"q": "a", "a": 7}\n',
     "{d}/typed.jsonl:1: field 'a' is 7, expected a string"),
    ("nothing-*.jsonl", None,
     "No file matches '{d}/nothing-*.jsonl' (JsonlSource 'user_data', split 'train')"),
]  # fmt: skip


@pytest.mark.parametrize("name,content,message", BAD_FILES, ids=[c[0] for c in BAD_FILES])
def test_bad_data_files_fail_in_one_line(tmp_path, capsys, name, content, message):
    if content is not None:
        (tmp_path / name).write_text(content)
    (tmp_path / "user.gin").write_text(f"""
include 'quickstart.gin'
TASK = @user_data/JsonlTask()
user_data/JsonlTask.name = 'user_data'
user_data/JsonlTask.files = {{'train': '{tmp_path}/{name}'}}
user_data/JsonlTask.inputs_field = 'q'
user_data/JsonlTask.targets_field = 'a'
""")  # fmt: skip
    file_tasks._defined.pop("user_data", None)
    rc = run_cli(
        "train", f"--gin_file={tmp_path}/user.gin", f"--gin.MODEL_DIR='{tmp_path}/run'",
        "--host_device_count=8",
    )  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    expected = "t5lite train: error: " + message.format(d=tmp_path)
    assert rc == 1 and len(err) == 1 and err[0].startswith(expected), err
    assert not (tmp_path / "run").exists()  # refused before anything was written


@pytest.mark.parametrize(
    "binding,message",
    [
        ("user_cfg/JsonlTask.input_field='q'",
         "Configurable 'JsonlTask' doesn't have a parameter named 'input_field'. In bindings "
         "string line 1 user_cfg/JsonlTask.input_field='q'; did you mean inputs_field?"),
        ("user_cfg/JsonlTask.vocabulary=@SentencePieceVocabulary()",
         "user_cfg/SentencePieceVocabulary.model_file: required, but no value is bound"),
        ("user_cfg/JsonlTask.files='t.jsonl'",
         "user_cfg/JsonlTask.files = 't.jsonl': expects Mapping, got str"),
    ],
)  # fmt: skip
def test_task_binding_mistakes_in_one_line(tmp_path, capsys, binding, message):
    _write_jsonl(tmp_path / "t.jsonl", [{"q": "a", "a": "b"}])
    (tmp_path / "user.gin").write_text(f"""
include 'quickstart.gin'
TASK = @user_cfg/JsonlTask()
user_cfg/JsonlTask.name = 'user_cfg'
user_cfg/JsonlTask.files = {{'train': '{tmp_path}/t.jsonl'}}
user_cfg/JsonlTask.inputs_field = 'q'
user_cfg/JsonlTask.targets_field = 'a'
""")  # fmt: skip
    file_tasks._defined.pop("user_cfg", None)
    rc = run_cli("train", f"--gin_file={tmp_path}/user.gin", f"--gin.{binding}",
                 f"--gin.MODEL_DIR='{tmp_path}/run'", "--host_device_count=8")  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and err == [f"t5lite train: error: {message}"], err


def test_decoder_inputs_start_with_the_models_start_id():
    """Training and evaluation feed position 0 what the model's decoding feeds (an imported
    Llama: its BOS), not a hard-coded 0."""
    from t5lite.model.models import DecoderOnlyModel, EncoderDecoderModel
    from t5lite.programs.evaluate import feature_converter

    for model, task, start in [
        (DecoderOnlyModel(decoder_start_token_id=1), "tiny_corpus_lm", 1),
        (EncoderDecoderModel(), "synthetic_copy", 0),
    ]:
        lengths = {"targets": 16} if task == "tiny_corpus_lm" else LENGTHS
        for pack in (True, False):
            it = seqio_lite.get_dataset(
                task, lengths, batch_size=4, feature_converter=feature_converter(model, pack)
            )
            batch = next(it)
            assert (batch["decoder_input_tokens"][:, 0] == start).all(), (task, pack)
