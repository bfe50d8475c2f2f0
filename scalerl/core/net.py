"""Small network helpers for local rendezvous."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now, for a local rendezvous (spawned groups, tests)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
