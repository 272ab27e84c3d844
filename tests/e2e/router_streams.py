"""Streams through a router, one engine killed once a stream on it has started (run by
tests/e2e/test_router_vllm.py in the router's network namespace).

    python -m tests.e2e.router_streams ROUTER_URL MODEL VICTIM_URL VICTIM_PID

Opens 6 streamed completions; as soon as one streamed from VICTIM_URL has its first chunk,
SIGKILLs VICTIM_PID (the victim's API server) and opens 4 more. Prints one JSON line: a
list of [request index, started streaming, completed, engine] per request; the
requests opened after the kill are numbered from 10.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys

import httpx

from tests.harness.models import make_text

FIRST, LATER = 6, 4
KILL_TIMEOUT_S = 120.0


async def main(router: str, model: str, victim: str, pid: int) -> list[tuple[int, bool, bool, str]]:
    outcomes: list[tuple[int, bool, bool, str]] = []
    victim_streaming = asyncio.Event()

    async def one(client: httpx.AsyncClient, i: int) -> None:
        started = done = False
        engine = ""
        body = {"model": model, "prompt": make_text(300, 300 + i), "max_tokens": 32, "temperature": 0,
                "stream": True}
        try:
            async with client.stream("POST", router + "/v1/completions", json=body) as r:
                engine = r.headers.get("x-pegaflow-engine", "")
                if r.status_code != 200:
                    await r.aread()
                else:
                    async for line in r.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            started = True
                            if engine == victim:
                                victim_streaming.set()
                        if line == "data: [DONE]":
                            done = True
        except httpx.HTTPError:
            pass
        outcomes.append((i, started, done, engine))

    async with httpx.AsyncClient(timeout=300) as client:
        first = [asyncio.create_task(one(client, i)) for i in range(FIRST)]
        await asyncio.wait_for(victim_streaming.wait(), KILL_TIMEOUT_S)
        os.kill(pid, signal.SIGKILL)  # the API server: its connections drop at once
        later = [asyncio.create_task(one(client, 10 + i)) for i in range(LATER)]
        await asyncio.gather(*first, *later)
    return outcomes


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])))))
