"""Finding peers: seed addresses (static or DNS names) and mDNS on the local network.

This file owns how a node is advertised over mDNS (service type, instance name, TXT fields),
which advertisements count as peers of our swarm, and how seed strings become addresses.
It only ever reports that a peer *exists*; it never declares one dead. A graceful exit sends
an mDNS goodbye, but a `kill -9`ed peer is never reported removed (receivers keep its records
for tens of minutes), so liveness belongs to the protocol (probes, failed requests), never here.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
import socket
import time
from collections import Counter
from collections.abc import Callable
from urllib.parse import urlsplit

import ifaddr  # a hard dependency of zeroconf, which itself says to use it for adapters
from zeroconf import InterfaceChoice, IPVersion, ServiceStateChange, Zeroconf
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

log = logging.getLogger(__name__)

SERVICE_TYPE = "_p2ptrain._tcp.local."
PROTOCOL_VERSION = "1"  # TXT `v`; peers advertising anything else are ignored
RESOLVE_TIMEOUT_MS = 3000  # how long one mDNS service resolution may take
SEED_RESOLVE_TIMEOUT = 5.0  # seconds for one seed's DNS lookup
DEBOUNCE_SECONDS = 5.0  # the same (address, node) is reported at most once per this interval
MAX_REPORTED = 4096  # (address, node) pairs remembered past their debounce, at most

_NODE_ID = re.compile(r"[0-9a-f]{32}")
_SWARM_ID = re.compile(r"[0-9a-f]{1,64}")
_PORT = re.compile(r"[0-9]{1,5}")
_HOSTNAME = re.compile(r"(?=.{1,253}\.?$)[A-Za-z0-9_]([A-Za-z0-9_-]*[A-Za-z0-9_])?"
                       r"(\.[A-Za-z0-9_]([A-Za-z0-9_-]*[A-Za-z0-9_])?)*\.?")


def _parse_port(port_text: str | None, default_port: int, original: str) -> int:
    """Turn the text after the host's colon into a port number in 1..65535."""
    if port_text is None:
        return default_port
    if not _PORT.fullmatch(port_text):
        raise ValueError(f"peer {original!r}: port {port_text!r} is not a number")
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise ValueError(f"peer {original!r}: port {port} is outside 1..65535")
    return port


def _is_ip(host: str, version: int | None = None) -> bool:
    """Whether host is an IP address literal (of the given version, if any)."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return version is None or address.version == version


def parse_peer(text: str, default_port: int = 7100) -> tuple[str, int]:
    """Split "HOST", "HOST:PORT", "[V6]:PORT", bare IPv6 or an http URL into (host, port)."""
    raw = text.strip()
    if not raw:
        raise ValueError("empty peer address")
    hostport = raw
    if "://" in raw:
        parts = urlsplit(raw)
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"peer {text!r}: only http:// and https:// URLs are accepted")
        hostport = parts.netloc.rpartition("@")[2]
    port_text: str | None = None
    if hostport.startswith("["):
        host, bracket, rest = hostport[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise ValueError(f"peer {text!r}: expected [IPv6] or [IPv6]:PORT")
        if not _is_ip(host, 6):
            raise ValueError(f"peer {text!r}: {host!r} in brackets is not an IPv6 address")
        port_text = rest[1:] if rest else None
    elif hostport.count(":") > 1:
        host = hostport  # a bare IPv6 address; a port needs the brackets
        if not _is_ip(host, 6):
            raise ValueError(f"peer {text!r}: write IPv6 addresses with a port as [ADDR]:PORT")
    else:
        host, colon, after = hostport.partition(":")
        port_text = after if colon else None
    if not host:
        raise ValueError(f"peer {text!r}: empty host")
    if not _is_ip(host) and not _HOSTNAME.fullmatch(host):
        raise ValueError(f"peer {text!r}: {host!r} is neither an IP address nor a host name")
    return host, _parse_port(port_text, default_port, text)


def format_peer(host: str, port: int) -> str:
    """Join a host and a port as "host:port", bracketing IPv6 addresses."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def _resolve_seed(seed: str, default_port: int) -> tuple[list[str], str | None]:
    """Every "addr:port" one seed stands for, or an empty list and the reason it failed."""
    try:
        host, port = parse_peer(seed, default_port)
    except ValueError as e:
        return [], str(e)
    if _is_ip(host):
        return [format_peer(host, port)], None
    loop = asyncio.get_running_loop()
    try:
        infos = await asyncio.wait_for(
            loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), SEED_RESOLVE_TIMEOUT)
    except TimeoutError:
        return [], f"DNS lookup of {host!r} took over {SEED_RESOLVE_TIMEOUT:g} s"
    except OSError as e:
        return [], f"cannot resolve {host!r}: {e}"
    addrs = [format_peer(str(sockaddr[0]), port) for *_, sockaddr in infos]
    if not addrs:
        return [], f"{host!r} has no addresses"
    return addrs, None


