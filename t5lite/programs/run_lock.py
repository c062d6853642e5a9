"""One run per model directory: `MODEL_DIR/RUN_LOCK` names the process that trains there.

A second `t5lite train` on the same directory would interleave checkpoints and metrics with the
first; it is refused in one line naming the owner. A lock left by a process that no longer
exists on this host (killed, machine rebooted into the same name) is taken over with a message.
Only process 0 of a multi-process run holds the lock: the run's processes share the directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

LOCK_FILE = "RUN_LOCK"


class RunLockError(RuntimeError):
    """Another live run owns the model directory; the message names it."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by another user
    return True


def _owner(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # torn or unreadable: treated as stale below only if we can tell


class RunLock:
    """`model_dir`'s run lock: `acquire()` takes it (or raises RunLockError), `release()`."""

    def __init__(self, model_dir: str | os.PathLike, info: Callable[[str], None] = print):
        self.directory = Path(model_dir)
        self.path = self.directory / LOCK_FILE
        self.info = info
        self.me = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}
        self.created = False  # acquire() made the directory

    def acquire(self) -> RunLock:
        self.created = not self.directory.exists()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RunLockError(f"model directory {self.directory}: {e.strerror}") from None
        taken_over = False
        while True:
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                break
            except PermissionError:
                raise RunLockError(f"model directory {self.directory} is not writable") from None
            except FileExistsError:
                owner = _owner(self.path)
                host, pid = owner.get("host"), owner.get("pid")
                gone = host == self.me["host"] and isinstance(pid, int) and not _alive(pid)
                if gone and not taken_over:
                    self.info(
                        f"taking over the run lock of {self.directory}: process {pid} on "
                        f"{host} is gone"
                    )
                    self.path.unlink(missing_ok=True)
                    taken_over = True
                    continue
                since = time.strftime("%Y-%m-%d %H:%M", time.localtime(owner.get("since", 0)))
                raise RunLockError(
                    f"{self.directory} is in use by another run (process {pid} on {host}, since "
                    f"{since}); wait for it, use another model directory, or delete {self.path} "
                    "if that run is gone"
                ) from None
        with os.fdopen(fd, "w") as f:
            json.dump(self.me, f)
        return self

    def release(self) -> None:
        if _owner(self.path).get("pid") == self.me["pid"]:
            self.path.unlink(missing_ok=True)
            if self.created:  # a run that stopped before writing anything leaves no directory
                with contextlib.suppress(OSError):  # not empty: rmdir removes nothing
                    self.directory.rmdir()
