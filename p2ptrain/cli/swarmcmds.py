"""The networked subcommands: `init`, `join` (the runtime), `status`, `checkpoint fetch`.

Which swarm: `--token` (or `--token-file`, e.g. a Docker secret), else the configuration
file's `[swarm]` (name + key file, as `init` writes it), else the public demo swarm. A node
given only a token first fetches the swarm's configuration from a peer (`GET /v1/config`,
authenticated) and adopts it; like every MAC request, it is preceded by a hello that tells
who is at the address (p2ptrain.net.hello). Tools that only look (`status`, `checkpoint
fetch`) sign their requests with a throw-away identity, so they never collide with a node's
replay window.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp

from p2ptrain.cli.peers import candidates as _candidates
from p2ptrain.cli.peers import get_json as _get_json
from p2ptrain.cli.peers import throwaway_signer
from p2ptrain.cli.statusview import status_lines, text
from p2ptrain.config import (
    LORA_DEFAULTS,
    OPTIONS,
    PRESET_SOURCE,
    SWARM_KEY_PREFIXES,
    Config,
    config_file_from,
    resolve,
    settings_of,
    swarm_options,
)
from p2ptrain.errors import UserError
from p2ptrain.fsutil import describe_os_error
from p2ptrain.net.auth import AuthError
from p2ptrain.net.neterrors import explain
from p2ptrain.report import Reporter, human_count
from p2ptrain.statelock import lock_state_dir, state_dir_of
from p2ptrain.swarm import (
    Swarm,
    SwarmError,
    demo_swarm,
    new_swarm,
    parse_token,
    read_key_file,
    write_init_files,
)


def key_path_of(cfg: Config, key: str, config_file: str | None) -> Path:
    """The file option `key` names, relative to the configuration file's directory."""
    path = Path(cfg[key]).expanduser()
    if not path.is_absolute() and config_file:
        path = Path(config_file).expanduser().parent / path
    return path


def swarm_of(cfg: Config, config_file: str | None) -> Swarm:
    """The swarm the configuration names (token, key file, or the demo swarm), with its
    previous key during a key rotation (`swarm.previous_key_file`)."""
    swarm = _current_swarm(cfg, config_file)
    if not cfg["swarm.previous_key_file"]:
        return swarm
    if swarm.is_demo:
        raise SwarmError("swarm.previous_key_file is set but no swarm key is: the demo swarm's "
                         "key cannot be rotated")
    path = key_path_of(cfg, "swarm.previous_key_file", config_file)
    return swarm.with_previous(read_key_file(path, swarm.name))


def _current_swarm(cfg: Config, config_file: str | None) -> Swarm:
    token = cfg["swarm.token"]
    given = cfg.sources.get("swarm.token", "default")
    if (not token.strip() and given.startswith(("flag", "env"))  # `--token "$UNSET"`
            and not cfg["swarm.token_file"] and not cfg["swarm.key_file"]):  # and nothing else:
        raise SwarmError(f"the swarm token ({given}) is empty: give the line `p2ptrain init` "
                         f"printed (without one, `join` uses the public demo swarm)")  # demo
    if not token and cfg["swarm.token_file"]:
        path = Path(cfg["swarm.token_file"]).expanduser()
        try:  # utf-8-sig: a byte-order mark (Windows editors) is not part of the token
            token = path.read_text(encoding="utf-8-sig").strip()
        except OSError as exc:
            raise SwarmError(f"token file {path}: {exc.strerror or exc}") from None
        except UnicodeDecodeError:
            raise SwarmError(f"token file {path} is not text: it should hold the line "
                             f"`p2ptrain init` printed") from None
        if not token:  # an empty secret must not put the node on the LAN's open demo swarm
            raise SwarmError(f"token file {path} is empty: it should hold the line "
                             f"`p2ptrain init` printed")
    if token:
        return parse_token(token)
    if cfg["swarm.key_file"]:
        key_path = key_path_of(cfg, "swarm.key_file", config_file)
        return read_key_file(key_path, cfg["swarm.name"] or "swarm")
    return demo_swarm()


