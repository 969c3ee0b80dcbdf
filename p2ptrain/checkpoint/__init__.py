"""Checkpoints: signed, chunk-hashed directories of safetensors files (store.py writes and finds
them; manifest.py parses, signs and verifies their manifests)."""

from p2ptrain.checkpoint.manifest import (
    DATA_FILES,
    MANIFEST_FILE,
    MODEL_FILE,
    STATE_FILE,
    CheckpointError,
    Manifest,
    ManifestError,
)
from p2ptrain.checkpoint.store import (
    TOKENIZER_META_KEY,
    CheckpointMismatch,
    Found,
    Snapshot,
    find_latest,
    list_checkpoints,
    load_tensors,
    read_manifest,
    save,
    stale_temporaries,
    state_meta,
)

__all__ = [
    "DATA_FILES", "MANIFEST_FILE", "MODEL_FILE", "STATE_FILE", "CheckpointError",
    "CheckpointMismatch", "Found", "Manifest", "ManifestError", "Snapshot", "find_latest",
    "list_checkpoints", "load_tensors", "read_manifest", "save", "stale_temporaries",
    "state_meta", "TOKENIZER_META_KEY",
]
