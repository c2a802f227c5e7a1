"""A free TCP port on the loopback interface, for the servers quantgate starts (and its tests start)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now; the OS may hand it out again, so bind it soon."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