async def fetch_swarm_config(swarm: Swarm, peers: list[str], timeout: float, mdns: bool = True
                             ) -> tuple[dict[str, Any], str] | None:
    """The swarm-wide options from the first peer that answers `GET /v1/config`; None when
    no member answers within `timeout` (this node may be the swarm's first); UserError when
    a peer refuses our authentication (a wrong token)."""
    from p2ptrain.net.hello import HelloError, hello
    from p2ptrain.net.routes import read_limited

    signer = throwaway_signer(swarm)
    async with aiohttp.ClientSession() as session:
        async for addr in _candidates(swarm, peers, timeout, rounds=True, mdns=mdns):
            try:
                to = await hello(session, f"http://{addr}", signer)
            except HelloError as exc:
                if "HTTP 401" in str(exc):
                    raise UserError(f"{addr} refused this token (HTTP 401): is it the token "
                                    f"of that swarm?") from None
                if "older p2ptrain" in str(exc):
                    print(f"p2ptrain: warning: {exc}", file=sys.stderr)
                continue  # not up yet, or not one of ours: try the next
            rid, headers = signer.sign_request("GET", "/v1/config", to=to)
            try:
                async with session.get(f"http://{addr}/v1/config", headers=headers,
                                       timeout=aiohttp.ClientTimeout(total=10)) as resp:
                    body = await read_limited(resp.content, 1 << 20)
                    if resp.status == 401:
                        raise UserError(f"{addr} refused this token (HTTP 401): is it the "
                                        f"token of that swarm?")
                    if body is None or resp.status != 200:
                        continue
                    signer.check_response("GET", "/v1/config", rid, resp.status,
                                          resp.headers, body)
                    doc = json.loads(body)
                    options = doc["options"]
                    if isinstance(options, dict):
                        return options, addr
            except (aiohttp.ClientError, OSError, TimeoutError, ValueError, KeyError,
                    TypeError, AuthError):
                continue  # not up yet, or not one of ours: try the next
    return None


def cmd_join(args, flags: dict) -> int:
    from p2ptrain import solo
    from p2ptrain.net.runtime import Runtime

    config_file = config_file_from(getattr(args, "config", None))
    cfg = resolve(config_file, os.environ, flags)
    reporter = Reporter(cfg["log.format"])
    if cfg["node.alone"]:
        return solo.run(settings_of(cfg), reporter)
    # until the runtime installs its handlers (after the config fetch and the model build), a
    # SIGTERM (docker stop) ends the process cleanly: nothing has been trained yet
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    swarm = swarm_of(cfg, config_file)
    explicit_token = cfg["swarm.token"] or cfg["swarm.token_file"]
    if explicit_token and not config_file:
        peers = [p for p in cfg["net.peers"].split(",") if p.strip()]
        if not peers and not cfg["net.mdns"]:  # nobody to ask: said so, not "no answer"
            reporter.info(f"no --peer and mDNS off: swarm {swarm.name!r} starts with this "
                          f"node's own configuration", event="config_local")
            found = None
        else:
            reporter.info(f"fetching the configuration of swarm {swarm.name!r} from a peer "
                          f"...", event="config_fetch")
            found = asyncio.run(fetch_swarm_config(swarm, peers, cfg["node.join_timeout"],
                                                   cfg["net.mdns"]))
        if found is None and (peers or cfg["net.mdns"]):
            reporter.warn(f"no member of swarm {swarm.name!r} answered within "
                          f"{cfg['node.join_timeout']:g}s: starting it with this node's own "
                          f"configuration", event="config_local")
        elif found is not None:
            options, addr = found
            cfg = resolve(None, os.environ, flags, adopted=options, adopted_from=addr)
            reporter.info(f"adopted the swarm's configuration from {addr}",
                          event="config_adopted", peer=addr)
    if swarm.is_demo:
        reporter.warn("joining the public DEMO swarm: anyone on this LAN may join it; "
                      "for a real fleet run `p2ptrain init` and join with its token")
    settings = settings_of(cfg)
    from p2ptrain.cli.basejoin import fetch_missing_base  # LoRA: a base named by id, once

    fetch_missing_base(settings, swarm, settings.net.seeds(), cfg["node.join_timeout"],
                       cfg["net.mdns"], reporter)
    return asyncio.run(Runtime(settings, swarm_options(cfg), reporter, swarm).run())


