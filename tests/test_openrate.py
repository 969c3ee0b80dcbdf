"""The open read-only routes' request rate per address (net/gate.py's OpenRate): a stranger
flooding /v1/history (811 requests a second, gzipped) took a node from 512 to 102 steps a
second; now each address gets `rate` a second in bursts of `burst`, bounded in memory."""

from __future__ import annotations

from p2ptrain.net.gate import OpenRate


def test_an_address_gets_its_burst_then_its_rate():
    clock = [0.0]
    limit = OpenRate(rate=50.0, burst=100.0, clock=lambda: clock[0])
    assert sum(limit.allow("10.0.0.9") for _ in range(300)) == 100  # the burst, at once
    assert sum(limit.allow("10.0.0.8") for _ in range(5)) == 5  # another address: its own
    clock[0] += 1.0
    assert sum(limit.allow("10.0.0.9") for _ in range(300)) == 50  # then the rate
    assert all(limit.allow("127.0.0.1") for _ in range(1000))  # this machine's own requests
    assert all(limit.allow("::1") for _ in range(1000))


def test_addresses_are_forgotten_past_the_bound():
    clock = [0.0]
    limit = OpenRate(rate=1.0, burst=2.0, most=100, clock=lambda: clock[0])
    for i in range(10_000):
        limit.allow(f"10.{i // 65536}.{i // 256 % 256}.{i % 256}")
    assert len(limit.tokens) <= 100
