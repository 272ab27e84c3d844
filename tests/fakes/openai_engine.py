"""A stand-in for a vLLM OpenAI server, for the router's fast tests (a real HTTP server).

It answers what the router uses: ``/health``, ``/v1/models``, ``/metrics`` (vLLM's queue
gauges), and ``/v1/completions`` / ``/v1/chat/completions``, streamed (SSE, one chunk per
"token") or not. It answers a PegaFlow describe probe as the connector would, with the
node named on its command line. ``GET /_requests`` lists the bodies it served.
Failure modes (``--fail``): ``500`` answers every completion with HTTP 500; ``crash``
exits the process at its first completion, with the request's connection open;
``midstream`` exits after a streamed answer's first chunk; ``500-broken`` answers 500 with a
body that breaks off.

    python -m tests.fakes.openai_engine --port P --name e0 --node node-0 --node-addr 127.0.0.1:50055

Its namespace root is ``pf1|<model>|bs=<block size>`` (page bytes 4096): a test stores blocks
under it on a real node to make that node "hold" a prefix.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pegaflow.core.router_protocol import DESCRIBE_VERSION, ROUTER_KEY


def build(name: str, node: str, block_size: int, fail: str, model: str, delay: float,
          node_addr: str = "127.0.0.1:1", api_key: str = "", alias: str = "") -> FastAPI:
    app = FastAPI()
    served: list[dict[str, Any]] = []
    root = f"pf1|{model}|bs={block_size}"
    names = {model, *([alias] if alias else [])}  # vLLM's --served-model-name model alias
    adapters: dict[str, str] = {}  # LoRA adapters loaded (POST /_adapters): name -> path

    if api_key:  # (only then: the middleware relays a stream through a buffer of its own)
        @app.middleware("http")
        async def key(request: Request, call_next):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN202
            # vLLM's --api-key: everything under /v1 needs it; /health and /metrics do not.
            if request.url.path.startswith("/v1") and request.headers.get("authorization") != f"Bearer {api_key}":
                return JSONResponse({"error": "Unauthorized"}, status_code=401)
            return await call_next(request)

    def describe(body: dict[str, Any]) -> dict[str, Any]:
        n = len(body["prompt"]) if isinstance(body.get("prompt"), list) else 0
        return {ROUTER_KEY: {"version": DESCRIBE_VERSION, "node": node, "node_addr": node_addr, "root": root,
                             "namespaces": [root], "page_bytes": 4096, "block_size": block_size,
                             "mode": "read_write", "prompt_blocks": n // block_size,
                             "stored_blocks": n // block_size}}

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> Response:
        cards = [{"id": n, "object": "model", "root": model, "parent": None} for n in sorted(names)]
        cards += [{"id": n, "object": "model", "root": path, "parent": model} for n, path in adapters.items()]
        return JSONResponse({"object": "list", "data": cards})

    @app.post("/_adapters")
    async def add_adapter(request: Request) -> Response:
        body = await request.json()
        adapters[str(body["name"])] = str(body["root"])
        return JSONResponse({})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response("# TYPE vllm:num_requests_running gauge\n"
                        f'vllm:num_requests_running{{model_name="{model}"}} 0.0\n'
                        "# TYPE vllm:num_requests_waiting gauge\n"
                        f'vllm:num_requests_waiting{{model_name="{model}"}} 0.0\n')

    @app.get("/_requests")
    async def requests() -> Response:
        return JSONResponse(served)

    async def complete(request: Request, chat: bool) -> Response:
        body = await request.json()
        if body.get("model") not in names and body.get("model") not in adapters:
            return JSONResponse({"error": {"message": "no such model", "type": "NotFoundError", "code": 404}},
                                status_code=404)
        probe = (body.get("kv_transfer_params") or {}).get(ROUTER_KEY, {}).get("describe")
        if not probe:
            if fail == "500":
                return JSONResponse({"error": {"message": f"{name} fails", "type": "InternalServerError",
                                               "code": 500}}, status_code=500)
            if fail == "crash":
                os._exit(1)  # the connection drops with the request unanswered
            if fail == "500-broken":
                async def broken():  # noqa: ANN202
                    yield b'{"error": '
                    raise RuntimeError("the body breaks off")  # uvicorn drops the connection

                return StreamingResponse(broken(), status_code=500, media_type="application/json",
                                         headers={"content-length": "100"})
            served.append(body)
        n = int(body.get("max_tokens") or 4)
        words = [f"{name}-{i}" for i in range(n)]
        params = describe(body) if body.get("kv_transfer_params") else None
        if not body.get("stream"):
            await asyncio.sleep(delay)
            choice = ({"message": {"role": "assistant", "content": " ".join(words)}} if chat
                      else {"text": " ".join(words)})
            return JSONResponse({"id": "x", "object": "chat.completion" if chat else "text_completion",
                                 "model": model, "choices": [{"index": 0, **choice, "finish_reason": "length"}],
                                 "kv_transfer_params": params})

        async def events():  # noqa: ANN202
            for i, w in enumerate(words):
                if i == 1 and fail == "midstream" and not probe:
                    os._exit(1)  # the stream breaks off after its first chunk
                await asyncio.sleep(delay)
                delta = {"delta": {"content": w}} if chat else {"text": w}
                yield f"data: {json.dumps({'choices': [{'index': 0, **delta}]})}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await complete(request, False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await complete(request, True)

    return app


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--node", default="node-0")
    p.add_argument("--block-size", type=int, default=4)
    p.add_argument("--fail", default="", choices=["", "500", "crash", "midstream", "500-broken"])
    p.add_argument("--model", default="fake-model")
    p.add_argument("--delay", type=float, default=0.0)
    p.add_argument("--node-addr", default="127.0.0.1:1")
    p.add_argument("--api-key", default="")
    p.add_argument("--alias", default="")
    a = p.parse_args()
    uvicorn.run(build(a.name, a.node, a.block_size, a.fail, a.model, a.delay, a.node_addr, a.api_key, a.alias), host="127.0.0.1",
                port=a.port, log_level="warning")


if __name__ == "__main__":
    main()
