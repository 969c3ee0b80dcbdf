"""Before a LoRA node joins: the base its swarm names by id, fetched once from the members
that serve it when this machine does not hold it yet (net/basefetch.py does the fetching)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import aiohttp

from p2ptrain.errors import UserError
from p2ptrain.statelock import lock_state_dir

MAX_ROWS = 4096  # a status document's member rows read at most (a node's table holds 4,096)


def holders(doc: dict, limit: int) -> list[str]:
    """The addresses of up to `limit` members a status document lists that may serve a base:
    alive and reachable. Anything may have written the document: every row is checked, at
    most MAX_ROWS read, and the limit applies to the rows kept (dead and outbound-only
    members listed first left none)."""
    members = doc.get("members")
    rows = members[:MAX_ROWS] if isinstance(members, list) else []
    return [m["addr"] for m in rows
            if isinstance(m, dict) and isinstance(m.get("addr"), str)
            and m.get("state") == "alive" and not m.get("outbound_only")][:limit]


def missing_base(settings) -> str | None:
    """The base id the settings name when this node's state directory lacks it."""
    from p2ptrain.lora.basefile import BaseError
    from p2ptrain.lora.setup import BaseMissing, bases_root, find_base, is_base_id

    source = settings.lora.base or settings.init_from
    if settings.train.mode != "lora" or not is_base_id(source):
        return None
    try:
        find_base(source, [bases_root(settings.host.state_dir)])
    except BaseMissing:
        return source
    except BaseError as exc:  # on disk but unreadable: a bad disk, an interrupted copy
        raise UserError(f"{exc}\nthe base in {bases_root(settings.host.state_dir)} is "
                        f"damaged: remove its directory and join again to fetch it") from None
    return None


def fetch_missing_base(settings, swarm, peers: list[str], timeout: float, mdns: bool,
                       reporter) -> None:
    """Fetch the missing base into <state dir>/bases from every member that serves it."""
    from p2ptrain.cli.peers import candidates, get_json, throwaway_signer
    from p2ptrain.lora.setup import bases_root
    from p2ptrain.net.basefetch import fetch_base
    from p2ptrain.net.fetch import MAX_SOURCES, FetchError
    from p2ptrain.net.fetchprogress import FetchProgress
    from p2ptrain.net.neterrors import explain

    base_id = missing_base(settings)
    if base_id is None:
        return
    root = bases_root(settings.host.state_dir)
    lock_state_dir(Path(settings.host.state_dir).expanduser())  # held on by the node itself
    reporter.info(f"base {base_id} is not in {root}: fetching it from the swarm",
                  event="base_fetch", base=base_id)
    signer = throwaway_signer(swarm)
    problems: list[str] = []

    async def run():
        async with aiohttp.ClientSession() as session:
            async for addr in candidates(swarm, peers, timeout, rounds=True, mdns=mdns):
                sources = [addr]
                try:
                    doc = await get_json(session, f"http://{addr}/v1/status")
                    sources += holders(doc, MAX_SOURCES)
                except UserError as exc:
                    problems.append(str(exc))
                except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                    problems.append(explain(exc, addr))
                bar = FetchProgress(f"base {base_id}", say=lambda t: print(t, file=sys.stderr))
                try:
                    return await fetch_base(session, sources, signer, base_id, root,
                                            progress=bar)
                except FetchError as exc:
                    problems.append(str(exc))
                finally:
                    bar.close()
        return None

    base = asyncio.run(run())
    if base is None:
        why = "; ".join(dict.fromkeys(problems)) or "no member found"
        raise UserError(f"base {base_id} could not be fetched from swarm {swarm.name!r}: {why}")
    reporter.info(f"fetched base {base_id} ({base.size / 1e6:.1f} MB) into {Path(base.path)}",
                  event="base_fetched", base=base_id, bytes=base.size)
