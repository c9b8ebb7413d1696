"""A TCP proxy the test owns, to cut one daemon off from NATS (or anything) on loopback.

    proxy = TcpProxy("127.0.0.1", nats_port).start()   # listens on proxy.port, in a thread
    proxy.cut()      # close every connection and refuse new ones (the peer sees a dead link)
    proxy.heal()     # listen again on the same port
    proxy.close()

The proxy runs its own event loop in a daemon thread, so the synchronous tests (real processes,
blocking gRPC calls) can cut and heal at any moment; `cut` and `heal` return once done.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading

from kvsched.cluster.natsd import free_port


class TcpProxy:
    def __init__(self, target_host: str, target_port: int, port: int = 0) -> None:
        self.target = (target_host, target_port)
        self.port = port or free_port()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.num_connections = 0  # accepted so far (each reconnect of the client is one)

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def _call(self, coro):  # type: ignore[no-untyped-def]
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def start(self) -> TcpProxy:
        self._thread.start()
        self._call(self._listen())
        return self

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    async def _serve(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        self.num_connections += 1
        try:
            sr, sw = await asyncio.open_connection(*self.target)
        except OSError:
            cw.close()
            return
        self._writers |= {cw, sw}

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            try:
                while data := await r.read(65536):
                    w.write(data)
                    await w.drain()
            except (OSError, asyncio.CancelledError):
                pass
            finally:
                with contextlib.suppress(Exception):
                    w.close()

        await asyncio.gather(pipe(cr, sw), pipe(sr, cw))
        self._writers -= {cw, sw}

    async def _cut(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for w in list(self._writers):
            with contextlib.suppress(Exception):
                w.transport.abort()
        self._writers.clear()

    def cut(self) -> None:
        self._call(self._cut())

    def heal(self) -> None:
        self._call(self._listen())

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._call(self._cut())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
