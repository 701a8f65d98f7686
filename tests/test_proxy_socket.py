"""The socket ``python -m pipeline proxy`` listens on: one asyncio sets ``TCP_NODELAY`` on
the connections of (a socket made without naming TCP gets none: Nagle's algorithm met the
client's delayed ACK and each response waited about 40 ms)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from pipeline._cli.proxy_cmd import _listen


def test_the_listening_socket_is_a_tcp_socket_by_name() -> None:
    sock = _listen("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP
    finally:
        sock.close()


@pytest.mark.asyncio
async def test_connections_accepted_on_it_do_not_wait_for_acks() -> None:
    sock = _listen("127.0.0.1", 0)
    accepted: list[int] = []

    def connected(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = writer.get_extra_info("socket")
        accepted.append(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    server = await asyncio.start_server(connected, sock=sock)
    async with server:
        _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
        for _ in range(100):
            if accepted:
                break
            await asyncio.sleep(0.01)
        writer.close()
        assert accepted == [1]
