"""Checkpoints: signed, chunk-hashed directories of safetensors files (see store.py)."""

from p2ptrain.checkpoint.store import (
    MODEL_FILE,
    STATE_FILE,
    CheckpointError,
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
    "MODEL_FILE", "STATE_FILE", "CheckpointError", "CheckpointMismatch", "Found", "Snapshot",
    "find_latest", "list_checkpoints", "load_tensors", "read_manifest", "save",
    "stale_temporaries", "state_meta",
]
