"""`parallel_map`: the plain worker threads that checkpoint I/O and staging run on."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any


def parallel_map(fn: Any, items: Sequence[Any], threads: int = 4) -> list[Any]:
    """`[fn(x) for x in items]` on plain threads; re-raises the first error.

    NOTE: not a ThreadPoolExecutor on purpose: an async save may still be finishing while the
    interpreter exits, and executors refuse new work once shutdown has begun.
    """
    out: list[Any] = [None] * len(items)
    errors: list[BaseException] = []
    lock = threading.Lock()
    next_i = iter(range(len(items)))

    def worker() -> None:
        while not errors:
            with lock:
                i = next(next_i, None)
            if i is None:
                return
            try:
                out[i] = fn(items[i])
            except BaseException as e:
                errors.append(e)

    pool = [threading.Thread(target=worker) for _ in range(max(1, min(threads, len(items))))]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    if errors:
        raise errors[0]
    return out
