"""Gossip training (steps 2-4 of DESIGN.md's algorithm), pure: the knobs (config.py), gradient
encoding and mixing (mixer.py), push-pull parameter averaging (averaging.py), the choice of
peers (peers.py), the message bodies (messages.py) and the sub-machine that composes them for
one node (trainer.py). Import from the modules; `p2ptrain.proto` re-exports what drivers use.
"""
