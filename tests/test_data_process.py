"""`BackgroundIterator`: the in-process iterator's batches and states, read by a data process.

What a user relies on: the same batches in the same order with the same resumable states as
reading in the training process; the pipeline's own errors with their type and message; a clear
error (and recovery) when the data process dies; reading in-process, with the reason said, when
the pipeline cannot travel; and no data process left behind, whatever happens to the trainer.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import seqio_lite as sl

_LENGTHS = {"inputs": 12, "targets": 10}


def _task(
    name: str, n: int, fail_at: int | None = None, extra: object = None, chatty: bool = False
) -> sl.Task:
    """A task whose source and preprocessor are closures (they travel by value); `fail_at`:
    the source index whose example the preprocessor rejects; `chatty`: it prints each one."""
    vocab = sl.ByteVocabulary()

    def source(split, i):
        return {"inputs": "x" * (1 + i % 7), "targets": "y" * (1 + i % 5), "index": i}

    def check(ex):
        if ex["index"] == fail_at:
            raise ValueError(f"example {fail_at} is malformed")
        if chatty:
            print(f"preprocessing example {ex['index']}")  # a user's debugging
        _ = extra  # a free variable: it travels with the closure
        return ex

    return sl.Task(
        name, sl.sources.FunctionSource(source, {"train": n}),
        output_features={"inputs": sl.Feature(vocab), "targets": sl.Feature(vocab)},
        preprocessors=[check, functools.partial(sl.preprocessors.tokenize)],
    )  # fmt: skip


def _iterator(task: sl.Task, **kwargs) -> sl.DataIterator:
    return sl.get_dataset(task, _LENGTHS, "train", 4, seed=3, **kwargs)


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_same_batches_and_states_as_in_process_and_resumes_from_a_state():
    task = _task("bg_same", 200)
    ref = _iterator(task)
    bg = sl.BackgroundIterator(_iterator(task), buffer_size=2)
    try:
        assert bg.fallback_reason is None
        assert bg.get_state() == ref.get_state()
        assert bg.feature_shapes == ref.feature_shapes and bg.batch_size == 4
        states = []
        for _ in range(12):
            _assert_same(next(bg), next(ref))
            assert bg.get_state() == ref.get_state()
            states.append(bg.get_state())
        # Back to an earlier state: the data process restarts there, batches made ahead dropped.
        bg.set_state(states[4])
        ref.set_state(states[4])
        for _ in range(3):
            _assert_same(next(bg), next(ref))
            assert bg.get_state() == ref.get_state()
        # A state of another pipeline: the in-process error, at once.
        other = _iterator(_task("bg_other", 50)).get_state()
        with pytest.raises(sl.StateMismatchError, match="does not match this pipeline"):
            bg.set_state(other)
    finally:
        bg.close()


def test_a_preprocessor_that_prints_does_not_disturb_the_batches(capfd):
    task = _task("bg_chatty", 100, chatty=True)
    ref = _iterator(task)
    bg = sl.BackgroundIterator(_iterator(task))
    try:
        for _ in range(5):
            _assert_same(next(bg), next(ref))
            assert bg.get_state() == ref.get_state()
    finally:
        bg.close()
    # The data process's prints reach the user (on stderr), not the batches' pipe.
    assert "preprocessing example" in capfd.readouterr().err


def test_finite_data_ends_like_the_in_process_iterator():
    task = _task("bg_finite", 9)
    ref = list(_iterator(task, num_epochs=1, shuffle=False, pack=False))
    bg = sl.BackgroundIterator(_iterator(task, num_epochs=1, shuffle=False, pack=False))
    got = list(bg)
    assert len(got) == len(ref) > 1
    for a, b in zip(got, ref):
        _assert_same(a, b)
    with pytest.raises(StopIteration):
        next(bg)
    bg.close()


def test_a_preprocessor_error_reaches_the_trainer_with_its_type_and_message():
    task = _task("bg_error", 40, fail_at=6)
    ref = _iterator(task, num_epochs=1, shuffle=False)
    bg = sl.BackgroundIterator(_iterator(task, num_epochs=1, shuffle=False))
    try:
        with pytest.raises(ValueError, match=r"^example 6 is malformed$"):
            next(ref)
        with pytest.raises(ValueError, match=r"^example 6 is malformed$"):
            next(bg)
        assert bg.get_state() == ref.get_state()  # stands at the example that failed
        with pytest.raises(ValueError, match=r"^example 6 is malformed$"):
            next(bg)  # read again from there, as in-process
    finally:
        bg.close()


def test_a_killed_data_process_is_one_clear_error_and_the_next_batch_still_comes():
    task = _task("bg_killed", 200)
    ref = _iterator(task)
    bg = sl.BackgroundIterator(_iterator(task))
    try:
        _assert_same(next(bg), next(ref))
        bg._proc.kill()  # as the kernel's OOM killer would
        bg._proc.wait()
        died = (r"^seqio_lite data process ended with exit code -9 before sending its batch "
                r"\(killed, or out of memory\?\)$")  # fmt: skip
        with pytest.raises(RuntimeError, match=died):
            # Batches it sent before it died are still in the pipe (up to 64 KiB of them, dozens
            # of these small ones): they are good batches and come first.
            for _ in range(1000):
                _assert_same(next(bg), next(ref))
        # A new data process continues from the last batch taken.
        ref.set_state(bg.get_state())
        _assert_same(next(bg), next(ref))
        assert bg.get_state() == ref.get_state()
    finally:
        bg.close()


def test_a_pipeline_that_cannot_travel_is_read_in_process_with_the_reason():
    task = _task("bg_lock", 60, extra=threading.Lock())  # a lock does not pickle
    told = []
    ref = _iterator(task)
    bg = sl.BackgroundIterator(_iterator(task), on_fallback=told.append)
    assert bg._proc is None
    assert told == [bg.fallback_reason and f"data read in the training process: "
                    f"{bg.fallback_reason}"]  # fmt: skip
    assert "cannot be pickled" in told[0] and "lock" in told[0]
    for _ in range(3):
        _assert_same(next(bg), next(ref))
        assert bg.get_state() == ref.get_state()
    bg.close()


def test_the_data_process_ends_with_close_and_with_the_training_process(tmp_path):
    bg = sl.BackgroundIterator(_iterator(_task("bg_close", 100)))
    next(bg)
    proc = bg._proc
    bg.close()
    assert proc.poll() is not None

    # A training process killed outright (no close, no atexit): its data process goes too.
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        import seqio_lite as sl
        from test_data_process import _iterator, _task
        bg = sl.BackgroundIterator(_iterator(_task("bg_orphan", 100)))
        next(bg)
        print(bg._proc.pid, flush=True)
        os.kill(os.getpid(), 9)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == -9, out.stderr
    child = int(out.stdout.split()[0])
    deadline = time.time() + 20
    while time.time() < deadline and _alive(child):
        time.sleep(0.1)
    assert not _alive(child), f"data process {child} outlived its training process"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"  # a zombie has ended (its reaper is gone)
    except FileNotFoundError:
        return False
