"""What the bench scripts share (bench/ is not a package: scripts import it as a sibling,
`from common import write_json`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json(path: Path, obj: Any) -> None:
    """Write `obj` as JSON to `path` through a temporary file, so a run cut short by its
    stage's time limit leaves the previous file or the whole new one, never half of it.
    Values JSON cannot hold are written as their str()."""
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    tmp.replace(path)
