"""Membership, pure: the member table and SWIM's rules (table.py), probing (probe.py), the
suspicion timer (suspicion.py), the piggyback queue (broadcast.py), and the composition with
full exchanges, joining and rejoining (swim.py). Import from the modules; `p2ptrain.proto`
re-exports what drivers use.
"""
