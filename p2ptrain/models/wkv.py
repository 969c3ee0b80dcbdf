"""The RWKV-4 WKV recurrence, computed in chunks with batched matmuls, and its backward pass.

For every channel c (decay w < 0, bonus u) and every position t of a sequence:

    wkv_t = (sum_{i<t} e^{(t-1-i) w + k_i} v_i + e^{u + k_t} v_t)
          / (sum_{i<t} e^{(t-1-i) w + k_i}     + e^{u + k_t})

Sequences are cut into chunks of L steps. Inside a chunk both sums are one matmul per
channel with a fixed (L+1, L) decay matrix; its extra row gives the chunk's contribution to
the running state, which a short loop carries from chunk to chunk. No loop runs over time
steps, forward or backward.

Layout ("chunk-major"): arrays are (C, L, M) where M enumerates (sequence b, chunk n) pairs,
n fastest, so position t = n*L + j of sequence b sits at [:, j, b*n_chunks + n]. The
per-channel matmuls then read arrays in place and every broadcast runs over the long M axis.

Stability: keys are shifted by their per-(channel, sequence, chunk) maximum K, and the
running state is stored as (a, 1) * e^p with p its log-magnitude; its weight in row j of a
chunk, e^{p + j w - K}, is clipped to [e^-70, e^40], where one side is negligible next to
the other. Shifts are constants for differentiation (the result does not depend on them).
Exponents are bounded below so that np.exp never underflows (3x slower) and no product in
the matmuls is denormal (KEY_CLAMP - DECAY_FLOOR < 87, float32's normal range): decay entries
under e^DECAY_FLOOR are exact zeros (their terms are below float32 precision) and a key more
than KEY_CLAMP below its chunk's maximum counts as exactly KEY_CLAMP below. Results are thus
exact to float32 precision while the keys within one chunk span less than KEY_CLAMP nats
(between chunks any span is fine); past that they stay finite and within the range of v,
with the smallest keys of the chunk overweighted.
This file owns only the kernel: no parameters, no I/O, no state between calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

KEY_CLAMP = 36.0  # a key this far below its chunk's maximum counts as exactly that far below
DECAY_FLOOR = -50.0  # decay-matrix entries smaller than e^DECAY_FLOOR are exact zeros
STATE_CLIP = 40.0  # state weights above e^40 (the chunk is negligible) are clipped there
STATE_CLIP_LOW = 70.0  # state weights below e^-70 (the state is negligible) are clipped there


class Scratch:
    """Named arrays of one dtype, reused from one call to the next.

    A fresh multi-megabyte numpy array costs page faults (and huge-page zeroing) on every
    call: a third of a training step in our measurements. `empty` hands back the same array
    for the same key and shape; its contents are garbage until written."""

    def __init__(self, dtype) -> None:
        self.dtype = np.dtype(dtype)
        self._arrays: dict[str, np.ndarray] = {}

    def empty(self, key: str, shape: tuple[int, ...]) -> np.ndarray:
        a = self._arrays.get(key)
        if a is None or a.shape != tuple(shape):
            a = self._arrays[key] = np.empty(shape, self.dtype)
        return a


def to_chunks(a: np.ndarray, chunk: int) -> np.ndarray:
    """(C, B, T) -> chunk-major (C, L, B*n), T = n*L."""
    C, B, T = a.shape
    return np.ascontiguousarray(a.reshape(C, B, T // chunk, chunk).transpose(0, 3, 1, 2)).reshape(
        C, chunk, -1
    )


def from_chunks(a: np.ndarray, batch: int) -> np.ndarray:
    """Chunk-major (C, L, B*n) -> (C, B, T)."""
    C, L, M = a.shape
    return a.reshape(C, L, batch, M // batch).transpose(0, 2, 3, 1).reshape(C, batch, -1)


def step_counts(chunk: int, dtype) -> np.ndarray:
    """(L+1, L): decay steps j-1-m from step m to row j of a chunk (0 where unused)."""
    j = np.arange(chunk + 1)[:, None]
    m = np.arange(chunk)[None, :]
    return np.where(m < j, j - 1 - m, 0).astype(dtype)


def decay_matrices(w: np.ndarray, u: np.ndarray, chunk: int) -> np.ndarray:
    """D[c, j, m]: weight of step m's e^{k_m} (and e^{k_m} v_m) in row j of a chunk:
    e^{(j-1-m) w} for m < j, e^u for m == j < L, 0 for m > j; row L is the state after it."""
    L = chunk
    expo = w[:, None, None] * step_counts(L, w.dtype)  # (C, L+1, L), <= 0
    above = np.arange(L + 1)[:, None] <= np.arange(L)[None, :]  # m >= j
    D = np.exp(np.maximum(expo, DECAY_FLOOR))
    D[(expo < DECAY_FLOOR) | above] = 0.0
    diag = np.arange(L)
    D[:, diag, diag] = np.exp(u)[:, None]
    return D


@dataclass(slots=True)
class WKVCache:
    """What wkv_forward keeps for wkv_backward."""

    w: np.ndarray  # (C,) decay per step, negative
    D: np.ndarray  # (C, L+1, L) decay matrices
    X: np.ndarray  # (C, L, 2, M) e^{k-K} * v and e^{k-K}
    s: np.ndarray  # (C, L, M) weight of the incoming state in row j, e^{p + j w - K}
    sa: np.ndarray  # (C, M) incoming state numerator of each chunk (scale e^p)
    sb: np.ndarray  # (C, M) incoming state denominator (1, or 0 before the first chunk)
    g: np.ndarray  # (C, B, n) weight of the old state in the next one
    h: np.ndarray  # (C, B, n) weight of the chunk's own sums in the next state
    den: np.ndarray  # (C, L, M) denominators
    wkv: np.ndarray  # (C, L, M) outputs


def wkv_forward(
    w: np.ndarray,
    u: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    n_chunks: int,
    ws: Scratch | None = None,
    tag: str = "",
) -> tuple[np.ndarray, WKVCache]:
    """wkv (C, L, M) for chunk-major keys and values k, v (C, L, M); w, u are (C,).

    `n_chunks` chunks per sequence; arrays kept for backward are ws arrays named tag+..."""
    ws = ws or Scratch(k.dtype)
    C, L, M = k.shape
    n = n_chunks
    B = M // n
    dt = k.dtype
    K = k.max(axis=1)  # (C, M) shift per chunk

    X = ws.empty(tag + "X", (C, L, 2, M))
    ek = X[:, :, 1]  # (C, L, M)
    np.subtract(k, K[:, None, :], out=ek)
    np.clip(ek, dt.type(-KEY_CLAMP), dt.type(0.0), out=ek)
    np.exp(ek, out=ek)
    np.multiply(ek, v, out=X[:, :, 0])

    D = decay_matrices(w, u, L)
    Y = ws.empty("wkv.Y", (C, L + 1, 2 * M))
    np.matmul(D, X.reshape(C, L, 2 * M), out=Y)
    Y = Y.reshape(C, L + 1, 2, M)
    chunk_sums = Y[:, L].reshape(C, 2, B, n)  # each chunk's part of the next state

    # carry the state (a, b) = (sum e^k v, sum e^k) * e^{-p} from chunk to chunk, renormalised
    # so that b = 1: then p is the state's true log-magnitude (the exponents below rely on it)
    sa, sb, ps, g, h = (ws.empty(tag + name, (C, B, n)) for name in ("sa", "sb", "p", "g", "h"))
    a = np.zeros((C, B), dt)
    b = np.zeros((C, B), dt)
    p = np.full((C, B), -1e30, dt)
    Lw = (L * w)[:, None]  # (C, 1)
    K3 = K.reshape(C, B, n)
    g[..., n - 1] = 0.0
    h[..., n - 1] = 0.0
    floor = dt.type(np.exp(-2 * STATE_CLIP))
    for c in range(n):
        sa[..., c], sb[..., c], ps[..., c] = a, b, p
        if c == n - 1:
            break
        decayed = p + Lw
        p = np.maximum(decayed, K3[..., c])
        gc = np.exp(np.maximum(decayed - p, -2 * STATE_CLIP))
        hc = np.exp(np.maximum(K3[..., c] - p, -2 * STATE_CLIP))
        norm = np.maximum(gc * b + hc * chunk_sums[:, 1, :, c], floor)  # new b before scaling
        g[..., c] = gc / norm
        h[..., c] = hc / norm
        p += np.log(norm)
        a = g[..., c] * a + h[..., c] * chunk_sums[:, 0, :, c]
        b = g[..., c] * b + h[..., c] * chunk_sums[:, 1, :, c]

    # row j of a chunk: wkv = (s_j sa + Ya_j) / (s_j sb + Yb_j),  s_j = e^{p + j w - K}
    s = ws.empty(tag + "s", (C, L, M))
    jw = np.arange(L, dtype=dt) * w[:, None]  # (C, L)
    np.add((ps.reshape(C, M) - K)[:, None, :], jw[:, :, None], out=s)
    np.clip(s, dt.type(-STATE_CLIP_LOW), dt.type(STATE_CLIP), out=s)
    np.exp(s, out=s)
    sa, sb = sa.reshape(C, 1, M), sb.reshape(C, 1, M)
    den = np.multiply(s, sb, out=ws.empty(tag + "den", (C, L, M)))
    den += Y[:, :L, 1]
    wkv = np.multiply(s, sa, out=ws.empty(tag + "wkv", (C, L, M)))
    wkv += Y[:, :L, 0]
    wkv /= den
    return wkv, WKVCache(w, D, X, s, sa[:, 0], sb[:, 0], g, h, den, wkv)


def wkv_backward(
    dwkv: np.ndarray, cache: WKVCache, ws: Scratch | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Gradients (dk, dv, dw, du) of wkv_forward for an upstream gradient dwkv (C, L, M).
    dk and dv are scratch arrays, valid until the next call with the same ws."""
    c_ = cache
    ws = ws or Scratch(c_.den.dtype)
    C, L, M = c_.den.shape
    _, B, n = c_.g.shape
    dt = c_.den.dtype

    # wkv = num / den: d num = dwkv / den, d den = -dwkv * wkv / den
    dY = ws.empty("wkv.dY", (C, L + 1, 2, M))
    ga = dY[:, :L, 0]  # (C, L, M)
    gb = dY[:, :L, 1]
    np.divide(dwkv, c_.den, out=ga)
    np.multiply(ga, c_.wkv, out=gb)
    np.negative(gb, out=gb)

    # num = s_j sa + Ya_j: gradients of the incoming states, and of w through s_j = e^{.. + j w}
    sg = np.multiply(c_.s, ga, out=ws.empty("wkv.sg", (C, L, M)))
    la = sg.sum(axis=1)  # (C, M)
    ds = np.matmul(sg, c_.sa[:, :, None])[..., 0]  # (C, L) d loss / d log s, summed over M
    np.multiply(c_.s, gb, out=sg)
    lb = sg.sum(axis=1)
    ds += np.matmul(sg, c_.sb[:, :, None])[..., 0]
    dw = ds @ np.arange(L, dtype=dt)  # (C,)

    # the state, backward across chunks; dA, dB: gradient of the state leaving chunk c
    la, lb = la.reshape(C, B, n), lb.reshape(C, B, n)
    sa, sb = c_.sa.reshape(C, B, n), c_.sb.reshape(C, B, n)
    dstate = dY[:, L].reshape(C, 2, B, n)
    dA = np.zeros((C, B), dt)
    dB = np.zeros((C, B), dt)
    dlog_g = np.zeros((C, B), dt)
    for c in range(n - 1, -1, -1):
        gc = c_.g[..., c]
        dstate[:, 0, :, c] = c_.h[..., c] * dA
        dstate[:, 1, :, c] = c_.h[..., c] * dB
        dlog_g += (dA * sa[..., c] + dB * sb[..., c]) * gc
        dA = la[..., c] + gc * dA
        dB = lb[..., c] + gc * dB
    dw += L * dlog_g.sum(axis=1)  # g = e^{p + L w - p'} / norm, the shift and norm constant

    # Y = D @ X
    dY2 = dY.reshape(C, L + 1, 2 * M)
    dX = ws.empty("wkv.dX", (C, L, 2 * M))
    np.matmul(c_.D.transpose(0, 2, 1), dY2, out=dX)
    dD = np.matmul(dY2, c_.X.reshape(C, L, 2 * M).transpose(0, 2, 1))  # (C, L+1, L)
    dD *= c_.D  # d loss / d(exponent of each entry)
    dw += np.einsum("cjm,jm->c", dD, step_counts(L, dt))
    diag = np.arange(L)
    du = dD[:, diag, diag].sum(axis=1)

    # X = (e^{k-K} v, e^{k-K}):  dv = dXa e^{k-K},  dk = (dXa v + dXb) e^{k-K}
    dX = dX.reshape(C, L, 2, M)
    ek = c_.X[:, :, 1]
    dv = np.multiply(dX[:, :, 0], ek, out=ws.empty("wkv.dv", (C, L, M)))
    dk = np.multiply(dX[:, :, 0], c_.X[:, :, 0], out=ws.empty("wkv.dk", (C, L, M)))
    dX[:, :, 1] *= ek
    dk += dX[:, :, 1]
    return dk, dv, dw, du
