"""What the socket-host tests share (tests/local and the host tests that start a socket
host): `EchoContext` (a HostContext stand-in), raw wire helpers (`raw`, `hello`, `request`),
`wait_for`, and `run_cli` (the `apir` command in a child process)."""

import socket
import struct
import subprocess
import sys
import time

from apir.local.wire import HEADER, HELLO_MAGIC, WIRE_VERSION, Op
from apir.local.socket_io import recv_message


class EchoContext:
    """A HostContext stand-in: submit(u32 src_res, u32 dst_res) copies 4 bytes of src into
    dst+4 and stores 1 in dst's notification word, through the registered memory."""

    def __init__(self, ctx_id, capset_id, config):
        self.res = {}
        self.closed = False

    def add_resource(self, res_id, memory):
        self.res[res_id] = memory

    def remove_resource(self, res_id):
        del self.res[res_id]

    def submit(self, command):
        src, dst = struct.unpack_from("<II", command)
        self.res[dst][4:8] = self.res[src][0:4]
        self.res[dst][0:4] = struct.pack("<I", 1)

    def close(self):
        self.closed = True


def raw(server):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(server.path)
    return s


def hello(s):
    s.sendall(HEADER.pack(Op.HELLO, 0, 8, 1) + struct.pack("<II", HELLO_MAGIC, WIRE_VERSION))
    header, body, fds = recv_message(s)
    assert header.err == 0 and len(fds) == 1
    return fds[0]


def request(s, op, payload, seq=2):
    s.sendall(HEADER.pack(op, 0, len(payload), seq) + payload)
    header, body, fds = recv_message(s)
    assert (header.op, header.seq, fds) == (op, seq, [])
    return header.err, body


def record_execbuffers(device) -> list:
    """The payloads of the EXECBUFFERs sent through `device` from now on (a list that grows)."""
    sent = []
    execbuffer = device.execbuffer

    def record(payload, ring_idx=0):
        sent.append(bytes(payload))
        return execbuffer(payload, ring_idx)

    device.execbuffer = record
    return sent


def wait_for(predicate, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "apir.cli", *args], capture_output=True, text=True,
                          timeout=120)
