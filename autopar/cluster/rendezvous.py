"""Where the ranks of one machine meet: a ``torch.distributed.TCPStore`` that listens on loopback only.

A ``TCPStore`` master asked for host 127.0.0.1 still binds every interface (``[::]``, IPv4 and IPv6),
and it has no authentication: anyone who reaches the port may set keys the ranks read, and ranks
unpickle what the object collectives send. So the master is handed a socket already bound to
127.0.0.1 and listening (``master_listen_fd``), and listens nowhere else. Multi-machine runs keep
torchrun's rendezvous (``docs/security.md`` says how to restrict it).
"""

from __future__ import annotations

import socket
from datetime import timedelta

__all__ = ["LOOPBACK", "LoopbackStore", "loopback_store"]

LOOPBACK = "127.0.0.1"


class LoopbackStore:
    """A master ``TCPStore`` on loopback (``store``, its ``port``) and the listening socket it was
    handed, kept open for the store's life; ``close()`` closes that socket."""

    def __init__(self, store, listener: socket.socket):
        self.store, self._listener = store, listener
        self.port: int = listener.getsockname()[1]

    def close(self) -> None:
        self._listener.close()


def loopback_store(timeout: timedelta, world_size: int | None = None) -> LoopbackStore:
    """A master ``TCPStore`` listening only on 127.0.0.1, on a port the OS picks (two launches never
    collide); clients connect to ``LOOPBACK`` and its ``port``."""
    import torch.distributed as dist

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((LOOPBACK, 0))
        listener.listen(1024)
        store = dist.TCPStore(LOOPBACK, listener.getsockname()[1], world_size, True, timeout,
                              wait_for_workers=False, master_listen_fd=listener.fileno(), use_libuv=True)
    except BaseException:
        listener.close()
        raise
    return LoopbackStore(store, listener)
