"""Shared by the benchmark scripts: writes one result record as JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_record(record: dict[str, Any], out: str | Path) -> None:
    """Writes `record` to `out` (creating its directory) and says where."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {path}")