def _swarm_toml(cfg: Config, name: str) -> str:
    lines = ["# p2ptrain swarm configuration, written by `p2ptrain init`.",
             "# Every member must agree on these; data, batch and ports may differ per node.",
             "", "[swarm]", f'name = "{name}"', 'key_file = "swarm.key"  # secret: mode 0600']
    section = "swarm"
    for key in OPTIONS:
        if not key.startswith(SWARM_KEY_PREFIXES) or key.startswith("swarm."):
            continue
        sec, _, field = key.rpartition(".")
        if sec != section:
            lines += ["", f"[{sec}]"]
            section = sec
        value = cfg[key]
        text = (("true" if value else "false") if isinstance(value, bool)
                else json.dumps(value) if isinstance(value, str) else repr(value))
        if cfg.sources[key].startswith(PRESET_SOURCE):  # the preset's, as long as it is set
            lines.append(f"# {field} = {text}  # from {cfg.sources[key]}")
        elif key in LORA_DEFAULTS and cfg.sources[key].startswith("default"):
            # unset: a comment, so the mode (also a later change) picks the default
            lines.append(f"# {field} = {OPTIONS[key].default!r}  # unset: this in full "
                         f"training, {LORA_DEFAULTS[key]!r} in LoRA mode")
        else:
            lines.append(f"{field} = {text}")
    return "\n".join(lines) + "\n"


def cmd_init(args, flags: dict) -> int:
    cfg = resolve(config_file_from(getattr(args, "config", None)), os.environ, flags)
    swarm = new_swarm(args.name or cfg["swarm.name"] or "p2ptrain")
    out = Path(args.out or f"swarm-{swarm.name}").expanduser()
    try:
        key_path, config_path = write_init_files(swarm, out, _swarm_toml(cfg, swarm.name))
    except OSError as exc:
        raise UserError(f"cannot write {out}: {describe_os_error(exc)}") from None
    dropped = sorted(k for k, where in cfg.sources.items() if where.startswith("file")
                     and not k.startswith(SWARM_KEY_PREFIXES) and k != "swarm.name")
    if dropped:  # they are each machine's, not the swarm's
        print(f"note: {', '.join(dropped)} from {args.config} are per node, not written to "
              f"swarm.toml: set them on each machine (flags, environment or its own file)",
              file=sys.stderr)
    print(f"swarm {swarm.name!r} (id {swarm.swarm_id}) written to {out}/")
    print(f"  {config_path}   the swarm's configuration (edit before the first join)")
    print(f"  {key_path}    the swarm key (secret, mode 0600)")
    print("\njoin token (secret: anyone holding it can join and read the model):\n")
    print(f"  {swarm.token()}\n")
    print("on each machine, either of:")
    print(f"  p2ptrain join --token {swarm.token()}")
    print(f"  p2ptrain join --config {config_path}")
    return 0


def cmd_status(args) -> int:
    from p2ptrain.net.discovery import format_peer, parse_peer

    try:
        host, port = parse_peer(args.peer or "127.0.0.1:7100")
    except ValueError as exc:
        raise UserError(f"--peer: {exc}") from None

    async def get() -> dict:
        async with aiohttp.ClientSession() as session:
            return await _get_json(session, f"http://{format_peer(host, port)}/v1/status")

    try:
        doc = asyncio.run(get())
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        raise UserError(f"{explain(exc, format_peer(host, port))}; is `p2ptrain join` "
                        f"running there?") from None
    if args.json:
        print(json.dumps(doc))
        return 0
    for line in status_lines(doc):
        print(line)
    return 0


def _digest(row: dict) -> object:
    """The digest of the checkpoint a status row says it holds (None if it says none)."""
    holds = row.get("holds")
    return holds.get("digest") if isinstance(holds, dict) else None


def _sources(doc: dict, addr: str, leader_only: bool) -> list[str]:
    """From one node's status: the leader's address first, then every member that says it
    holds the same checkpoint (its `holds` digest) and accepts connections."""
    leader, members = doc.get("leader"), doc.get("members")
    # /v1/status needs no key, so anything may answer it: every field is checked
    rows = [{**doc, "addr": addr}, *[m for m in (members if isinstance(members, list) else [])
                                     if isinstance(m, dict)]]
    rows = [r for r in rows if isinstance(r.get("addr"), str) and r["addr"]]
    lead = next((r for r in rows if isinstance(leader, str) and r.get("node_id") == leader),
                None)
    if lead is None:
        return []
    digest = _digest(lead)
    others = [] if leader_only or digest is None else [
        r["addr"] for r in rows if r is not lead and _digest(r) == digest
        and not r.get("outbound_only") and r.get("state", "alive") == "alive"]
    return [lead["addr"], *others]


