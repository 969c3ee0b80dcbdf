"""Plain words for what went wrong on the way to a peer: a dead port is "nothing listens at
host:port", not a timeout or a class name. Pure: maps an exception to one line of text.
"""

from __future__ import annotations

import errno
import socket

import aiohttp

_REFUSED = {errno.ECONNREFUSED}
_UNREACHABLE = {errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN, errno.ENETDOWN}


def explain(exc: BaseException, where: str) -> str:
    """One line saying what happened when talking to `where` (host:port or a URL)."""
    if isinstance(exc, aiohttp.ClientConnectorError):
        cause = exc.os_error
        if isinstance(cause, socket.gaierror):
            return f"cannot resolve the host of {where} ({cause.strerror or cause})"
        if isinstance(cause, TimeoutError):
            return f"{where} did not accept a connection in time (host down or firewalled?)"
        if cause.errno in _REFUSED:
            return f"nothing listens at {where} (connection refused)"
        if cause.errno in _UNREACHABLE:
            return f"{where} is unreachable ({cause.strerror})"
        return f"cannot connect to {where} ({cause.strerror or cause})"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return f"{where} closed the connection before answering"
    if isinstance(exc, aiohttp.ClientPayloadError):
        return f"the answer from {where} was cut short"
    if isinstance(exc, TimeoutError | aiohttp.ServerTimeoutError):
        return f"{where} stopped answering (timed out)"
    if isinstance(exc, ConnectionResetError):
        return f"{where} reset the connection"
    text = str(exc).strip()
    return f"{type(exc).__name__} talking to {where}" + (f": {text}" if text else "")


def listen_error(exc: OSError, bind: str, port: int) -> str:
    """One line for a server that cannot listen on bind:port, with what to do."""
    hint = ""
    if exc.errno == errno.EADDRINUSE:
        hint = "; another node or program uses it: choose another --port"
    elif bind.count(":") == 1:  # "127.0.0.1:7100" (an IPv6 address has several)
        hint = "; --bind takes an address alone (the port is --port)"
    return f"cannot listen on {bind}:{port}: {exc.strerror or exc}{hint}"
