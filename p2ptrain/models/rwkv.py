"""`rwkv`: a character-level RWKV-4-style language model with a hand-written backward pass.

    x = LN0(emb[tokens])
    per block:  x += TimeMix(LN1(x));  x += ChannelMix(LN2(x))
    logits = LN_out(x) @ head

TimeMix mixes each position with the one before (learned per-channel weights for k, v, r),
runs the WKV recurrence (wkv.py) with per-channel decay w = -exp(time_decay) and bonus
u = time_first, gates it with sigmoid(r) and projects it out. ChannelMix is
sigmoid(xr @ receptance) * (square(relu(xk @ key)) @ value). Matrices are stored (in, out).

Positions are kept in chunk-major order: a (B, T) batch becomes N = B*n*L rows ordered
(j, b, n) for position t = n*L + j (L = WKV chunk; T is padded up to n whole chunks and the
padding is left out of the loss; it cannot affect real positions), so the WKV reads the
channel-major projections (C, N) = (C, L, B*n) in place. Row-wise ops ignore the order; token
shift and the token/target lookups are the only ones that do. Every op's backward sits next
to its forward; computation happens in the dtype of the buffers given.

This file owns the architecture, its initialisation and its gradient. The only thing a model
object keeps between calls is scratch memory (see wkv.Scratch) for the last two batch shapes;
results never depend on it. It never reads a clock, draws global random numbers, or does I/O.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass, field

import numpy as np

from p2ptrain.models.base import Model
from p2ptrain.models.wkv import Scratch, wkv_backward, wkv_forward
from p2ptrain.params import ParamSpace

LN_EPS = 1e-5  # added to the variance in every LayerNorm


MAX_LAYERS = 4096  # blocks a model may have (the seed's 1B shape has 24)


@dataclass(frozen=True)
class RWKVConfig:
    vocab_size: int = 256  # token ids (bytes)
    n_layer: int = field(default=4, metadata={"help": "rwkv model: blocks"})  # L blocks
    n_embd: int = field(default=128, metadata={"help": "rwkv model: channels"})  # C
    ctx_len: int = field(default=64, metadata={"help": "rwkv model: positions per sample"})  # T
    ffn_mult: int = field(default=4, metadata={"help": "rwkv model: channel-mix width / C"})
    wkv_chunk: int = field(default=16, metadata={"help": "rwkv model: WKV chunk length"})


# ---------------------------------------------------------------- building blocks


def layer_norm(x, weight, bias, xhat, y):
    """y = (x - mean) / std * weight + bias over rows of x (N, C); xhat, y are outputs."""
    avg = np.full(x.shape[1], 1.0 / x.shape[1], x.dtype)  # row means as gemv: fast
    np.subtract(x, (x @ avg)[:, None], out=xhat)
    np.square(xhat, out=y)
    rstd = y @ avg  # (N,)
    rstd += LN_EPS
    np.sqrt(rstd, out=rstd)
    np.reciprocal(rstd, out=rstd)
    xhat *= rstd[:, None]
    np.multiply(xhat, weight, out=y)
    y += bias
    return y, (xhat, rstd)


def layer_norm_backward(dy, cache, weight, dweight, dbias, dx, tmp, accumulate=True):
    """dx (+)= d loss / d x of layer_norm; writes d weight, d bias. Destroys dy and tmp."""
    xhat, rstd = cache
    np.matmul(np.ones(dy.shape[0], dy.dtype), dy, out=dbias)
    np.einsum("nc,nc->c", dy, xhat, out=dweight)
    avg = np.full(dy.shape[1], 1.0 / dy.shape[1], dy.dtype)
    dy *= weight  # d xhat
    mean_dxhat = dy @ avg  # (N,)
    mean_dxhat_xhat = np.einsum("nc,nc->n", dy, xhat)
    mean_dxhat_xhat *= 1.0 / dy.shape[1]
    dy -= mean_dxhat[:, None]
    np.multiply(xhat, mean_dxhat_xhat[:, None], out=tmp)
    dy -= tmp
    dy *= rstd[:, None]
    if accumulate:
        dx += dy
    else:
        dx[...] = dy


def token_diff(h, lay, out):
    """out = h - shift(h): each position minus the one before it (zero before t = 0).
    lay = (L, B, n) is the chunk-major row order: position t = n*L + j."""
    L, B, n = lay
    h4, d4 = h.reshape(L, B, n, -1), out.reshape(L, B, n, -1)
    np.subtract(h4[1:], h4[:-1], out=d4[1:])
    np.subtract(h4[0, :, 1:], h4[L - 1, :, :-1], out=d4[0, :, 1:])
    d4[0, :, 0] = h4[0, :, 0]
    return out


def token_mix(h, d, mix, out):
    """mix * h + (1 - mix) * shift(h), computed as h + (mix - 1) * d."""
    np.multiply(d, mix - 1.0, out=out)
    out += h
    return out


def token_mix_backward(dmixed, mixes, d, dmixes, lay, dh, gd):
    """dh = d loss / d h for the token_mix outputs of one h; writes d mix into dmixes."""
    L, B, n = lay
    for i, (dm, mix, dmix) in enumerate(zip(dmixed, mixes, dmixes, strict=True)):
        np.einsum("nc,nc->c", dm, d, out=dmix)
        if i == 0:
            dh[...] = dm
            np.multiply(dm, mix - 1.0, out=gd)  # d loss / d d
        else:
            dh += dm
            dm *= mix - 1.0
            gd += dm
    # d = h - shift(h)
    dh += gd
    dh4, gd4 = dh.reshape(L, B, n, -1), gd.reshape(L, B, n, -1)
    dh4[:-1] -= gd4[1:]
    dh4[L - 1, :, :-1] -= gd4[0, :, 1:]
    return dh


def sigmoid(x, out):
    np.negative(x, out=out)
    with np.errstate(over="ignore"):  # exp(+large) = inf gives exactly 0
        np.exp(out, out=out)
    out += 1.0
    np.reciprocal(out, out=out)
    return out


def sigmoid_backward(dy, sig):
    """dx = dy * sig * (1 - sig), computed in place of dy."""
    dy *= sig
    dy -= dy * sig
    return dy


def cross_entropy(logits, targets):
    """Mean cross-entropy of (N, V) logits; turns `logits` into d loss / d logits in place."""
    N = logits.shape[0]
    rows = np.arange(N)
    logits -= logits.max(axis=1, keepdims=True)
    picked = logits[rows, targets]  # (N,) shifted logit of the target
    np.exp(logits, out=logits)
    sums = logits @ np.ones(logits.shape[1], logits.dtype)  # (N,)
    loss = float(np.mean(np.log(sums) - picked))
    logits *= (1.0 / (sums * N))[:, None]  # softmax / N
    logits[rows, targets] -= 1.0 / N
    return loss


def _orthogonal(rng: np.random.Generator, rows: int, cols: int, gain: float) -> np.ndarray:
    """A (rows, cols) matrix with orthonormal rows or columns, times gain."""
    a = rng.standard_normal((max(rows, cols), min(rows, cols)))
    q, r = np.linalg.qr(a)
    q *= np.sign(np.diag(r))
    return gain * (q if rows >= cols else q.T)


# ---------------------------------------------------------------- the model


class RWKV(Model):
    """The built-in `rwkv` model: RWKV(RWKVConfig(...)); parameters live in flat buffers."""

    name = "rwkv"

    def __init__(self, config: RWKVConfig):
        c = config
        if min(c.vocab_size, c.n_layer, c.n_embd, c.ctx_len, c.ffn_mult, c.wkv_chunk) < 1:
            raise ValueError(f"every rwkv size must be >= 1: {config}")
        if c.n_layer > MAX_LAYERS:  # (a file's arch: building a million blocks takes minutes
            raise ValueError(f"rwkv n_layer {c.n_layer} is above {MAX_LAYERS}")  # and GBs)
        self.config = config
        self.vocab_size = c.vocab_size
        self.ctx_len = c.ctx_len
        C, F, V = c.n_embd, c.ffn_mult * c.n_embd, c.vocab_size
        shapes = [("emb", (V, C)), ("ln0.weight", (C,)), ("ln0.bias", (C,))]
        for i in range(c.n_layer):
            b = f"blocks.{i}."
            shapes += [(b + "ln1.weight", (C,)), (b + "ln1.bias", (C,))]
            shapes += [(b + "ln2.weight", (C,)), (b + "ln2.bias", (C,))]
            for name in ("time_decay", "time_first", "time_mix_k", "time_mix_v", "time_mix_r"):
                shapes.append((b + "att." + name, (C,)))
            for name in ("key", "value", "receptance", "output"):
                shapes.append((b + "att." + name, (C, C)))
            shapes += [(b + "ffn.time_mix_k", (C,)), (b + "ffn.time_mix_r", (C,))]
            shapes += [(b + "ffn.key", (C, F)), (b + "ffn.receptance", (C, C))]
            shapes += [(b + "ffn.value", (F, C))]
        shapes += [("ln_out.weight", (C,)), ("ln_out.bias", (C,)), ("head", (C, V))]
        self.space = ParamSpace(shapes)
        self._padding = self._paddings(self.space)
        self._scratch: OrderedDict[tuple, Scratch] = OrderedDict()
        self._lock = threading.Lock()  # one call at a time uses the scratch memory

    @staticmethod
    def _paddings(space: ParamSpace) -> list[tuple[int, int]]:
        """[start, end) of the gaps between tensors (their gradient is kept zero)."""
        ends = [s.offset + s.size for s in space]
        starts = [s.offset for s in space][1:] + [space.size]
        return [(e, s) for e, s in zip(ends, starts, strict=True) if s > e]

    def arch(self) -> dict:
        return {"model": self.name, **asdict(self.config)}

    def init_params(self, flat: np.ndarray, rng: np.random.Generator) -> None:
        """RWKV-4 practice: tiny embeddings (LN0 rescales them); decay spread from fast to slow
        across channels, slower in deeper blocks; zigzag bonus; token-shift mixes leaning on
        the previous token in early blocks; zero key/receptance/output projections (each
        block starts as the identity); orthogonal value and ffn-key matrices; a small head."""
        c = self.config
        C, F, V, L = c.n_embd, c.ffn_mult * c.n_embd, c.vocab_size, c.n_layer
        flat.fill(0.0)
        p = self.space.views(flat)
        p["emb"][...] = rng.uniform(-1e-4, 1e-4, (V, C))
        p["ln0.weight"][...] = 1.0
        p["ln_out.weight"][...] = 1.0
        ch = np.arange(C)
        frac = ch / C
        for i in range(L):
            b = f"blocks.{i}."
            depth = i / (L - 1) if L > 1 else 0.0  # 0 at the first block, 1 at the last
            keep = 1.0 - i / L  # 1 at the first block, 1/L at the last
            p[b + "ln1.weight"][...] = 1.0
            p[b + "ln2.weight"][...] = 1.0
            p[b + "att.time_decay"][...] = -5 + 8 * (ch / max(C - 1, 1)) ** (0.7 + 1.3 * depth)
            p[b + "att.time_first"][...] = math.log(0.3) + ((ch + 1) % 3 - 1) * 0.5
            p[b + "att.time_mix_k"][...] = frac**keep
            p[b + "att.time_mix_v"][...] = frac**keep + 0.3 * depth
            p[b + "att.time_mix_r"][...] = frac ** (0.5 * keep)
            p[b + "ffn.time_mix_k"][...] = frac**keep
            p[b + "ffn.time_mix_r"][...] = frac**keep
            p[b + "att.value"][...] = _orthogonal(rng, C, C, 1.0)
            p[b + "ffn.key"][...] = _orthogonal(rng, C, F, math.sqrt(max(F / C, 1.0)))
        p["head"][...] = _orthogonal(rng, C, V, 0.5 * math.sqrt(max(V / C, 1.0)))

    # ------------------------------------------------------------ layout and scratch

    def _layout(self, T: int) -> tuple[int, int]:
        """(L, n): chunk length and chunks per sequence; positions past T are padding."""
        L = min(self.config.wkv_chunk, T)
        return L, -(-T // L)

    @staticmethod
    def _to_rows(a: np.ndarray, L: int, n: int) -> np.ndarray:
        """(B, T) ids -> (N,) in chunk-major row order, zero-padded to n*L positions."""
        B, T = a.shape
        padded = np.zeros((B, n * L), np.intp)
        padded[:, :T] = a
        return padded.reshape(B, n, L).transpose(2, 0, 1).reshape(-1)

    def _workspace(self, B: int, T: int, dtype) -> Scratch:
        """Scratch memory for this batch shape (the two most recent shapes are kept)."""
        key = (B, T, np.dtype(dtype).str)
        ws = self._scratch.pop(key, None) or Scratch(dtype)
        self._scratch[key] = ws
        while len(self._scratch) > 2:
            self._scratch.popitem(last=False)
        return ws

    # ------------------------------------------------------------ weights (LoRA overrides these)

    def _params(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        """Every tensor the forward pass reads, by name."""
        return self.space.views(flat)

    def _grads(self, grad: np.ndarray) -> dict[str, np.ndarray]:
        """Where the backward pass writes each tensor's gradient, by name."""
        return self.space.views(grad)

    def _embed(self, p, ids, out):
        """out = the embedding rows of ids (N, C)."""
        return np.take(p["emb"], ids, axis=0, out=out)

    def _embed_back(self, g, ids, rows):
        """The embedding's gradient: `rows` (one per distinct id in ids), zero elsewhere."""
        g["emb"].fill(0.0)
        g["emb"][ids] = rows

    def _linear(self, p, name, x, out, ws, cm=False):
        """out = x @ W (N, out) for the matrix `name`, W stored (in, out); with cm the
        result is written channel-major, out = (x @ W).T of shape (out, N)."""
        w = p[name]
        return np.matmul(w.T, x.T, out=out) if cm else np.matmul(x, w, out=out)

    def _linear_back(self, p, g, name, x, dy, out, ws, cm=False):
        """Backward of y = x @ W: W's gradient x.T @ dy into g, and d loss / d x = dy @ W.T
        into out (cm: channel-major, (in, N))."""
        np.matmul(x.T, dy, out=g[name])
        w = p[name]
        return np.matmul(w, dy.T, out=out) if cm else np.matmul(dy, w.T, out=out)

    # ------------------------------------------------------------ forward

    def _forward(self, p, inputs, ws, keep=True):
        """Final hidden states h (N, C) in chunk-major row order, and what backward needs.
        keep=False (no backward to follow): all blocks share one set of scratch arrays."""
        B, T = inputs.shape
        L, n = self._layout(T)
        lay, N, C = (L, B, n), L * B * n, self.config.n_embd
        ids = self._to_rows(inputs, L, n)
        x = self._embed(p, ids, ws.empty("x", (N, C)))  # (N, C) residual stream
        # LN0 of the rows looked up, in place (not of the whole (V, C) table: a big vocabulary
        # would cost two table-sized temporaries per step)
        _, ln0 = layer_norm(x, p["ln0.weight"], p["ln0.bias"], ws.empty("ln0.xhat", (N, C)), x)
        blocks = []
        for i in range(self.config.n_layer):
            tag = f"{i}." if keep else "0."  # keep=False: block 0's arrays serve every block
            att = self._time_mix_forward(p, i, x, lay, ws, tag + "att.")
            ffn = self._channel_mix_forward(p, i, x, lay, ws, tag + "ffn.")
            blocks.append((att, ffn))
        lno_w, lno_b = p["ln_out.weight"], p["ln_out.bias"]
        h, lno = layer_norm(x, lno_w, lno_b, ws.empty("out.xhat", (N, C)), ws.empty("h", (N, C)))
        return h, (ids, ln0, blocks, lno)

    def _time_mix_forward(self, p, i, x, lay, ws, t):
        a = f"blocks.{i}.att."  # parameter names; t prefixes this block's scratch arrays
        N, C = x.shape
        L, B, n = lay
        ln_w, ln_b = p[f"blocks.{i}.ln1.weight"], p[f"blocks.{i}.ln1.bias"]
        h, ln = layer_norm(x, ln_w, ln_b, ws.empty(t + "xhat", (N, C)), ws.empty("h", (N, C)))
        d = token_diff(h, lay, ws.empty(t + "d", (N, C)))  # (N, C)
        xk = token_mix(h, d, p[a + "time_mix_k"], ws.empty(t + "xk", (N, C)))
        xv = token_mix(h, d, p[a + "time_mix_v"], ws.empty(t + "xv", (N, C)))
        xr = token_mix(h, d, p[a + "time_mix_r"], ws.empty(t + "xr", (N, C)))
        # channel-major projections (C, N) = (C, L, B*n): the WKV's layout
        k = self._linear(p, a + "key", xk, ws.empty("k", (C, N)), ws, cm=True)
        v = self._linear(p, a + "value", xv, ws.empty("v", (C, N)), ws, cm=True)
        sr = self._linear(p, a + "receptance", xr, ws.empty(t + "sr", (C, N)), ws, cm=True)
        sigmoid(sr, out=sr)
        w = -np.exp(p[a + "time_decay"])  # (C,)
        M = B * n
        wkv, wkv_cache = wkv_forward(
            w, p[a + "time_first"], k.reshape(C, L, M), v.reshape(C, L, M), n, ws, t
        )
        wkv = wkv.reshape(C, N)
        rwkv = np.multiply(sr, wkv, out=ws.empty(t + "rwkv", (C, N)))  # (C, N)
        x += self._linear(p, a + "output", rwkv.T, ws.empty("out", (N, C)), ws)
        return ln, d, xk, xv, xr, sr, w, wkv, wkv_cache, rwkv

    def _channel_mix_forward(self, p, i, x, lay, ws, t):
        f = f"blocks.{i}.ffn."
        N, C = x.shape
        F = self.config.ffn_mult * C
        ln_w, ln_b = p[f"blocks.{i}.ln2.weight"], p[f"blocks.{i}.ln2.bias"]
        h, ln = layer_norm(x, ln_w, ln_b, ws.empty(t + "xhat", (N, C)), ws.empty("h", (N, C)))
        d = token_diff(h, lay, ws.empty(t + "d", (N, C)))
        xk = token_mix(h, d, p[f + "time_mix_k"], ws.empty(t + "xk", (N, C)))
        xr = token_mix(h, d, p[f + "time_mix_r"], ws.empty(t + "xr", (N, C)))
        kr = self._linear(p, f + "key", xk, ws.empty(t + "kr", (N, F)), ws)  # (N, F)
        zero, inf = kr.dtype.type(0.0), kr.dtype.type(np.inf)
        np.clip(kr, zero, inf, out=kr)  # relu (np.clip beats np.maximum 3x here)
        k = np.square(kr, out=ws.empty(t + "k", (N, F)))
        kv = self._linear(p, f + "value", k, ws.empty(t + "kv", (N, C)), ws)  # (N, C)
        sr = self._linear(p, f + "receptance", xr, ws.empty(t + "sr", (N, C)), ws)
        sigmoid(sr, out=sr)
        x += np.multiply(sr, kv, out=ws.empty("out", (N, C)))
        return ln, d, xk, xr, kr, k, kv, sr

    # ------------------------------------------------------------ backward

    def _time_mix_backward(self, p, g, i, dx, cache, lay, ws):
        """Adds this time-mix's d loss / d x to dx (N, C); writes its parameter grads."""
        a, b = f"blocks.{i}.att.", f"blocks.{i}."
        N, C = dx.shape
        L, B, n = lay
        ln, d, xk, xv, xr, sr, w, wkv, wkv_cache, rwkv = cache
        drwkv = self._linear_back(p, g, a + "output", rwkv.T, dx, ws.empty("dCN", (C, N)), ws,
                                  cm=True)  # (C, N)
        dwkv = np.multiply(drwkv, sr, out=ws.empty("dwkv", (C, N)))
        drwkv *= wkv
        dr = sigmoid_backward(drwkv, sr)  # (C, N)
        dk, dv, dw, du = wkv_backward(dwkv.reshape(C, L, B * n), wkv_cache, ws)
        g[a + "time_decay"][...] = dw * w  # w = -exp(time_decay)
        g[a + "time_first"][...] = du
        dmixed = []
        for j, (name, xm, dm) in enumerate(
            (("key", xk, dk), ("value", xv, dv), ("receptance", xr, dr))
        ):
            dm = dm.reshape(C, N)
            dmixed.append(self._linear_back(p, g, a + name, xm, dm.T,
                                            ws.empty(f"dmix{j}", (N, C)), ws))
        mixes = ("time_mix_k", "time_mix_v", "time_mix_r")
        dh = token_mix_backward(
            dmixed, [p[a + m] for m in mixes], d, [g[a + m] for m in mixes], lay,
            ws.empty("dh", (N, C)), ws.empty("gd", (N, C)),
        )
        layer_norm_backward(
            dh, ln, p[b + "ln1.weight"], g[b + "ln1.weight"], g[b + "ln1.bias"], dx, dmixed[0]
        )

    def _channel_mix_backward(self, p, g, i, dx, cache, lay, ws):
        """Adds this channel-mix's d loss / d x to dx (N, C); writes its parameter grads."""
        f, b = f"blocks.{i}.ffn.", f"blocks.{i}."
        N, C = dx.shape
        ln, d, xk, xr, kr, k, kv, sr = cache
        dkv = np.multiply(dx, sr, out=ws.empty("dmix0", (N, C)))  # (N, C)
        dr = sigmoid_backward(np.multiply(dx, kv, out=ws.empty("dmix1", (N, C))), sr)
        dk = self._linear_back(p, g, f + "value", k, dkv, ws.empty("dk", kr.shape), ws)  # (N, F)
        dk *= kr  # d square(relu(z)) = 2 relu(z)
        dk *= 2.0  # exact: the same bits as scaling the products after
        dxk = self._linear_back(p, g, f + "key", xk, dk, ws.empty("dmix0", (N, C)), ws)
        dxr = self._linear_back(p, g, f + "receptance", xr, dr, ws.empty("dmix2", (N, C)), ws)
        mixes = ("time_mix_k", "time_mix_r")
        dh = token_mix_backward(
            [dxk, dxr], [p[f + m] for m in mixes], d, [g[f + m] for m in mixes], lay,
            ws.empty("dh", (N, C)), ws.empty("gd", (N, C)),
        )
        layer_norm_backward(
            dh, ln, p[b + "ln2.weight"], g[b + "ln2.weight"], g[b + "ln2.bias"], dx, dxk
        )

    # ------------------------------------------------------------ Model interface

    def _check(self, flat: np.ndarray, inputs: np.ndarray) -> None:
        self.space.check_buffer(flat)
        if inputs.ndim != 2 or min(inputs.shape) < 1:
            raise ValueError(f"token windows must be (B, T) with B, T >= 1, got {inputs.shape}")

    def _targets(self, tokens: np.ndarray, L: int, n: int):
        """Targets in row order, and the rows that are real positions (None: all are)."""
        B, T = tokens.shape[0], tokens.shape[1] - 1
        targets = self._to_rows(tokens[:, 1:], L, n)
        if n * L == T:
            return targets, None
        t = np.arange(L)[:, None, None] + L * np.arange(n)[None, None, :]  # (L, 1, n)
        rows = np.flatnonzero(np.broadcast_to(t, (L, B, n)).reshape(-1) < T)
        return targets[rows], rows

    def loss_and_grad(self, flat: np.ndarray, tokens: np.ndarray, grad: np.ndarray) -> float:
        self._check(flat, tokens[:, :-1])
        self.space.check_buffer(grad)
        if grad.dtype != flat.dtype:
            raise ValueError(f"grad dtype {grad.dtype} differs from params dtype {flat.dtype}")
        B, T = tokens.shape[0], tokens.shape[1] - 1
        L, n = self._layout(T)
        lay = (L, B, n)
        p, g = self._params(flat), self._grads(grad)
        for start, end in self._padding:
            grad[start:end] = 0.0
        with self._lock:
            ws = self._workspace(B, T, flat.dtype)
            h, (ids, ln0, blocks, lno) = self._forward(p, tokens[:, :-1], ws)
            N, C = h.shape
            targets, rows = self._targets(tokens, L, n)
            hr = h if rows is None else h[rows]
            dlogits = self._linear(p, "head", hr, ws.empty("logits", (len(hr), self.vocab_size)),
                                   ws)
            loss = cross_entropy(dlogits, targets)  # dlogits now holds d loss / d logits
            dh = ws.empty("dh", (N, C))
            if rows is None:
                self._linear_back(p, g, "head", hr, dlogits, dh, ws)
            else:
                dh.fill(0.0)
                dh[rows] = self._linear_back(p, g, "head", hr, dlogits,
                                             ws.empty("dhr", (len(hr), C)), ws)
            dx = ws.empty("dx", (N, C))
            layer_norm_backward(
                dh, lno, p["ln_out.weight"], g["ln_out.weight"], g["ln_out.bias"], dx,
                ws.empty("gd", (N, C)), accumulate=False,
            )
            for i in reversed(range(self.config.n_layer)):
                att, ffn = blocks[i]
                self._channel_mix_backward(p, g, i, dx, ffn, lay, ws)
                self._time_mix_backward(p, g, i, dx, att, lay, ws)
            # x = LN0(emb[ids]): LN0 backward on the rows, then sum them per token id
            layer_norm_backward(
                dx, ln0, p["ln0.weight"], g["ln0.weight"], g["ln0.bias"], dx,
                ws.empty("gd", (N, C)), accumulate=False,
            )
            order = np.argsort(ids, kind="stable")
            sorted_ids = ids[order]
            starts = np.flatnonzero(np.diff(sorted_ids, prepend=-1))
            dx_sorted = np.take(dx, order, axis=0, out=ws.empty("gd", (N, C)))
            self._embed_back(g, sorted_ids[starts], np.add.reduceat(dx_sorted, starts, axis=0))
        return loss

    def _logits_rows(self, flat: np.ndarray, inputs: np.ndarray) -> np.ndarray:
        """(N, V) logits in chunk-major row order, freshly allocated."""
        B, T = inputs.shape
        with self._lock:
            p = self._params(flat)
            ws = self._workspace(B, T, flat.dtype)
            h, _ = self._forward(p, inputs, ws, keep=False)
            return self._linear(p, "head", h, np.empty((len(h), self.vocab_size), h.dtype), ws)

    def loss(self, flat: np.ndarray, tokens: np.ndarray) -> float:
        self._check(flat, tokens[:, :-1])
        B, T = tokens.shape[0], tokens.shape[1] - 1
        L, n = self._layout(T)
        targets, rows = self._targets(tokens, L, n)
        with self._lock:  # all in scratch memory: the same arrays as a training step's
            p = self._params(flat)
            ws = self._workspace(B, T, flat.dtype)
            h, _ = self._forward(p, tokens[:, :-1], ws, keep=False)
            hr = h if rows is None else h[rows]
            logits = self._linear(p, "head", hr, ws.empty("logits", (len(hr), self.vocab_size)),
                                  ws)
            return cross_entropy(logits, targets)

    def logits(self, flat: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        self._check(flat, tokens)
        B, T = tokens.shape
        L, n = self._layout(T)
        logits = self._logits_rows(flat, tokens).reshape(L, B, n, self.vocab_size)
        return logits.transpose(1, 2, 0, 3).reshape(B, n * L, self.vocab_size)[:, :T].copy()

    def flops_per_token(self) -> float:
        """6 FLOPs per weight of each matrix product per token (2 forward, 4 backward) over
        L*(4C^2 + 2CF + C^2) + C*V weights (F = ffn_mult*C; the embedding is a lookup), plus
        the WKV's chunked matmuls, 12*(chunk+1) per channel and layer (4*(chunk+1) forward,
        twice that backward). Elementwise work (norms, gates, exps) is not counted."""
        c = self.config
        C, F, V, L = c.n_embd, c.ffn_mult * c.n_embd, c.vocab_size, c.n_layer
        weights = L * (4 * C * C + 2 * C * F + C * C) + C * V
        return 6.0 * weights + 12.0 * (c.wkv_chunk + 1) * C * L

    def activation_bytes_per_sample(self) -> int:
        """Bytes of scratch memory per sample of ctx_len tokens (float32), all of it live from
        forward to backward: per block and position 12C (time-mix: norm, shift difference,
        3 mixed inputs, gate, gated wkv, WKV inputs 2C, state weight, denominator, wkv) and
        6C + 2F (channel-mix), plus about 29C + F + V of temporaries shared by all blocks
        (residual stream, LN0, gradients, WKV work arrays, logits). Measured to within 1%.
        A forward pass without backward (evaluation) of the same batch shape reuses these."""
        c = self.config
        C, F, V = c.n_embd, c.ffn_mult * c.n_embd, c.vocab_size
        L, n = self._layout(c.ctx_len)
        per_position = c.n_layer * (18 * C + 2 * F) + 29 * C + F + V
        return int(4 * n * L * per_position)
