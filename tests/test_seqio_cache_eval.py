"""seqio_lite: the Beam cache job and reading it back; metrics and the Evaluator."""

import json
import os

import numpy as np
import pytest

import seqio_lite as sl
from seqio_lite import cache, cache_tasks, evaluation

TASK = "tiny_corpus_span_corruption"
SEQ = {"inputs": 48, "targets": 16}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    pytest.importorskip("apache_beam", reason="apache-beam not installed (pip install .[beam])")
    out = str(tmp_path_factory.mktemp("cache"))
    rc = cache_tasks.main([f"--task={TASK}", f"--output_dir={out}", "--num_shards=3",
                           "--chunk_size=50"])  # fmt: skip
    assert rc == 0
    cache_tasks.add_global_cache_dirs([out])
    yield out
    cache._CACHE_DIRS.remove(out)


def test_cache_job_writes_shards_info_stats_and_marker(cache_dir):
    task_dir = os.path.join(cache_dir, TASK)
    files = sorted(os.listdir(task_dir))
    assert "COMPLETED" in files and "info.json" in files and "stats.train.json" in files
    assert sum(f.startswith("train.array_record-") for f in files) == 3
    with open(os.path.join(task_dir, "info.json")) as f:
        info = json.load(f)
    n = sl.TaskRegistry.get(TASK).num_input_examples("train")
    assert info["splits"]["train"]["num_examples"] == n
    with open(os.path.join(task_dir, "stats.train.json")) as f:
        assert json.load(f)["examples"] == n


def test_cached_examples_equal_uncached(cache_dir):
    task = sl.TaskRegistry.get(TASK)
    data = task.source.open("validation")
    cached = cache_tasks.cached_source(task).open("validation")
    assert len(cached) == len(data)
    for i in range(len(data)):
        want = task.preprocess_pre_cache(data[i], i)
        got = cached[i]
        assert got.keys() == want.keys()
        for k in want:
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_use_cached_batches_equal_uncached(cache_dir):
    kw = dict(batch_size=4, seed=11)
    a = sl.get_dataset(TASK, SEQ, use_cached=False, **kw)
    b = sl.get_dataset(TASK, SEQ, use_cached=True, **kw)
    for _ in range(5):
        x, y = next(a), next(b)
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)
    # A state from the uncached pipeline does not restore onto the cached one.
    with pytest.raises(sl.StateMismatchError, match="use_cached"):
        b.set_state(a.get_state())


def test_cache_job_refuses_to_overwrite(cache_dir, capsys):
    rc = cache_tasks.main([f"--task={TASK}", f"--output_dir={cache_dir}"])
    assert rc == 1
    assert "already holds a completed cache; pass --overwrite" in capsys.readouterr().err


def test_missing_cache_is_a_clear_error(tmp_path):
    task = sl.TaskRegistry.get("tiny_corpus_lm")
    with pytest.raises(FileNotFoundError, match="No completed cache for task 'tiny_corpus_lm'"):
        sl.get_dataset(task, {"targets": 32}, use_cached=True)
    with pytest.raises(ValueError, match="has no CacheDatasetPlaceholder"):
        sl.get_dataset("synthetic_copy", {"inputs": 8, "targets": 8}, use_cached=True)


# -- metrics -----------------------------------------------------------------------------------


def test_metrics():
    assert sl.accuracy([1, 2, 3, 4], [1, 2, 0, 4]) == {"accuracy": 75.0}
    assert sl.exact_match(["ab", "c "], ["ab", "d"]) == {"exact_match": 50.0}
    assert sl.sequence_accuracy([[1, 2], [3]], [[1, 2], [3, 4]]) == {"sequence_accuracy": 50.0}
    assert sl.bleu(["the cat sat on the mat"], ["the cat sat on the mat"])["bleu"] == pytest.approx(
        100.0
    )
    assert sl.bleu(["the cat sat on the mat"], ["a dog ran"])["bleu"] < 10
    r = sl.rouge(["the cat sat on the mat"], ["the cat sat on a mat"])
    assert set(r) == {"rouge1", "rouge2", "rougeLsum"} and 60 < r["rouge1"] < 100
    with pytest.raises(ValueError, match="2 targets but 1 predictions"):
        sl.accuracy([1, 2], [1])


def test_metric_kind_by_signature():
    def mean_score(targets, scores):
        return {"mean": float(np.mean(scores))}

    assert evaluation.metric_kind(sl.exact_match) == "predictions"
    assert evaluation.metric_kind(mean_score) == "scores"
    with pytest.raises(ValueError, match="must take \\(targets, predictions\\)"):
        evaluation.metric_kind(lambda a, b: {})


def test_evaluator_runs_predict_and_score_fns():
    def mean_score(targets, scores):
        return {"mean_score": float(np.mean(scores))}

    task = sl.TaskRegistry.get("synthetic_reverse")
    scored = sl.Task("reverse_scored", task.source, task.output_features,
                     [*task.post_cache_preprocessors], task.postprocess_fn,
                     [sl.exact_match, mean_score])  # fmt: skip
    ev = sl.Evaluator(scored, {"inputs": 32, "targets": 32}, batch_size=16, num_examples=40)
    # An oracle that copies the targets scores 100; one that echoes the inputs does not.
    oracle = ev.evaluate(
        predict_fn=lambda b: b["decoder_target_tokens"],
        score_fn=lambda b: np.ones(b["decoder_target_tokens"].shape[0]),
    )
    assert oracle["reverse_scored"] == {"exact_match": 100.0, "mean_score": 1.0}
    echo = ev.evaluate(predict_fn=lambda b: b["encoder_input_tokens"])
    assert echo["reverse_scored"]["exact_match"] < 20
    assert "mean_score" not in echo["reverse_scored"]  # no score_fn -> skipped
