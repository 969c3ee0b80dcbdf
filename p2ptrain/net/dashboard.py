"""The dashboard page for `/`: dashboard.html, a self-contained page (its own CSS, JavaScript
and SVG charts; nothing fetched from anywhere else) that polls `/v1/status` and `/v1/history`
(history.py) every two seconds. It takes no input. Prometheus's `/metrics` is metrics.py.

Those two documents go out through `dumps`: Python's json writes NaN and Infinity, which a
browser's JSON.parse refuses -- one non-finite figure (a diverging loss) blanked the page.
"""

from __future__ import annotations

import json
import math
from importlib import resources
from typing import Any

PAGE = resources.files(__package__).joinpath("dashboard.html").read_text(encoding="utf-8")


def dumps(doc: Any) -> str:
    """Strict JSON of `doc`: a float that is not finite becomes null."""
    try:
        return json.dumps(doc, allow_nan=False)
    except ValueError:
        return json.dumps(_finite(doc), allow_nan=False)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value