async def resolve_seeds(seeds: list[str], default_port: int) -> tuple[list[str], list[str]]:
    """Resolve seeds to every address their names have (resolved, "seed: reason" failures)."""
    results = await asyncio.gather(*(_resolve_seed(s, default_port) for s in seeds))
    resolved: list[str] = []
    failed: list[str] = []
    for seed, (addrs, error) in zip(seeds, results, strict=True):
        if error is not None:
            failed.append(f"{seed}: {error}")
        for addr in addrs:  # a Swarm `tasks.<service>` name gives every task's address
            if addr not in resolved:
                resolved.append(addr)
    return resolved, failed


def host_ipv4_addresses() -> list[str]:
    """The host's non-loopback IPv4 addresses in adapter order (loopback if there are none)."""
    found: list[str] = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if ip.is_IPv4 and not ip.ip.startswith("127.") and ip.ip not in found:
                found.append(ip.ip)
    return found or ["127.0.0.1"]


class Discovery:
    """Advertises this node over mDNS and reports the peers of its swarm as they appear."""

    def __init__(self, *, swarm_id: str, node_id: str, port: int, addresses: list[str] | None,
                 device_class: str, on_found: Callable[[str, str], None],
                 interfaces: list[str] | None = None, advertise: bool = True,
                 accept: Callable[[str], bool] | None = None) -> None:
        """Check the identity fields; nothing touches the network before start(). `swarm_id`
        is advertised; peers advertising it are reported, and so are those advertising a
        swarm id `accept` takes (during a key rotation: the previous key's, see keyring.py)."""
        if not _SWARM_ID.fullmatch(swarm_id):
            raise ValueError(f"swarm id {swarm_id!r} is not 1-64 lowercase hex characters")
        if not _NODE_ID.fullmatch(node_id):
            raise ValueError(f"node id {node_id!r} is not 32 lowercase hex characters")
        if not 1 <= port <= 65535:
            raise ValueError(f"port {port} is outside 1..65535")
        if not device_class or len(device_class) > 64:
            raise ValueError(f"device class {device_class!r} must be 1-64 characters")
        for address in addresses or []:
            if not _is_ip(address):
                raise ValueError(f"advertised address {address!r} is not an IP address")
        self.swarm_id = swarm_id
        self.node_id = node_id
        self.port = port
        self.device_class = device_class
        self.instance_name = f"p2ptrain-{node_id}.{SERVICE_TYPE}"  # no dots: avahi needs that
        self.ignored: Counter[str] = Counter()  # services seen but not reported, per reason
        self._addresses = addresses
        self._interfaces = interfaces
        self._advertise = advertise
        self._on_found = on_found
        self._accept = accept
        self._state = "new"  # new -> started -> closed; each step happens once
        self._aiozc: AsyncZeroconf | None = None
        self._browser: AsyncServiceBrowser | None = None
        self._registered: AsyncServiceInfo | None = None
        self._tasks: set[asyncio.Task] = set()
        self._last_reported: dict[tuple[str, str], float] = {}

    def advertised_addresses(self) -> list[str]:
        """The addresses put in our A/AAAA records: given, else the chosen interfaces' IPv4."""
        if self._addresses is not None:
            return list(self._addresses)
        if self._interfaces is not None:
            return [a for a in self._interfaces if _is_ip(a, 4)]
        return host_ipv4_addresses()

    async def start(self) -> None:
        """Start browsing for peers and, when advertising, register our service (≈ 1.2 s)."""
        if self._state != "new":
            raise RuntimeError(f"Discovery.start() called in state {self._state!r}")
        self._state = "started"
        interfaces = self._interfaces if self._interfaces is not None else InterfaceChoice.All
        self._aiozc = AsyncZeroconf(interfaces=interfaces)
        # Browsing first: peers already present are found while our own name is being probed.
        self._browser = AsyncServiceBrowser(
            self._aiozc.zeroconf, SERVICE_TYPE, handlers=[self._on_service_state_change])
        if not self._advertise:
            return
        info = AsyncServiceInfo(
            SERVICE_TYPE, self.instance_name, port=self.port,
            properties={"v": PROTOCOL_VERSION, "swarm": self.swarm_id, "node": self.node_id,
                        "port": str(self.port), "class": self.device_class},
            server=f"p2ptrain-{self.node_id}.local.",
            parsed_addresses=self.advertised_addresses())
        announced = await self._aiozc.async_register_service(info)
        self._registered = info  # in the registry from here on: close() must unregister it
        await announced

    async def close(self) -> None:
        """Send our goodbye, stop browsing and close the sockets; safe after a failed start."""
        if self._state == "closed":
            return
        self._state = "closed"
        aiozc, self._aiozc = self._aiozc, None
        if aiozc is None:
            return
        if self._registered is not None:
            try:
                await (await aiozc.async_unregister_service(self._registered))
            except Exception:
                log.warning("mDNS unregister failed", exc_info=True)
            self._registered = None
        if self._browser is not None:
            await self._browser.async_cancel()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await aiozc.async_close()

    def _on_service_state_change(self, zeroconf: Zeroconf, service_type: str, name: str,
                                 state_change: ServiceStateChange) -> None:
        """Browser callback: resolve added or updated services; removals mean nothing to us."""
        if state_change is ServiceStateChange.Removed or self._state != "started":
            return
        task = asyncio.get_running_loop().create_task(self._resolve(zeroconf, name))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _resolve(self, zeroconf: Zeroconf, name: str) -> None:
        """Fetch one service's records and report it if it is a peer of our swarm."""
        try:
            info = AsyncServiceInfo(SERVICE_TYPE, name)
            if not await info.async_request(zeroconf, RESOLVE_TIMEOUT_MS):
                self._ignore("unresolved", name)
                return
            verdict = self._peer_of(info)
            if isinstance(verdict, str):
                self._ignore(verdict, name)
            else:
                self._report(*verdict)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("mDNS: resolving %s failed", name)
            self._ignore("error", name)

    def _peer_of(self, info: AsyncServiceInfo) -> tuple[str, str] | str:
        """The ("addr:port", node id) a resolved service stands for, or why it is ignored."""
        props = info.decoded_properties
        version = props.get("v")
        if version is None:
            return "malformed"
        if version != PROTOCOL_VERSION:
            return "version"
        swarm, node, port = props.get("swarm"), props.get("node"), props.get("port")
        if swarm is None or node is None or port is None or props.get("class") is None:
            return "malformed"
        if swarm != self.swarm_id and not (self._accept is not None and self._accept(swarm)):
            return "other_swarm"
        if not _NODE_ID.fullmatch(node) or not _PORT.fullmatch(port):
            return "malformed"
        if not 1 <= int(port) <= 65535:
            return "malformed"
        if node == self.node_id:
            return "self"
        candidates = (info.parsed_addresses(IPVersion.V4Only)
                      or info.parsed_scoped_addresses(IPVersion.V6Only))
        if not candidates:
            return "no_address"
        return format_peer(candidates[0], int(port)), node

    def _ignore(self, reason: str, name: str) -> None:
        """Count a service we will not report, by reason."""
        self.ignored[reason] += 1
        log.debug("mDNS: ignoring %s (%s)", name, reason)

    def _report(self, addr: str, node: str) -> None:
        """Call on_found, at most once per DEBOUNCE_SECONDS for the same (addr, node)."""
        now = time.monotonic()
        last = self._last_reported.get((addr, node))
        if last is not None and now - last < DEBOUNCE_SECONDS:
            return
        self._last_reported[(addr, node)] = now
        if len(self._last_reported) > MAX_REPORTED:  # adverts are anyone's: keep only the
            self._last_reported = {k: t for k, t in self._last_reported.items()  # debounced
                                   if now - t < DEBOUNCE_SECONDS}
        try:
            self._on_found(addr, node)
        except Exception:
            log.exception("mDNS: on_found(%s, %s) raised", addr, node)


