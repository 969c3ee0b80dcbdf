"""`rwkv` in LoRA mode: low-rank adapters trained on a frozen base.

Every adapted matrix W (in, out) of the base computes x @ (W + s * A @ B) with A (in, r),
B (r, out), s = alpha / r: x @ W from the frozen 16-bit base (models/frozen.py), widened a
cache-sized block at a time (columns forward, rows backward) into a reused buffer, plus
s * (x @ A) @ B from the adapters. The model's parameter space -- the flat buffer that
gossip, averaging, codecs, checkpoints and the optimiser work on -- holds only A and B of
each adapted matrix. Backward computes d loss / d x through the frozen matrices but never
their weight gradients; x @ A is recomputed there rather than kept.

B starts at zero (the adapted model starts as the base); A is drawn with variance 1 / in.
`merge` writes W + s * A @ B for every adapted matrix into a full model's buffer.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import asdict, dataclass, field

import numpy as np

from p2ptrain.models.frozen import FrozenBase
from p2ptrain.models.rwkv import RWKV, RWKVConfig
from p2ptrain.params import ParamSpace

ADAPTABLE = ("att.key", "att.value", "att.receptance", "att.output",
             "ffn.key", "ffn.receptance", "ffn.value")  # the linear maps of a block
DEFAULT_TARGETS = "blocks.*.att.*,blocks.*.ffn.*"
MAX_RANK = 4096  # a bound for ranks read from files (LoRA's point is r << C)
WIDEN_BLOCK = 1 << 20  # frozen weights widened at a time: 4 MB of float32, read from cache
ROW_BLOCK_MIN = 64  # backward widens whole rows when a block holds at least this many


@dataclass(frozen=True)
class LoRAConfig:
    rank: int = field(default=16, metadata={"help": "LoRA: rank r of each adapter"})
    alpha: float = field(default=32.0, metadata={"help": "LoRA: the adapters are scaled by "
                                                 "alpha / rank"})
    targets: str = field(default=DEFAULT_TARGETS, metadata={
        "help": "LoRA: the matrices that get adapters, comma-separated name patterns "
                "(blocks.*.att.*: all of time-mix; head: the output head)"})


def adapted_names(space: ParamSpace, targets: str) -> list[str]:
    """The matrices of `space` the patterns name, in layout order (the embedding is a
    lookup table and takes no adapter). ValueError when a pattern names none."""
    patterns = [t.strip() for t in targets.split(",") if t.strip()]
    if not patterns:
        raise ValueError("lora targets name no matrix")
    names = [s.name for s in space if len(s.shape) == 2 and s.name != "emb"]
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
            raise ValueError(f"lora target {pattern!r} names no matrix of the model "
                             f"(matrices: {names[0]}, ..., blocks.N.{'|'.join(ADAPTABLE)}, "
                             f"head)")
    return [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]


def adapter_space(full: ParamSpace, names: list[str], rank: int) -> ParamSpace:
    shapes = []
    for name in names:
        fan_in, fan_out = full.slot(name).shape
        shapes += [(name + ".lora_a", (fan_in, rank)), (name + ".lora_b", (rank, fan_out))]
    return ParamSpace(shapes)


def lora_sizes(config: RWKVConfig, lora: LoRAConfig) -> tuple[int, float]:
    """(adapter parameters, FLOPs per token of a training step) of `config` in LoRA mode,
    without a base. FLOPs: as the full model's, but the frozen matrices cost 4 per weight
    (forward and d loss / d x, no weight gradient) and each adapter 8 r in + 6 r out
    (forward 2 + 2; backward x @ A again, both weight gradients, d u and d x)."""
    full = RWKV(config)  # shapes only: no buffer is allocated
    names = adapted_names(full.space, lora.targets)
    r = lora.rank
    weights = sum(s.size for s in full.space if len(s.shape) == 2 and s.name != "emb")
    shapes = [full.space.slot(n).shape for n in names]
    adapters = sum(8 * r * i + 6 * r * o for i, o in shapes)
    params = sum(r * (i + o) for i, o in shapes)
    return params, full.flops_per_token() - 2.0 * weights + adapters


class LoRARWKV(RWKV):
    """RWKV(config) whose weights are `base` plus trainable adapters; `space` is theirs."""

    mode = "lora"

    def __init__(self, config: RWKVConfig, lora: LoRAConfig, base: FrozenBase, base_id: str):
        super().__init__(config)
        if not 1 <= lora.rank <= MAX_RANK or not math.isfinite(lora.alpha) or lora.alpha <= 0:
            raise ValueError(f"lora rank must be in 1..{MAX_RANK} and alpha > 0: {lora}")
        self.full_space = self.space
        self.lora, self.base, self.base_id = lora, base, base_id
        self.adapted = frozenset(adapted_names(self.full_space, lora.targets))
        self.space = adapter_space(self.full_space, sorted(self.adapted, key=self._order),
                                   lora.rank)
        self._padding = self._paddings(self.space)
        self.scale = lora.alpha / lora.rank
        biggest = max(s.size for s in self.full_space if len(s.shape) == 2 and s.name != "emb")
        self._block_elems = min(biggest, WIDEN_BLOCK)  # frozen weights widened at a time
        self._row_block_min = ROW_BLOCK_MIN
        self._wide: dict[str, np.ndarray] = {}  # dtype -> widened-block scratch
        self._vectors: dict[str, dict[str, np.ndarray]] = {}  # dtype -> frozen vectors
        self._sinks: dict[str, dict[str, np.ndarray]] = {}  # dtype -> their unused grads

    def _order(self, name: str) -> int:
        return self.full_space.slot(name).offset

    def arch(self) -> dict:
        return {**super().arch(), "lora": {**asdict(self.lora), "base": self.base_id}}

    def init_params(self, flat: np.ndarray, rng: np.random.Generator) -> None:
        flat.fill(0.0)
        p = self.space.views(flat)
        for name in sorted(self.adapted, key=self._order):
            a = p[name + ".lora_a"]
            a[...] = rng.standard_normal(a.shape) / math.sqrt(a.shape[0])

    # ------------------------------------------------------------ weights

    def _frozen_vectors(self, dtype) -> dict[str, np.ndarray]:
        key = np.dtype(dtype).str
        if key not in self._vectors:
            self._vectors[key] = {s.name: self.base.widened(s.name, dtype)
                                  for s in self.full_space if len(s.shape) == 1}
            self._sinks[key] = {n: np.empty_like(v) for n, v in self._vectors[key].items()}
        return self._vectors[key]

    def _params(self, flat):
        return {**self._frozen_vectors(flat.dtype), **self.space.views(flat)}

    def _grads(self, grad):
        self._frozen_vectors(grad.dtype)
        return {**self._sinks[np.dtype(grad.dtype).str], **self.space.views(grad)}

    def _embed(self, p, ids, out):
        return self.base.rows("emb", ids, out)

    def _embed_back(self, g, ids, rows):
        pass  # the embedding is frozen

    def _scratch_for(self, dtype, elems: int) -> np.ndarray:
        key = np.dtype(dtype).str
        if key not in self._wide or self._wide[key].size < elems:
            self._wide[key] = np.empty(max(elems, self._block_elems), dtype)
        return self._wide[key]

    def _blocks(self, name: str, dtype, rows: bool = False):
        """(part, widened W[part]) of the frozen matrix `name`, W (in, out), in blocks of
        about `_block_elems` weights: `part` slices its columns (rows=False: each block gives
        whole outputs of x @ W) or its rows (rows=True: whole outputs of dy @ W.T). A block
        of a few MB is still in cache when the matmul reads it (a whole 2048 x 8192 matrix
        widened at once goes to memory and back: ~1.5x the time)."""
        fan_in, fan_out = self.full_space.slot(name).shape
        inner, outer = (fan_out, fan_in) if rows else (fan_in, fan_out)
        step = max(1, self._block_elems // inner)
        wide = self._scratch_for(dtype, inner * min(step, outer))
        for lo in range(0, outer, step):
            part = slice(lo, min(outer, lo + step))
            n = part.stop - lo
            if rows:
                yield part, self.base.rows(name, part, wide[: n * inner].reshape(n, inner))
            else:
                yield part, self.base.block(name, part, wide[: n * inner].reshape(inner, n))

    def _linear(self, p, name, x, out, ws, cm=False):
        for cols, w in self._blocks(name, x.dtype):
            if cm:
                np.matmul(w.T, x.T, out=out[cols])
            else:
                np.matmul(x, w, out=out[:, cols])
        if name in self.adapted:
            a, b = p[name + ".lora_a"], p[name + ".lora_b"]
            u = np.matmul(x, a, out=ws.empty("lora.u", (x.shape[0], a.shape[1])))
            u *= self.scale
            t = ws.empty(f"lora.t{out.shape}", out.shape)
            out += np.matmul(b.T, u.T, out=t) if cm else np.matmul(u, b, out=t)
        return out

    def _linear_back(self, p, g, name, x, dy, out, ws, cm=False):
        fan_in, fan_out = self.full_space.slot(name).shape
        if self._block_elems // fan_out >= min(fan_in, self._row_block_min):  # rows: no sums
            for rows, w in self._blocks(name, dy.dtype, rows=True):
                if cm:
                    np.matmul(w, dy.T, out=out[rows])
                else:
                    np.matmul(dy, w.T, out=out[:, rows])
        else:  # a wide matrix (the head of a large vocabulary): column blocks, summed
            first = True
            for cols, w in self._blocks(name, dy.dtype):
                dst = out if first else ws.empty(f"lora.t{out.shape}", out.shape)
                if cm:
                    np.matmul(w, dy[:, cols].T, out=dst)
                else:
                    np.matmul(dy[:, cols], w.T, out=dst)
                if not first:
                    out += dst
                first = False
        if name in self.adapted:
            a, b = p[name + ".lora_a"], p[name + ".lora_b"]
            ga, gb = g[name + ".lora_a"], g[name + ".lora_b"]
            u = np.matmul(x, a, out=ws.empty("lora.u", (x.shape[0], a.shape[1])))
            np.matmul(u.T, dy, out=gb)
            gb *= self.scale
            du = np.matmul(dy, b.T, out=ws.empty("lora.du", u.shape))
            du *= self.scale
            np.matmul(x.T, du, out=ga)
            t = ws.empty(f"lora.t{out.shape}", out.shape)
            out += np.matmul(a, du.T, out=t) if cm else np.matmul(du, a.T, out=t)
        return out

    # ------------------------------------------------------------ figures and merging

    def flops_per_token(self) -> float:
        return lora_sizes(self.config, self.lora)[1]

    def merge(self, flat: np.ndarray, out: np.ndarray) -> np.ndarray:
        """out (a buffer of `full_space`, float32 or float64) = base + s * A @ B of the
        adapters `flat`: the weights of an ordinary full model that computes the same."""
        self.space.check_buffer(flat)
        self.full_space.check_buffer(out)
        p, views = self.space.views(flat), self.full_space.views(out)
        for slot in self.full_space:
            if len(slot.shape) == 2:
                self.base.block(slot.name, slice(None), views[slot.name])
            else:
                np.copyto(views[slot.name], self.base.widened(slot.name, out.dtype))
            if slot.name in self.adapted:
                a = p[slot.name + ".lora_a"].astype(out.dtype)
                b = p[slot.name + ".lora_b"].astype(out.dtype)
                views[slot.name] += self.scale * (a @ b)
        return out
