"""Model sizes by name: the shapes of the published RWKV-4 models and the seed's ~1B.

A preset fixes the rwkv model's blocks and channels (`model.preset = "rwkv-169m"`); any
`model.rwkv.*` key set explicitly still wins. The vocabulary is not part of a preset: it
comes from the data (50,277 for the RWKV-4 "Pile" tokenizer the published models use; 256
for bytes), so `params(preset, vocab)` names both. Pure data and arithmetic.
"""

from __future__ import annotations

from dataclasses import replace

from p2ptrain.models.rwkv import RWKVConfig

PILE_VOCAB = 50277  # the published RWKV-4 models' vocabulary

# name -> (n_layer, n_embd): RWKV-4 169M/430M/1B5 (BlinkDL/rwkv-4-pile-*, HF RWKV/rwkv-4-*),
# and the seed's ~1B (24 blocks of 1664 channels: 1.03B parameters with the Pile vocabulary)
PRESETS: dict[str, tuple[int, int]] = {
    "rwkv-169m": (12, 768),
    "rwkv-430m": (24, 1024),
    "seed-1b": (24, 1664),
    "rwkv-1b5": (24, 2048),
}


def shape(preset: str) -> dict[str, int]:
    """The rwkv config fields a preset fixes."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; presets: {', '.join(PRESETS)}")
    n_layer, n_embd = PRESETS[preset]
    return {"n_layer": n_layer, "n_embd": n_embd, "ffn_mult": 4}


def apply(preset: str, config: RWKVConfig, explicit: set[str]) -> RWKVConfig:
    """`config` with the preset's shape, except the fields in `explicit` (set by the user)."""
    return replace(config, **{k: v for k, v in shape(preset).items() if k not in explicit})


def params(config: RWKVConfig) -> int:
    """Parameters of an rwkv model of `config` (without building it)."""
    C, F, V, L = config.n_embd, config.ffn_mult * config.n_embd, config.vocab_size, config.n_layer
    per_block = 4 * C + 5 * C + 4 * C * C  # two layer norms; decay, bonus, mixes; matrices
    per_block += 2 * C + C * F + C * C + F * C  # ffn: mixes, key, receptance, value
    return V * C + 2 * C + L * per_block + 2 * C + C * V  # emb, ln0, blocks, ln_out, head
