"""A `DataIterator` read ahead in a separate process, so reading, preprocessing and packing
never take the training process's CPU or its interpreter lock.

Why a process: on a host whose cores also run the model (XLA:CPU) or feed the accelerators,
every millisecond of Python in the process that dispatches the steps is taken from them, and a
thread would still hold the interpreter lock the dispatching thread needs. The data process runs
at a low priority (`nice`): it reads in the cores' idle time, and on a busy host the steps come
first (measured on the quickstart, 2 cores: the pipeline took ~4 ms of each 75-80 ms step when
read in the training process, hardly any of it once read in a nice-19 process).

The batches and their iterator states are the in-process iterator's, in the same order: the
data process runs a copy of it and sends each batch with the state right after it, which is what
`get_state()` returns once that batch is taken. `set_state()` checks the state on the local
copy (the same errors, at once) and restarts the data process there.

The pipeline travels to the data process by cloudpickle (grain's own choice for its workers):
functions of importable modules by reference, closures, lambdas and a notebook's functions by
value. The data process is a fresh interpreter (running `main` below), not a fork
(the training process runs threads, which `fork` does not copy safely) and not multiprocessing's
`spawn` (which runs the user's main script again in the child). A pipeline that still cannot
make the trip (an open file, a lock) is read in this process instead; `on_fallback` is told why.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import IO, Any

import cloudpickle
import numpy as np

from seqio_lite.loader import DataIterator


class BackgroundIterator(Iterator[dict[str, np.ndarray]]):
    """`iterator`'s batches, made ahead by a data process at priority `nice`: `buffer_size`
    batches, plus those the pipe holds (64 KiB on Linux: dozens of small batches, one of a big).

    Has `DataIterator`'s interface (`get_state`, `set_state`, `close`, `feature_shapes`,
    `batch_size`). The data process ends with `close()`, or on its own once the training
    process is gone (its end of the pipe closes).
    """

    def __init__(
        self,
        iterator: DataIterator,
        buffer_size: int = 4,
        nice: int = 19,
        on_fallback: Callable[[str], None] | None = None,
    ):
        if buffer_size < 1:
            raise ValueError(f"buffer_size must be >= 1, got {buffer_size}")
        self._local = iterator  # the in-process copy: states are checked on it; the fallback
        self._buffer_size, self._nice = buffer_size, nice
        self._on_fallback = on_fallback
        self._state = iterator.get_state()  # after the last batch taken
        self._fallback: str | None = None
        self._ended = False  # the data ran out: StopIteration from now on, as in-process
        self._proc: subprocess.Popen | None = None
        self._start()

    # -- the data process ----------------------------------------------------------------------

    def _start(self) -> None:
        """A data process that reads on from the last batch taken."""
        self._local.set_state(self._state)
        try:
            payload = cloudpickle.dumps(self._local)
        except Exception as e:  # any pickling failure means: read here
            self._fall_back(f"the pipeline cannot be pickled ({type(e).__name__}: {e})")
            return
        self._proc = subprocess.Popen(
            [sys.executable, "-c", "from seqio_lite.background import main; main()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            # Its modules are found where this process finds them (paths added at run time too).
            env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
        )
        assert self._proc.stdin is not None
        # stdin stays open: its end-of-file tells the data process this one is gone.
        with contextlib.suppress(BrokenPipeError):  # it died at once: `_receive` says so
            pickle.dump((payload, self._buffer_size, self._nice), self._proc.stdin)
            self._proc.stdin.flush()

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            for pipe in (self._proc.stdin, self._proc.stdout):
                if pipe is not None:
                    pipe.close()
            self._proc = None

    def _fall_back(self, reason: str) -> None:
        self._stop()
        self._fallback = reason
        self._local.set_state(self._state)  # reads on, in this process, from the last batch
        if self._on_fallback is not None:
            self._on_fallback(f"data read in the training process: {reason}")

    @property
    def fallback_reason(self) -> str | None:
        """Why the batches are read in this process (None while a data process reads them)."""
        return self._fallback

    # -- iteration -----------------------------------------------------------------------------

    def __next__(self) -> dict[str, np.ndarray]:
        if self._fallback is not None:
            batch = next(self._local)
            self._state = self._local.get_state()
            return batch
        if self._ended:
            raise StopIteration
        msg = self._receive()
        kind = msg[0]
        if kind == "batch":
            _, batch, self._state = msg
            return batch
        if kind == "end":
            self._ended = True
            self._stop()
            raise StopIteration
        if kind == "unloadable":  # the pipeline pickled here but does not load there
            self._fall_back(msg[1])
            return next(self)
        # "error": the pipeline raised and the data process stopped at that example; the next
        # call starts from there, as the in-process iterator's would after its error.
        _, error, self._state = msg
        self._stop()
        self._start()
        raise error

    def _receive(self) -> tuple:
        assert self._proc is not None and self._proc.stdout is not None
        try:
            return pickle.load(self._proc.stdout)
        except EOFError:  # the data process is gone
            code = self._proc.wait()
            problem = f"ended with exit code {code} before sending its batch (killed, or out of "
            problem += "memory?)"
        except Exception as e:
            problem = f"sent a message this process cannot read ({type(e).__name__}: {e})"
        self._stop()
        self._start()  # a batch not taken yet is made again, from the same state
        raise RuntimeError(f"seqio_lite data process {problem}")

    def __iter__(self) -> BackgroundIterator:
        return self

    # -- DataIterator's interface ----------------------------------------------------------------

    def get_state(self) -> dict[str, Any]:
        return dict(self._state)

    def set_state(self, state: Mapping[str, Any]) -> None:
        self._local.set_state(state)  # a state of another pipeline fails here, as in-process
        self._state = self._local.get_state()
        self._ended = False
        if self._fallback is None:
            self._stop()
            self._start()

    def close(self) -> None:
        """Ends the data process (the batches it made ahead are dropped)."""
        self._stop()
        self._local.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit modules may be half gone
            self._stop()

    @property
    def batch_size(self) -> int:
        return self._local.batch_size

    @property
    def feature_shapes(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        return self._local.feature_shapes


def _serve(inp: IO[bytes], out: IO[bytes]) -> None:
    """The data process: rebuilds the iterator, then sends `(batch, state after it)` messages
    (made by a reading thread, `buffer_size` ahead) until the data ends or the training process
    is gone."""
    # Interrupts and termination are the training process's to handle (a preemption's SIGTERM
    # and a Ctrl-C reach the whole process group); it ends this process when done with it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    payload, buffer_size, nice = pickle.load(inp)
    if nice:
        os.nice(nice)
    # The training process closing its end (exiting, killed, or done with this one) ends this.
    threading.Thread(target=lambda: (inp.read(), os._exit(0)), daemon=True).start()
    try:
        it: DataIterator = pickle.loads(payload)
    except Exception as e:  # told to the training process, which reads instead
        _send(
            out,
            ("unloadable", f"the data process cannot load the pipeline ({type(e).__name__}: {e})"),
        )
        return
    made: queue.Queue = queue.Queue(maxsize=buffer_size)

    def read() -> None:
        while True:
            try:
                msg: tuple = ("batch", next(it), it.get_state())
            except StopIteration:
                msg = ("end",)
            except Exception as e:  # the training process raises it
                msg = ("error", _picklable(e), it.get_state())
            made.put(msg)
            if msg[0] != "batch":
                return

    threading.Thread(target=read, daemon=True).start()
    while True:
        msg = made.get()
        _send(out, msg)
        if msg[0] != "batch":
            return


def _send(out: IO[bytes], msg: tuple) -> None:
    try:
        pickle.dump(msg, out, protocol=pickle.HIGHEST_PROTOCOL)
        out.flush()
    except (BrokenPipeError, OSError):  # the training process is gone
        os._exit(0)


def _picklable(e: Exception) -> Exception:
    """`e` itself where it survives pickling (its type and message reach the training process),
    else a RuntimeError with its type and message."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")


def main() -> None:
    """The data process's entry point. Its messages go out on the pipe it was given as stdout;
    whatever else writes to stdout (a preprocessor's `print`, a library's C code) goes to
    stderr, the user's terminal, instead of into the messages."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    _serve(sys.stdin.buffer, out)
