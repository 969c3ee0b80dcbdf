"""`p2ptrain bench codecs`: encode/decode throughput of every codec against this machine's
memcpy, measured in the same run, with the throughput goals recorded in docs/BENCHMARKS.md §3.

Throughput is GB/s of float32 input (4 bytes per element) through the whole message path:
`encode_vector` (input check, headers, checksums, a fresh buffer per message), consumed one
message at a time as a sender streams chunks, and `decode_message` of every message into a
preallocated destination. Big buffers are allocated once. Each repeat times memcpy
(`np.copyto` into a preallocated buffer), encode and decode back to back, so every ratio
compares runs made under the same load on a shared machine; figures are medians over repeats.

This is the only codec file that reads the clock; it does no I/O (the CLI prints what
`format_table` returns) and uses only seeded randomness.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from p2ptrain.codecs.base import Codec
from p2ptrain.codecs.registry import make_codec
from p2ptrain.codecs.wire import DEFAULT_CHUNK, decode_message, encode_vector

# (label, codec name, params, encode goal, decode goal): goals are ratios to memcpy.
BENCH_CODECS: tuple[tuple[str, str, dict[str, Any], float | None, float | None], ...] = (
    ("none", "none", {}, None, 0.3),
    ("fp16", "fp16", {}, 0.05, 0.1),
    ("bf16", "bf16", {}, 0.15, 0.3),
    ("int8", "int8", {}, 0.1, 0.3),
    ("topk", "topk", {"fraction": 0.01}, 0.15, 0.3),
    ("topk-exact", "topk", {"fraction": 0.01, "exact": True}, None, 0.3),
    ("randomk", "randomk", {"fraction": 0.01}, None, 0.3),
    ("qsgd-8bit", "qsgd", {"levels": 127}, 0.04, 0.3),
    ("qsgd-4bit", "qsgd", {"levels": 7}, 0.04, 0.3),
    ("sign", "sign", {"bucket": 1024}, None, 0.3),
)
TOPK_SPEEDUP_GOAL = 2.0  # sampled top-k encode at least this many times exact top-k's
_SENDER = bytes(16)


def _stream(codec: Codec, x: np.ndarray, chunk_elems: int, seed: int) -> Iterator[bytearray]:
    return encode_vector(
        codec,
        x,
        sender_id=_SENDER,
        swarm_samples=0,
        weight=1.0,
        seed=seed,
        chunk_elems=chunk_elems,
    )


def _drain(codec: Codec, x: np.ndarray, chunk_elems: int, seed: int) -> None:
    for _ in _stream(codec, x, chunk_elems, seed):  # a sender ships each chunk, then the next
        pass


def _seconds(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_codec_bench(
    size: int = 100_000_000,
    repeats: int = 3,
    codecs: list[str] | None = None,
    chunk_elems: int = DEFAULT_CHUNK,
    seed: int = 0,
) -> dict[str, Any]:
    """Measure each codec (labels or names in `codecs`, default all) on a `size`-element
    float32 vector; JSON-able result for `format_table` and `--json`."""
    if size < 1 or repeats < 1:
        raise ValueError("size and repeats must be positive")
    chosen = [c for c in BENCH_CODECS if codecs is None or c[0] in codecs or c[1] in codecs]
    if not chosen:
        raise ValueError(f"no codec matches {codecs}; known: {[c[0] for c in BENCH_CODECS]}")
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(size, dtype=np.float32)
    x *= np.float32(1e-2)  # gradient-like magnitudes, many below float16's normal range
    dst = np.empty_like(x)
    out = np.empty_like(x)
    np.copyto(dst, x)  # touch every page now: first-touch page faults are not memcpy
    out.fill(0.0)
    nbytes = 4.0 * size

    def copy() -> None:
        np.copyto(dst, x)

    def decode_all(messages: list[bytearray]) -> None:
        for msg in messages:
            decode_message(msg, out)

    memcpy_runs: list[float] = []
    rows = []
    for label, name, params, enc_goal, dec_goal in chosen:
        codec = make_codec(name, **params)

        def encode(codec=codec) -> None:
            _drain(codec, x, chunk_elems, seed)

        messages = list(_stream(codec, x, chunk_elems, seed))  # also warms the scratch up
        encoded = sum(len(m) for m in messages)
        runs: dict[str, list[float]] = {"encode": [], "decode": [], "memcpy": []}
        for _ in range(repeats):  # interleaved, so each ratio sees the same machine load
            runs["memcpy"].append(nbytes / _seconds(copy) / 1e9)
            runs["encode"].append(nbytes / _seconds(encode) / 1e9)
            runs["decode"].append(nbytes / _seconds(lambda m=messages: decode_all(m)) / 1e9)
        del messages
        memcpy_runs += runs["memcpy"]
        row = {
            "label": label,
            "codec": name,
            "params": codec.params(),
            "encoded_bytes": encoded,
            "compression_ratio": nbytes / encoded,
            "memcpy_gbps": statistics.median(runs["memcpy"]),
        }
        for side, goal in (("encode", enc_goal), ("decode", dec_goal)):
            ratios = [v / m for v, m in zip(runs[side], runs["memcpy"], strict=True)]
            row[f"{side}_gbps"] = statistics.median(runs[side])
            row[f"{side}_ratio"] = statistics.median(ratios)
            row[f"{side}_goal"] = goal
            row[f"{side}_pass"] = None if goal is None else row[f"{side}_ratio"] >= goal
        rows.append(row)
    mem = statistics.median(memcpy_runs)
    checks = []
    by_label = {r["label"]: r for r in rows}
    if "topk" in by_label and "topk-exact" in by_label:
        # Timed in alternation, so both see the same load (rows above are minutes apart).
        sampled = make_codec("topk", **by_label["topk"]["params"])
        exact = make_codec("topk", **by_label["topk-exact"]["params"])
        speedups = []
        for _ in range(repeats):
            t_sampled = _seconds(lambda: _drain(sampled, x, chunk_elems, seed))
            t_exact = _seconds(lambda: _drain(exact, x, chunk_elems, seed))
            speedups.append(t_exact / t_sampled)
        speedup = statistics.median(speedups)
        checks.append(
            {
                "name": "topk sampled / exact encode speed (alternating runs)",
                "value": speedup,
                "goal": TOPK_SPEEDUP_GOAL,
                "pass": speedup >= TOPK_SPEEDUP_GOAL,
            }
        )
    verdicts = [r[f"{s}_pass"] for r in rows for s in ("encode", "decode")]
    verdicts += [c["pass"] for c in checks]
    return {
        "size": size,
        "repeats": repeats,
        "chunk_elems": chunk_elems,
        "memcpy_gbps": mem,
        "memcpy_runs_gbps": memcpy_runs,
        "codecs": rows,
        "checks": checks,
        "all_pass": all(v for v in verdicts if v is not None),
    }


def _verdict(ratio: float, goal: float | None) -> str:
    if goal is None:
        return f"{ratio:.3f}"
    return f"{ratio:.3f} {'✓' if ratio >= goal else '✗'} (≥ {goal:g})"


def format_table(result: dict[str, Any]) -> str:
    """The result as a Markdown table (ratios to memcpy, ✓/✗ against the goals)."""
    lines = [
        f"Codec throughput, {result['size']:,} float32 elements, chunks of "
        f"{result['chunk_elems']:,}, median of {result['repeats']} runs; memcpy "
        f"{result['memcpy_gbps']:.2f} GB/s (median of all runs; each ratio uses the memcpy "
        "runs made next to it).",
        "",
        "| codec | params | compression | encode GB/s | encode / memcpy (goal) "
        "| decode GB/s | decode / memcpy (goal) | memcpy GB/s |",
        "|---|---|---:|---:|---|---:|---|---:|",
    ]
    for r in result["codecs"]:
        params = ", ".join(f"{k}={v}" for k, v in r["params"].items()) or "-"
        lines.append(
            f"| {r['label']} | {params} | {r['compression_ratio']:.1f}x "
            f"| {r['encode_gbps']:.2f} | {_verdict(r['encode_ratio'], r['encode_goal'])} "
            f"| {r['decode_gbps']:.2f} | {_verdict(r['decode_ratio'], r['decode_goal'])} "
            f"| {r['memcpy_gbps']:.2f} |"
        )
    for c in result["checks"]:
        mark = "✓" if c["pass"] else "✗"
        lines.append("")
        lines.append(f"{c['name']}: {c['value']:.2f}x {mark} (goal ≥ {c['goal']:g}x)")
    lines.append("")
    lines.append("All goals met." if result["all_pass"] else "Some goals missed (✗).")
    return "\n".join(lines)
