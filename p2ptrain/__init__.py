"""p2ptrain: peer-to-peer training for fleets of mismatched machines.

This package's top level stays light (no numpy import) so the CLI can set up the process,
e.g. BLAS thread limits inside containers, before any numerical library loads.
"""

__version__ = "0.1.0"
