"""TCP proxies the nemesis cuts and heals: one per network link of the cluster.

Runs as its own process (`python -m bench.chaos.proxy`) so that forwarding bytes never waits
on the harness's clients; the harness drives it with JSON lines on stdin (`ProxySet`):

    {"op": "add", "name": "nats-d0", "port": 41001, "upstream": "127.0.0.1:4222"}
    {"op": "cut", "names": [...]}    a partition: bytes stop in both directions, connections
                                     stay open (as with packets dropped), new ones hang
    {"op": "heal", "names": [...]}   bytes flow again (what was held is delivered)
    {"op": "down", "upstream": A}    the process behind A died: stop listening, so a connect is
                                     refused as it would be without the proxy (fast death
                                     detection tells a refusal from a timeout)
    {"op": "up", "upstream": A}      it listens again: so does every proxy in front of it
    {"op": "pids", "pids": {"w0": PID, ...}}
                                     the workers' processes: a worker that connects to a
                                     daemon's advertised proxy (`peer-dK`, after a redirect)
                                     is gated by its own link `wW-dK`, so cutting a daemon from
                                     its workers cuts that path too

Each command is answered with one JSON line. A proxy whose upstream refuses a connection also
stops listening by itself and probes the upstream every 0.2 s until it accepts again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
from typing import Any


def _socket_inode(port: int) -> str | None:
    """The inode of the loopback TCP socket whose local port is `port` (/proc/net/tcp, or
    tcp6: gRPC's sockets are dual-stack, 127.0.0.1 shows as ::ffff:127.0.0.1)."""
    suffix = f"0100007F:{port:04X}"
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in f:
                cols = line.split()
                if len(cols) > 9 and cols[1].endswith(suffix):
                    return cols[9]
    return None


def _owner(port: int, pids: dict[str, int]) -> str | None:
    """Which of `pids` (name -> pid) holds the socket connected from loopback port `port`."""
    inode = _socket_inode(port)
    if inode is None:
        return None
    target = f"socket:[{inode}]"
    for name, pid in pids.items():
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                        return name
    return None


class Link:
    """One listening port forwarding to one upstream; cut/heal gate every byte of it."""

    def __init__(self, name: str, port: int, upstream: str, owner: ProxyServer) -> None:
        self.owner = owner
        self.name = name
        self.port = port
        host, p = upstream.rsplit(":", 1)
        self.upstream = upstream
        self.up_host, self.up_port = host, int(p)
        self.gate = asyncio.Event()
        self.gate.set()
        self.server: asyncio.Server | None = None
        self.conns: set[asyncio.StreamWriter] = set()
        self.probe: asyncio.Task[None] | None = None
        self.num_conns = 0
        self.num_bytes = 0

    async def listen(self) -> None:
        if self.server is None:
            self.server = await asyncio.start_server(
                self._handle, "127.0.0.1", self.port, reuse_address=True
            )

    def stop_listening(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None

    def down(self) -> None:
        """The upstream died: refuse connects; reset what was open (the kernel would)."""
        self.stop_listening()
        for w in list(self.conns):
            with contextlib.suppress(Exception):
                w.transport.abort()
        self.conns.clear()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.num_conns += 1
        self.conns.add(writer)
        gate = self.gate
        if self.name.startswith("peer-") and self.owner.pids:
            peer = writer.get_extra_info("peername")
            who = _owner(int(peer[1]), self.owner.pids) if peer else None
            alias = f"{who}-{self.name.removeprefix('peer-')}"
            if who is not None and alias in self.owner.links:
                gate = self.owner.links[alias].gate
            if os.environ.get("CHAOS_PROXY_DEBUG"):
                print(f"proxy {self.name}: from {peer} = {who}", file=sys.stderr, flush=True)
        try:
            await gate.wait()  # partitioned: the connect hangs, as a SYN dropped would
            try:
                up_r, up_w = await asyncio.open_connection(self.up_host, self.up_port)
            except OSError:
                writer.transport.abort()
                self.down()
                self._start_probe()
                return
            self.conns.add(up_w)
            await asyncio.gather(self._pump(reader, up_w, gate), self._pump(up_r, writer, gate))
        finally:
            self.conns.discard(writer)
            with contextlib.suppress(Exception):
                writer.close()

    async def _pump(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, gate: asyncio.Event
    ) -> None:
        try:
            while True:
                await gate.wait()
                data = await src.read(65536)
                if not data:
                    break
                await gate.wait()
                self.num_bytes += len(data)
                dst.write(data)
                await dst.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            self.conns.discard(dst)
            with contextlib.suppress(Exception):
                if dst.can_write_eof():
                    dst.write_eof()
                else:
                    dst.close()

    def _start_probe(self) -> None:
        if self.probe is None or self.probe.done():
            self.probe = asyncio.get_running_loop().create_task(self._probe_until_up())

    async def _probe_until_up(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            try:
                _, w = await asyncio.wait_for(
                    asyncio.open_connection(self.up_host, self.up_port), 1.0
                )
            except (OSError, TimeoutError):
                continue
            w.close()
            with contextlib.suppress(OSError):
                await self.listen()
            return


class ProxyServer:
    def __init__(self) -> None:
        self.links: dict[str, Link] = {}
        self.pids: dict[str, int] = {}

    async def command(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["op"]
        if op == "add":
            link = Link(cmd["name"], int(cmd["port"]), cmd["upstream"], self)
            self.links[link.name] = link
            await link.listen()
            return {"ok": True, "port": link.port}
        if op in ("cut", "heal"):
            for n in cmd["names"]:
                g = self.links[n].gate
                g.clear() if op == "cut" else g.set()
            return {"ok": True}
        if op in ("down", "up"):
            for link in self.links.values():
                if link.upstream != cmd["upstream"]:
                    continue
                if op == "down":
                    link.down()
                else:
                    if link.probe is not None:
                        link.probe.cancel()
                    with contextlib.suppress(OSError):
                        await link.listen()
            return {"ok": True}
        if op == "pids":
            self.pids = {k: int(v) for k, v in cmd["pids"].items()}
            return {"ok": True}
        if op == "stats":
            return {
                "ok": True,
                "links": {
                    n: {"conns": k.num_conns, "bytes": k.num_bytes, "cut": not k.gate.is_set()}
                    for n, k in self.links.items()
                },
            }
        return {"ok": False, "error": f"unknown op {op!r}"}

    async def serve_stdin(self) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while line := await reader.readline():
            try:
                reply = await self.command(json.loads(line))
            except Exception as e:  # a bad command is answered, never fatal
                reply = {"ok": False, "error": repr(e)}
            sys.stdout.write(json.dumps(reply) + "\n")
            sys.stdout.flush()


class ProxySet:
    """The harness's handle on the proxy process (thread-safe: one command at a time)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.chaos.proxy"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._lock = threading.Lock()
        self.names: dict[str, str] = {}  # name -> "127.0.0.1:port"

    def call(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        with self._lock:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the proxy process exited")
        reply: dict[str, Any] = json.loads(line)
        if not reply.get("ok"):
            raise RuntimeError(f"proxy {cmd}: {reply}")
        return reply

    def add(self, name: str, upstream: str) -> str:
        port = free_port()
        self.call(op="add", name=name, port=port, upstream=upstream)
        self.names[name] = f"127.0.0.1:{port}"
        return self.names[name]

    def cut(self, names: list[str]) -> None:
        self.call(op="cut", names=names)

    def heal(self, names: list[str]) -> None:
        self.call(op="heal", names=names)

    def down(self, upstream: str) -> None:
        self.call(op="down", upstream=upstream)

    def up(self, upstream: str) -> None:
        self.call(op="up", upstream=upstream)

    def pids(self, pids: dict[str, int]) -> None:
        self.call(op="pids", pids=pids)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


if __name__ == "__main__":
    asyncio.run(ProxyServer().serve_stdin())