def guess_address(bind: str, toward: str | None = None) -> str:
    """The address peers should use: the bound one, else the source address of the route
    toward the first seed (its network is the peers' network), else of the default route,
    else any non-loopback address (an offline LAN)."""
    if bind not in ("", "0.0.0.0", "::"):
        return bind
    targets = [toward] if toward else []
    for target in [*targets, "192.0.2.1"]:  # TEST-NET: picks a route, sends nothing
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.connect((target, 9))
                return s.getsockname()[0]
            except (OSError, UnicodeError):
                continue
    return host_ipv4_addresses()[0]


async def start_mdns(swarm_id: str, node_id: str, port: int, host: str, device_class: str,
                     bind: str, advertise: bool, on_found: Callable[[str], None],
                     warn: Callable[[str], None], accept: Callable[[str], bool] | None = None
                     ) -> Discovery | None:
    """mDNS for one swarm: every other node it finds is handed to `on_found(addr)` on the
    calling event loop (`accept`: other swarm ids taken too, see Discovery). None (after a
    warning) where multicast does not work."""
    loop = asyncio.get_running_loop()

    def found(addr: str, other: str) -> None:
        if other != node_id:
            loop.call_soon_threadsafe(on_found, addr)

    try:
        ipaddress.ip_address(host)
        addresses = [host]
    except ValueError:  # a DNS name: let zeroconf advertise the host's addresses
        addresses = None
    discovery = None
    try:
        discovery = Discovery(swarm_id=swarm_id, node_id=node_id, port=port,
                              addresses=addresses, device_class=device_class[:64] or "?",
                              on_found=found,
                              interfaces=[bind] if bind.startswith("127.") else None,
                              advertise=advertise, accept=accept)
        await discovery.start()
    except Exception as exc:  # no multicast here: say so, go on with the seeds
        warn(f"mDNS unavailable ({exc}); using seeds only")
        if discovery is not None:
            await discovery.close()
        return None
    return discovery


