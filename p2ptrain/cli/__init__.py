"""The `p2ptrain` command line."""
