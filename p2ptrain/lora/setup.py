"""Finding a node's base and building its LoRA model: from the `[lora] base` setting when a
node starts, and from a checkpoint's architecture (which names its base by id) when a
command reads adapters.

Bases live in `<state dir>/bases/<id>/`. A base given as a checkpoint or a Hugging Face
directory is written there once (16-bit); one given by id is looked up there (the join
fetches a missing one from the swarm first). Every base is checked chunk by chunk against its
manifest before it is used: a damaged disk is named, never trained on.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from p2ptrain.fsutil import atomic_write_bytes, dangling, describe_os_error, read_regular
from p2ptrain.lora.basefile import Base, BaseError, is_base_dir, make_base, read_base, verify_base
from p2ptrain.models.lora import LoRAConfig, LoRARWKV
from p2ptrain.models.rwkv import RWKV, RWKVConfig

BASE_ID_RE = re.compile(r"[0-9a-f]{16}")
SOURCES = "sources.json"  # <state dir>/bases/: which base each source was made into
MAX_SOURCES_BYTES = 2**20  # read at most this much of it (a cache: one past it starts anew)


class BaseMissing(BaseError):
    """The base is named by id and is not on this machine (yet)."""

    def __init__(self, base_id: str, where: Path):
        super().__init__(f"base {base_id} is not in {where}")
        self.base_id = base_id


def bases_root(state_dir: str | os.PathLike) -> Path:
    return Path(state_dir).expanduser() / "bases"


def is_base_id(source: str) -> bool:
    return bool(BASE_ID_RE.fullmatch(source)) and not Path(source).exists()


def find_base(base_id: str, roots: list[Path]) -> Base:
    """The base `base_id` in the first of `roots` that holds it, or is it (BaseMissing: none
    does)."""
    broken = None  # a link to a disk not mounted: said if no other root holds the base
    for root in roots:
        if is_base_dir(root) and (given := read_base(root)).id == base_id:
            return given
        if broken is None and (why := dangling(root / base_id)):  # (else fetched or made
            broken = BaseError(f"{root / base_id}: {why}")  # again in the link's place)
        if is_base_dir(root / base_id):
            base = read_base(root / base_id)
            if base.id != base_id:
                raise BaseError(f"{root / base_id} holds base {base.id}, not {base_id}")
            return base
    if broken is not None:
        raise broken
    raise BaseMissing(base_id, roots[0] if roots else Path("."))


def resolve_base(source: str, state_dir: str | os.PathLike, dtype: str = "bf16",
                 progress=None) -> Base:
    """The checked base `source` names (a base id, base directory, p2ptrain checkpoint or
    Hugging Face RWKV-4 directory); made into a base under the state directory if need be."""
    if not source:
        raise BaseError("train.mode is lora but no base is given: set lora.base (--base) or "
                        "model.init_from")
    root = bases_root(state_dir)
    try:
        if is_base_id(source):
            return _checked(find_base(source, [root]), progress)
        src = Path(source).expanduser()
        if not src.exists():
            raise BaseError(f"base {source} does not exist (and is not a 16-hex base id)")
        base = _made_before(root, src, dtype)
        if base is not None:
            try:
                verify_base(base, progress)
                return base
            except BaseError:  # damaged since it was made: made anew from its source
                base = None
        base = make_base(src, root, dtype)
        if is_base_dir(src):  # the user's own copy: never "remove it"
            verify_base(base, progress)
            _link(root, base)
            return base
        _remember(root, src, dtype, base.id)
        return _checked(base, progress)
    except OSError as exc:  # a full disk while making it, a failing card while checking it
        raise BaseError(describe_os_error(exc)) from None


def _link(root: Path, base: Base) -> None:
    """A base directory given by path is used where it lies, and linked as
    <state-dir>/bases/<id>: where `sample`, `export` and a restart by id look for it."""
    where = root / base.id
    if where.exists():
        return
    try:
        if where.is_symlink():  # to where the base was before it moved
            where.unlink()
        root.mkdir(parents=True, exist_ok=True)
        where.symlink_to(base.path.resolve(), target_is_directory=True)
    except OSError:  # (a file system without links: it is found by --base, as before)
        pass


def _checked(base: Base, progress) -> Base:
    """`base`, every chunk checked; a damaged one is named with what to do."""
    try:
        verify_base(base, progress)
    except BaseError as exc:
        raise BaseError(f"{exc}: remove {base.path} (a node given a token fetches it again "
                        f"from the swarm; a base made from a checkpoint or download is made "
                        f"anew)") from None
    return base


def _source_key(src: Path, dtype: str) -> str:
    """What a base made from `src` depends on: its path, the dtype, and the name, size and
    modification time of every file in it (a changed checkpoint or download makes anew)."""
    src = src.resolve()
    files = sorted((str(p.relative_to(src)), p.stat().st_size, p.stat().st_mtime_ns)
                   for p in src.rglob("*") if p.is_file()) if src.is_dir() else []
    return hashlib.sha256(json.dumps([str(src), dtype, files]).encode()).hexdigest()


def _made_before(root: Path, src: Path, dtype: str):
    """The base made from `src` by an earlier start (None: none, or the source changed)."""
    try:
        index = json.loads(read_regular(root / SOURCES, MAX_SOURCES_BYTES))
        base_id = index[_source_key(src, dtype)]
        return find_base(base_id, [root]) if isinstance(base_id, str) else None
    except (OSError, ValueError, KeyError, TypeError, RecursionError, BaseError):
        return None


def _remember(root: Path, src: Path, dtype: str, base_id: str) -> None:
    try:
        index = json.loads(read_regular(root / SOURCES, MAX_SOURCES_BYTES))
        index = index if isinstance(index, dict) else {}
    except (OSError, ValueError, RecursionError):
        index = {}
    index[_source_key(src, dtype)] = base_id
    atomic_write_bytes(root / SOURCES, json.dumps(index, indent=1).encode())


def lora_model(base: Base, lora: LoRAConfig, ctx_len: int, wkv_chunk: int) -> LoRARWKV:
    config = base.config(ctx_len, wkv_chunk)
    return LoRARWKV(config, lora, base.frozen(RWKV(config)), base.id)


def model_of_arch(arch: dict, roots: list[Path]):
    """The model a checkpoint's `arch` describes; a LoRA one on its base, found by id in
    `roots` (BaseMissing names the id)."""
    from p2ptrain.models import model_from_arch

    if not isinstance(arch, dict) or "lora" not in arch:
        return model_from_arch(arch)
    spec, shape = arch.get("lora"), {k: v for k, v in arch.items() if k not in ("model", "lora")}
    try:
        config = RWKVConfig(**shape)
        lora = LoRAConfig(int(spec["rank"]), float(spec["alpha"]), str(spec["targets"]))
        base_id = str(spec["base"])
    except (TypeError, KeyError, ValueError) as exc:
        raise ValueError(f"checkpoint's LoRA architecture is not readable: {exc}") from None
    if arch.get("model") != "rwkv" or not BASE_ID_RE.fullmatch(base_id):
        raise ValueError(f"checkpoint's LoRA architecture is not readable: {spec!r}")
    base = find_base(base_id, roots)
    if base.config(config.ctx_len, config.wkv_chunk) != config:
        raise BaseError(f"base {base_id} has another shape than the checkpoint's model")
    verify_base(base)
    return lora_model(base, lora, config.ctx_len, config.wkv_chunk)
