"""`p2ptrain status` as text: one node's `/v1/status` document as a header and a table.

`/v1/status` needs no key, so anything that answers at the address may have written the
document: every field is checked before it is shown. A field of the wrong type shows as
"-", text is cut to a column's width and stripped of anything unprintable (a terminal
escape in a node id must not reach the user's terminal), and numbers must be finite.
"""

from __future__ import annotations

import math
from typing import Any

from p2ptrain.report import human_count

HEAD = ("node", "address", "class", "state", "step", "loss", "samples", "in", "out", "rtt")
MAX_TEXT = 64  # characters of one field shown; node ids are 64 hex digits, cut to 12 anyway
MAX_ROWS = 1000  # members listed at most (a node knows a few hundred)
MAX_NUMBER = 16  # characters of a number shown, else "?" (a step of 10^300: 1,271 characters)


def text(value: Any, limit: int = MAX_TEXT) -> str | None:
    """A string field as it may be printed, or None if it is not a string."""
    if not isinstance(value, str):
        return None
    return "".join(c if c.isprintable() else "?" for c in value[:limit])


def number(value: Any) -> float | int | None:
    """A finite number field, or None (a bool is not a number here)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return value if math.isfinite(value) else None


def _cell(value: Any, col: int) -> str:
    if col < 4:
        return text(value) or "-"
    shown = _number_cell(value, col)
    return shown if len(shown) <= MAX_NUMBER else "?"  # (no node counts that far)


def _number_cell(value: Any, col: int) -> str:
    n = number(value)
    if n is None:
        return "-"
    if col == 5:
        return f"{n:.3f}"
    if col == 9:
        return f"{n:.1f}ms"
    if col in (7, 8):
        return f"{human_count(n)}B"
    return human_count(n) if col == 6 else f"{n:g}" if isinstance(n, float) else str(n)


def _holds(value: Any) -> str | None:
    if not isinstance(value, dict):
        return None
    term, step, digest = number(value.get("term")), number(value.get("step")), text(
        value.get("digest"), 16)
    if term is None or step is None or digest is None:
        return None
    return f"holds checkpoint t{term}-s{step} ({digest})"


def _row(doc: dict, leader: str | None, mark: str, rtt: bool) -> tuple[str, ...]:
    node = (text(doc.get("node_id")) or "?")[:12]
    node += mark + (" L" if leader is not None and doc.get("node_id") == leader else "")
    addr = doc.get("addr")
    values = (node, addr, doc.get("device_class"), doc.get("state", doc.get("phase")),
              doc.get("step"), doc.get("loss"), doc.get("samples"), doc.get("bytes_in"),
              doc.get("bytes_out"), doc.get("rtt_ms") if rtt else None)
    return tuple(v if i == 0 else _cell(v, i) for i, v in enumerate(values))


def status_lines(doc: dict) -> list[str]:
    """The lines `p2ptrain status` prints for a status document, whatever it holds."""
    leader = text(doc.get("leader"))
    swarm, phase = text(doc.get("swarm")), text(doc.get("phase"))
    term, samples = number(doc.get("term")), number(doc.get("swarm_samples"))
    term = term if term is not None and len(str(term)) <= MAX_NUMBER else None
    samples = samples if samples is not None and len(f"{samples:,}") <= MAX_NUMBER else None
    lines = [f"swarm {swarm!r} | node {(text(doc.get('node_id')) or '?')[:12]} "
             f"({phase or '-'}) | leader {leader[:12] if leader else 'none'} "
             f"(term {term if term is not None else '-'}) | swarm samples "
             f"{samples if samples is not None else 0:,}"]
    runtime = doc.get("runtime")
    served = number(runtime.get("served_bytes")) if isinstance(runtime, dict) else None
    holds = _holds(doc.get("holds"))
    if holds or served:
        lines.append(f"{holds or 'holds no checkpoint'} | served {human_count(served or 0)}B "
                     f"of checkpoints")
    members = doc.get("members")
    rows = [_row({**doc, "state": phase}, leader, "*", rtt=False)]
    rows += [_row(m, leader, "", rtt=True) for m in
             (members if isinstance(members, list) else [])[:MAX_ROWS] if isinstance(m, dict)]
    table = [HEAD, *rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(HEAD))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
              for r in table]
    if isinstance(members, list) and len(members) > MAX_ROWS:
        lines.append(f"(and {len(members) - MAX_ROWS:,} members more; --json lists them all)")
    lines.append("(* this node, L the leader)")
    return lines
