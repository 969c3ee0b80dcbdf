"""The dashboard page for `/`: dashboard.html, a self-contained page (its own CSS, JavaScript
and SVG charts; nothing fetched from anywhere else) that polls `/v1/status` and `/v1/history`
(history.py) every two seconds. It takes no input. Prometheus's `/metrics` is metrics.py.
"""

from __future__ import annotations

from importlib import resources

PAGE = resources.files(__package__).joinpath("dashboard.html").read_text(encoding="utf-8")
