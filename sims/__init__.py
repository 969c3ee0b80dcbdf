"""p2ptrain's discrete-event network simulator: a fleet of devices on WiFi, Ethernet and
Starlink running the real protocol `Node`s (with real numpy training) or, in traffic-only
mode, their traffic; against the seed's central coordinator, ring all-reduce and one node
alone. `python -m sims list`, `python -m sims run SCENARIO`; README.md says more.

Everything in this package is pure in the sense of STYLE.md: virtual time only (engine.py),
no sockets, randomness only from the run's seed.
"""
