"""Built-in models, by name: each entry is (config dataclass, model class)."""

import hashlib
import json

from p2ptrain.models.base import Model
from p2ptrain.models.mlp import MLP, MLPConfig
from p2ptrain.models.rwkv import RWKV, RWKVConfig

MODELS: dict[str, tuple[type, type[Model]]] = {
    "rwkv": (RWKVConfig, RWKV),
    "mlp": (MLPConfig, MLP),
}


def build_model(name: str, config=None) -> Model:
    """The built-in model `name`, with `config` (its dataclass) or its defaults."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; built-in models: {', '.join(MODELS)}")
    config_cls, model_cls = MODELS[name]
    return model_cls(config if config is not None else config_cls())



def fingerprint(model: Model, tokenizer: str = "bytes") -> str:
    """Configuration fingerprint: equal on two nodes iff their flat vectors are
    interchangeable (architecture, parameter layout, vocabulary, tokenizer, training mode).
    Byte-level models leave the tokenizer out, as before tokenizers existed."""
    body = {"arch": model.arch(), "layout": model.space.fingerprint(),
            "vocab": model.vocab_size, "mode": model.mode}
    if tokenizer != "bytes":
        body["tokenizer"] = tokenizer
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def model_from_arch(arch: dict) -> Model:
    """Rebuild a built-in model from the `arch()` dict stored in a checkpoint."""
    if not isinstance(arch, dict) or arch.get("model") not in MODELS:
        raise ValueError(f"checkpoint names no built-in model: {arch!r}")
    config_cls, model_cls = MODELS[arch["model"]]
    fields = {k: v for k, v in arch.items() if k != "model"}
    try:
        return model_cls(config_cls(**fields))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"checkpoint architecture is not buildable: {exc}") from None


__all__ = ["MODELS", "Model", "build_model", "fingerprint", "model_from_arch"]
