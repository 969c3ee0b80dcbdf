"""The outer optimiser's state in a checkpoint (`gossip.outer_every > 0`): which arrays hold
it, named and shaped from a small description, so a node that resumes from its own
checkpoint keeps the progress of its round and what it still owes (proto/gossip/outer.py),
and a file cannot make it allocate anything but the vectors of its own model.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from p2ptrain.codecs.kernels import blocks
from p2ptrain.optim import Progress
from p2ptrain.owed8 import GROUP, Owed8

OUTER = "outer"  # the key of the description in the resume data, and the tensors' prefix


def parts(vector: Progress | Owed8) -> dict[str, np.ndarray]:
    """The arrays that hold a vector: an owed8's codes and scales, a bfloat16's bit patterns."""
    if isinstance(vector, Owed8):
        return {"codes": vector.codes, "scales": vector.scales}
    return {"bits": vector.bits}


def describe(feedback: Progress | Owed8, rewinds: bool, n: int) -> dict[str, Any]:
    return {"bits": 8 if isinstance(feedback, Owed8) else 16, "rewind": bool(rewinds),
            "n": int(n)}


def state_arrays(meta: Any, n: int) -> dict[str, np.ndarray] | None:
    """Empty arrays, by tensor name, for the state `meta` describes, if it is a state an
    optimiser of `n` parameters makes (else None): the feedback (8 bits: int8 codes and a
    float32 scale per GROUP; 16: bfloat16 bits) and, when it rewinds, the round's progress."""
    if (not isinstance(meta, Mapping) or meta.get("n") != n or meta.get("bits") not in (8, 16)
            or not isinstance(meta.get("rewind"), bool) or n < 1):
        return None
    groups = -(-n // GROUP)
    if meta["bits"] == 8:
        out = {f"{OUTER}.feedback.codes": np.empty(groups * GROUP, np.int8),
               f"{OUTER}.feedback.scales": np.empty(groups, np.float32)}
    else:
        out = {f"{OUTER}.feedback.bits": np.empty(n, np.uint16)}
    if meta["rewind"]:
        out[f"{OUTER}.progress.bits"] = np.empty(n, np.uint16)
    return out


MAX_MAGNITUDE = 2.0**40  # no honest progress or scale comes near: decoded values stay finite


def finite(arrays: Mapping[str, np.ndarray]) -> bool:
    """No bfloat16 value (progress) of magnitude 2^40 or more -- infinity and NaN included --
    and no scale below zero, not finite or above 2^40: a scale of 3e38 passed, and its codes
    decoded to infinity (the next share raised); progress of 3.4e38 went into the weights at
    the next rewind. Checked a block at a time: at start-up, beside the model, a temporary of
    the vector's size is not free."""
    top = (127 + 40) << 7  # the bfloat16 exponent field of 2^40
    for a in arrays.values():
        if a.dtype == np.uint16 and any(bool(((a[lo:hi] & 0x7F80) >= top).any())
                                        for lo, hi in blocks(a.shape[0])):
            return False
        if a.dtype == np.float32 and not bool(((a >= 0) & (a <= MAX_MAGNITUDE)).all()):
            return False  # (NaN fails both comparisons)
    return True