SEED_INTERVAL = 30.0  # s between re-resolutions of the static/DNS seeds


async def seed_loop(seeds: list[str], own_addr: str, on_found: Callable[[str], None],
                    warn: Callable[[str], None], resolved_to: set[str] | None = None) -> None:
    """Hand the static and DNS seeds to `on_found` now and every SEED_INTERVAL seconds (and
    add their addresses to `resolved_to`); each seed that does not resolve is reported once."""
    if not seeds:
        return
    said: set[str] = set()
    while True:
        resolved, failed = await resolve_seeds(seeds, 7100)
        for problem in failed:
            if problem not in said:
                said.add(problem)
                warn(f"seed {problem}")
        for addr in resolved:
            if addr != own_addr:
                if resolved_to is not None:
                    resolved_to.add(addr)
                on_found(addr)
        await asyncio.sleep(SEED_INTERVAL)


def advertised_address(advertise: str, bind: str, port: int, seeds: list[str]
                       ) -> tuple[str, str]:
    """(host, "host:port") peers should use to reach this node: `advertise` when given (its
    port defaults to the bound one), else the address on the route toward the first seed."""
    from p2ptrain.errors import UserError

    try:
        toward = parse_peer(seeds[0])[0] if seeds else None
    except ValueError as exc:
        raise UserError(f"--peer: {exc}") from None
    try:
        host, adv_port = parse_peer(advertise or guess_address(bind, toward), port)
    except ValueError as exc:
        raise UserError(f"--advertise: {exc}") from None
    return host, format_peer(host, adv_port)
