"""apir.host.local.peers: what each peer holds, bounded per peer and in all."""

import os
import socket

from apir.host.local.peers import PeerLimits, PeerShare, peer_uid


def test_connections_per_peer_and_in_all():
    lim = PeerLimits(max_connections=3, max_peer_connections=2, max_bytes=0, max_peer_bytes=0)
    assert lim.admit("a") is None and lim.admit("a") is None
    assert "this peer" in lim.admit("a")  # a's third
    assert lim.admit("b") is None
    assert "the limit" in lim.admit("c")  # three in all
    lim.leave("a")
    assert lim.admit("c") is None
    for peer in ("a", "b", "c"):
        lim.leave(peer)
    assert (lim.connections, lim.held("a"), lim._conns) == (0, (0, 0), {})


def test_bytes_per_peer_and_in_all_and_nothing_counted_when_refused():
    lim = PeerLimits(max_connections=9, max_peer_connections=9, max_bytes=100, max_peer_bytes=60)
    a, b = PeerShare(lim, "a"), PeerShare(lim, "b")
    assert a.take(60) is None
    assert "this peer" in a.take(1)
    assert b.take(40) is None
    assert "the host" in b.take(1)
    assert (lim.bytes, lim.held("a")[1], lim.held("b")[1]) == (100, 60, 40)
    a.give(60)
    assert b.take(20) is None and lim.bytes == 60
    b.give(60)
    assert (lim.bytes, lim._bytes) == (0, {})


def test_peer_uid_is_the_connecting_users():
    x, y = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        assert peer_uid(x) == peer_uid(y) == os.getuid()
    finally:
        x.close()
        y.close()
