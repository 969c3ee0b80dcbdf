"""How a settings dataclass declares its options: `option(default, help, ...)` is a dataclass
field whose metadata carries the help line, flag, accepted choices and bounds.

`p2ptrain.config` turns every such field of the settings dataclasses (proto's `GossipConfig`
and `NodeConfig`, and the driver sections in `p2ptrain.settings`) into one entry of the option
table, so each default and each help line lives in exactly one place: on the field. A field
made with plain `dataclasses.field` (or none) is not an option. Pure: no I/O, no state.
"""

from __future__ import annotations

import dataclasses
from typing import Any


def option(default: Any, help: str, *, flag: str | None = None,
           choices: tuple[str, ...] | None = None, minimum: float | None = None,
           maximum: float | None = None) -> Any:
    """A dataclass field that is also a configuration option (TOML key = field name)."""
    meta = {"help": help, "flag": flag, "choices": choices, "minimum": minimum,
            "maximum": maximum}
    return dataclasses.field(default=default, metadata={"option": meta})


def option_meta(f: dataclasses.Field) -> dict[str, Any] | None:
    """The option metadata of a dataclass field, or None if the field is not an option."""
    return f.metadata.get("option")
