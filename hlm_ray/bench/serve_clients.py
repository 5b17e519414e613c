"""The serving benchmark's HTTP clients: many concurrent keep-alive clients on one event loop,
each POSTing completions until the bodies run out.

    answers = send(url, bodies, concurrency=32)       # new clients, then closed (the soak)
    clients = Clients(url, 32)                        # kept across rounds, as OpenAI's client
    answers = clients.send(bodies); clients.close()   # [(status, latency s, completion tokens)]
"""

from __future__ import annotations

import asyncio
import json
import threading
import time


def _session(concurrency: int):
    import aiohttp

    connector = aiohttp.TCPConnector(limit=concurrency)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120))


async def _post_all(
    session, url: str, bodies: list[dict], concurrency: int
) -> list[tuple[int, float, int]]:
    """POST every body with `concurrency` clients: (status, latency s, tokens)."""
    queue = list(reversed(bodies))
    out: list[tuple[int, float, int]] = []

    async def client() -> None:
        while queue:
            body = queue.pop()
            start = time.perf_counter()
            async with session.post(f"{url}/v1/completions", json=body) as r:
                data = await r.read()
                tokens = json.loads(data)["usage"]["completion_tokens"] if r.status == 200 else 0
                out.append((r.status, time.perf_counter() - start, tokens))

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return out


async def _requests(url: str, bodies: list[dict], concurrency: int) -> list[tuple[int, float, int]]:
    async with _session(concurrency) as session:
        return await _post_all(session, url, bodies, concurrency)


def send(url: str, bodies: list[dict], concurrency: int) -> list[tuple[int, float, int]]:
    """`bodies` from `concurrency` new keep-alive clients (the soak)."""
    return asyncio.run(_requests(url, bodies, concurrency))


class Clients:
    """`concurrency` keep-alive clients kept across rounds, on an event loop of their own (as
    OpenAI's client keeps its connections): a round pays for no connection set-up."""

    def __init__(self, url: str, concurrency: int) -> None:
        self.url, self.concurrency = url, concurrency
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._session = self._call(self._open())

    async def _open(self):
        return _session(self.concurrency)

    def _call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def send(self, bodies: list[dict]) -> list[tuple[int, float, int]]:
        return self._call(_post_all(self._session, self.url, bodies, self.concurrency))

    def close(self) -> None:
        self._call(self._session.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]
