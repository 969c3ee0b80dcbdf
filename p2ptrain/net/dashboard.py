"""The dashboard page for `/`: dashboard.html, a self-contained page (its own CSS, JavaScript
and SVG charts; nothing fetched from anywhere else) that polls `/v1/status` and `/v1/history`
(history.py) every two seconds. It takes no input. Prometheus's `/metrics` is metrics.py.

Those two documents go out through `dumps`: Python's json writes NaN and Infinity, which a
browser's JSON.parse refuses -- one non-finite figure (a diverging loss) blanked the page.
"""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Callable
from importlib import resources
from typing import Any

PAGE = resources.files(__package__).joinpath("dashboard.html").read_text(encoding="utf-8")


def dumps(doc: Any) -> str:
    """Strict JSON of `doc`: a float that is not finite becomes null."""
    try:
        return json.dumps(doc, allow_nan=False)
    except ValueError:
        return json.dumps(_finite(doc), allow_nan=False)


class Built:
    """A document's answer built at most once per `fresh` seconds, in JSON and gzipped: a
    full `/v1/history` is ~200 kB of JSON, 6.8 ms to build and compress on the node's loop,
    and an address may ask 50 times a second (a third of the loop; the page asks every 2 s)."""

    def __init__(self, build: Callable[[], Any], fresh: float = 1.0):
        self.build, self.fresh = build, fresh
        self.at, self.plain, self.packed = -math.inf, b"", b""

    def get(self, now: float) -> tuple[bytes, bytes]:
        """(JSON, gzipped JSON) of the document as built at most `fresh` seconds ago."""
        if now - self.at >= self.fresh:
            self.plain = dumps(self.build()).encode()
            self.packed = gzip.compress(self.plain, 6)
            self.at = now
        return self.plain, self.packed


def accepts_gzip(header: str) -> bool:
    """Whether an Accept-Encoding header takes gzip (named, or *, without q=0)."""
    for item in header.split(","):
        name, _, params = item.strip().partition(";")
        if name.strip().lower() in ("gzip", "*"):
            q = params.strip().lower().removeprefix("q=")
            try:
                return not params.strip() or float(q) > 0
            except ValueError:
                return False
    return False


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value
