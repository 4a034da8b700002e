"""What every benchmark does at the end: write its figures as JSON, and say where."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json(path: str | None, payload: dict[str, Any]) -> None:
    """Write ``payload`` to ``path`` (``--json FILE``; nothing when ``None``) and print where it went."""
    if not path:
        return
    Path(path).write_text(json.dumps(payload, indent=2, default=float))
    print(f"wrote {path}")
