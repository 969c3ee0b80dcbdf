"""What devices and links are charged for: the size of the model being planned.

A run trains a small *proxy* model for real (its learning curve is what the tables show) but
may charge compute time and bytes on the wire for a larger *planned* model -- the one the
fleet would really train -- so that step times, message times and the ratio between them
are those of the planned model, while latencies and protocol timers stay what they are.
Without a planned model the proxy is charged as itself. In traffic-only mode there is no
proxy: only the planned model's numbers.

A planned model may be trained in LoRA mode (`lora_rank`): then the flat vector that gossip,
averaging, codecs and checkpoints carry -- `params` -- is the adapters only (lora_sizes'
count), the FLOPs are lora_sizes' (the frozen matrices cost 4 per weight, not 6), and a
machine also holds the frozen base, 16-bit and memory-mapped (`base_params`), which never
travels in training.

- compute: the batch a device picks and its step time come from the planned model's FLOPs
  and activation memory per sample (devices.py);
- bytes: each message the proxy's nodes really send is charged at its exact encoded size
  (`wire.size`) with every codec chunk it carries replaced by the exact encoded size of the
  same codec over the planned model's vector (`total_encoded_size`, the codecs' own
  formula), in proportion to the part of the vector the chunk holds.

Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

from p2ptrain.codecs import DEFAULT_CHUNK, Codec, codec_from_wire, total_encoded_size
from p2ptrain.models import Model, build_model, presets
from p2ptrain.models.lora import DEFAULT_TARGETS, LoRAConfig, lora_sizes
from p2ptrain.proto import (
    AverageReply,
    AverageRequest,
    GradientPush,
    GradientReply,
    TrackPush,
    wire,
)
from sims.devices import BYTES_PER_PARAM_TRAINING

_CHUNK_HEADER = struct.Struct("<4sBBH8sQQI")  # magic .. chunk length (codecs/wire.py layout)
BASE_BYTES_PER_PARAM = 2  # LoRA: the frozen base is 16-bit


@dataclass(frozen=True, slots=True)
class ModelSize:
    """The numbers the device and link models need about a model."""

    name: str  # for reports
    params: int  # elements of the flat parameter vector (LoRA: the adapters) -- what travels
    flops_per_token: float  # forward + backward
    ctx_len: int  # tokens per sample
    activation_bytes: int  # per sample, kept for backward
    base_params: int = 0  # LoRA: elements of the frozen 16-bit base; 0 in full training

    @property
    def flops_per_sample(self) -> float:
        return self.flops_per_token * self.ctx_len

    @property
    def lora(self) -> bool:
        return self.base_params > 0

    @property
    def resident_bytes(self) -> int:
        """Memory a machine holds to train it, activations aside: the training state of the
        flat vector (devices.py's bytes per parameter) plus, in LoRA mode, the 16-bit base."""
        return self.params * BYTES_PER_PARAM_TRAINING + self.base_params * BASE_BYTES_PER_PARAM

    @classmethod
    def of(cls, model: Model, name: str | None = None) -> ModelSize:
        return cls(name or model.name, model.space.n_params, float(model.flops_per_token()),
                   model.ctx_len, int(model.activation_bytes_per_sample()))

    @classmethod
    def from_spec(cls, spec: dict) -> ModelSize:
        """From a scenario table: a built-in model (`model = "rwkv"` plus its config fields,
        or `preset = "seed-1b"` and the fields that differ; `lora_rank` and optionally
        `lora_targets` for LoRA mode) or raw numbers (`params`, `flops_per_token` (default
        6 x params), `ctx_len`, `activation_bytes`)."""
        spec = dict(spec)
        if "model" in spec:
            name = spec.pop("model")
            rank, targets = spec.pop("lora_rank", None), spec.pop("lora_targets", None)
            if rank is not None:
                return cls.lora_of(name, spec, LoRAConfig(rank=int(rank),
                                                          targets=targets or DEFAULT_TARGETS))
            if targets is not None:
                raise ValueError("lora_targets needs lora_rank (LoRA mode)")
            return cls.of(build_model_from(name, spec), describe(name, spec))
        params = int(float(spec.pop("params")))
        ctx = int(spec.pop("ctx_len", 64))
        flops = float(spec.pop("flops_per_token", 6.0 * params))
        act = int(float(spec.pop("activation_bytes", 0)))
        if spec:
            raise ValueError(f"unknown model size fields: {', '.join(sorted(spec))}")
        if params < 1 or flops <= 0 or ctx < 1:
            raise ValueError("a model size needs params >= 1, flops_per_token > 0, ctx_len >= 1")
        return cls(f"{params / 1e6:g}M params", params, flops, ctx, act)

    @classmethod
    def lora_of(cls, name: str, fields: dict, lora: LoRAConfig) -> ModelSize:
        """Built-in model `name` (rwkv: the one with adapters) trained in LoRA mode."""
        if name != "rwkv":
            raise ValueError(f"LoRA mode: model {name!r} has no adapters (rwkv has)")
        if lora.rank < 1:
            raise ValueError(f"lora_rank must be >= 1, not {lora.rank}")
        full = build_model_from(name, fields)
        adapters, flops = lora_sizes(full.config, lora)
        label = f"{describe(name, fields)} LoRA r{lora.rank}"
        if lora.targets != DEFAULT_TARGETS:
            label += f" on {lora.targets}"
        return cls(label, adapters, flops, full.ctx_len,
                   int(full.activation_bytes_per_sample()), base_params=full.space.n_params)

    def describe(self) -> dict:
        """The size as results.json reports it."""
        out = {"name": self.name, "mode": "lora" if self.lora else "full",
               "params": self.params, "flops_per_token": self.flops_per_token,
               "resident_bytes": self.resident_bytes}
        if self.lora:
            out["base_params"] = self.base_params
        return out


def build_model_from(name: str, fields: dict) -> Model:
    """A built-in model with some config fields changed (rwkv: on top of a `preset`)."""
    from p2ptrain.models import MODELS

    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; built-in: {', '.join(MODELS)}")
    config_cls, _ = MODELS[name]
    fields = dict(fields)
    preset = fields.pop("preset", None)
    try:
        config = config_cls(**fields)
        if preset is not None:
            if name != "rwkv":
                raise ValueError(f"model {name}: presets are rwkv shapes")
            config = presets.apply(str(preset), config, set(fields))
        return build_model(name, config)
    except TypeError as exc:
        raise ValueError(f"model {name}: {exc}") from None


def describe(name: str, fields: dict) -> str:
    inner = ", ".join(f"{k}={v}" for k, v in sorted(fields.items()))
    return f"{name}({inner})" if inner else name


def vector_bytes(codec: Codec, n: int, chunk_elems: int = DEFAULT_CHUNK) -> int:
    """Exact bytes of the chunk messages of an n-element vector under `codec`."""
    return total_encoded_size(codec, n, chunk_elems)


class ByteCharge:
    """Charged wire size of the proxy's messages; see the module docstring."""

    def __init__(self, proxy_params: int, planned_params: int,
                 chunk_elems: int = DEFAULT_CHUNK):
        self.ratio = planned_params / proxy_params
        self.identity = planned_params == proxy_params
        self.chunk_elems = chunk_elems
        self._cache: dict[tuple[int, bytes, int], int] = {}

    def size(self, envelope) -> int:
        """Bytes charged for one message (its exact size when nothing is rescaled)."""
        real = wire.size(envelope)
        if self.identity:
            return real
        body = envelope.body
        if isinstance(body, GradientPush | GradientReply):
            chunks: tuple[bytes, ...] = (body.chunk,)
        elif isinstance(body, AverageRequest | AverageReply | TrackPush):
            chunks = body.chunks
        else:
            return real
        charged = real
        for chunk in chunks:
            charged += self._chunk(chunk) - len(chunk)
        return charged

    def _chunk(self, chunk: bytes) -> int:
        _, _, codec_id, _, params, n, _, length = _CHUNK_HEADER.unpack_from(chunk)
        key = (codec_id, bytes(params), n)
        whole = self._cache.get(key)
        if whole is None:
            codec = codec_from_wire(codec_id, params)
            planned = max(1, math.ceil(n * self.ratio))
            whole = self._cache[key] = vector_bytes(codec, planned, self.chunk_elems)
        return math.ceil(whole * length / n)