def cmd_fetch(args, flags: dict) -> int:
    from p2ptrain.checkpoint import DATA_FILES, MODEL_FILE
    from p2ptrain.net.fetch import FetchError, fetch_checkpoint
    from p2ptrain.net.fetchprogress import FetchProgress

    config_file = config_file_from(getattr(args, "config", None))
    cfg = resolve(config_file, os.environ, flags)
    swarm = swarm_of(cfg, config_file)
    peers = [args.peer] if args.peer else [p for p in cfg["net.peers"].split(",") if p.strip()]
    if not peers and not cfg["net.mdns"]:
        raise UserError("--no-mdns leaves nothing to find the leader by: give --peer HOST:PORT"
                        + ("; no --token or --config was given either: give your swarm's "
                           "token or config" if swarm.is_demo else ""))
    out = Path(args.out).expanduser()
    if out.exists() and not out.is_dir():  # before any network work (it failed at the end)
        raise UserError(f"--out {out}: a file is there; give a directory (new, or a node's "
                        f"state directory)")
    held = state_dir_of(out)
    if held is not None:  # writing into a node's state: never while that node runs
        lock_state_dir(held, instead="fetch into another --out")
    signer = throwaway_signer(swarm)
    files = (MODEL_FILE,) if args.weights_only else DATA_FILES
    say = lambda text: print(text, file=sys.stderr)  # noqa: E731
    problems: list[str] = []
    if swarm.is_demo:
        say(f"no --token or --config: looking for the public demo swarm for {args.timeout:g}s")

    async def run():
        async with aiohttp.ClientSession() as session:
            async for addr in _candidates(swarm, peers, args.timeout, rounds=True,
                                          mdns=cfg["net.mdns"]):  # --peer: until --timeout
                try:
                    doc = await _get_json(session, f"http://{addr}/v1/status")
                except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                    problems.append(explain(exc, addr))
                    continue
                except UserError as exc:
                    problems.append(str(exc))
                    continue
                sources = _sources(doc, addr, args.leader_only)
                if not sources:
                    problems.append(f"{addr} knows no reachable leader yet")
                    continue
                leader = doc["leader"]
                say(f"leader {text(leader, 12)} at {text(sources[0])}; fetching its latest "
                    f"checkpoint from {len(sources)} holder{'s' * (len(sources) != 1)}")
                bar = FetchProgress("fetching", say=say)
                try:
                    return await fetch_checkpoint(session, sources, signer, out,
                                                  expected_leader=leader, files=files,
                                                  progress=bar)
                finally:
                    bar.close()
        where = f" at {', '.join(peers)}" if peers else " by mDNS (give --peer HOST:PORT)"
        why = f": {'; '.join(dict.fromkeys(problems))}" if problems else ""
        demo = ("; no --token or --config was given, so this looked for the public demo swarm: "
                "give your swarm's token or config" if swarm.is_demo else "")
        raise UserError(f"no leader of swarm {swarm.name!r} found{where} within "
                        f"{args.timeout:g}s{why}{demo}")

    try:
        fetched = asyncio.run(run())
    except FetchError as exc:
        raise UserError(f"checkpoint fetch failed: {exc}") from None
    for addr, why in fetched.dropped.items():
        say(f"warning: holder {addr} dropped: {why}")
    served = ", ".join(f"{a} {n}" for a, n in fetched.served.items() if n)
    if served:
        say(f"chunks served by: {served}")
    for line in describe_fetched(fetched.manifest):
        say(line)
    print(fetched.path)
    return 0


def describe_fetched(manifest) -> list[str]:
    """What a fetched checkpoint holds, for the user: how far the swarm had trained, and a
    warning when that is nothing (a leader's first checkpoint can be of the starting weights)."""
    lines = [f"checkpoint at step {manifest.step}: {human_count(manifest.swarm_samples)} "
             f"samples trained by the swarm (leader {manifest.leader[:12]}, term {manifest.term})"]
    if manifest.swarm_samples == 0:
        lines.append("warning: it holds the swarm's starting weights -- nothing trained yet; "
                     "fetch again once the swarm has trained")
    return lines
