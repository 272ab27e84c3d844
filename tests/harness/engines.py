"""vLLM engines for tests and benchmarks: an engine driven over pipes (``EngineProc``, the
process is tests/harness/engine_proc.py), vLLM's OpenAI server (``ApiServer``), a subscriber
to vLLM's KV events, and what a connector's namespace says about an engine's pages."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tests.harness.dirs import VLLM_RPC, vllm_rpc_dir
from tests.harness.node import Node
from tests.harness.ports import free_port
from tests.harness.procs import REPO, stop_group
from tests.waiting import next_line, wait_until

ENGINE_START_TIMEOUT_S = 240.0
COMMAND_TIMEOUT_S = 300.0


def namespace_block_size(namespace: str) -> int:
    """The block size (tokens) a connector's namespace records (``...|bs=N|...``)."""
    m = re.search(r"\|bs=(\d+)\|", namespace)
    assert m, f"no block size in namespace {namespace!r}"
    return int(m.group(1))


def namespace_page_bytes(namespace: str) -> int:
    """The page size (bytes) a connector's namespace records (``...|page=N|...``)."""
    m = re.search(r"\|page=(\d+)\|", namespace)
    assert m, f"no page size in namespace {namespace!r}"
    return int(m.group(1))


class EngineProc:
    """A vLLM engine (``tests.harness.engine_proc``) in a subprocess, talked to over pipes."""

    def __init__(
        self,
        model: Path,
        log_dir: Path,
        *,
        node: Node | None = None,
        connector: str = "pega",
        tp: int = 1,
        env: dict[str, str] | None = None,
        name: str = "engine",
        extra_args: list[str] | None = None,
        python: str | None = None,
        multiprocess: bool = False,
    ) -> None:
        """``multiprocess``: vLLM's default layout, the engine core (scheduler-side connector) and
        each worker in their own processes. Without it (and with ``tp == 1``) the engine core runs
        in this engine's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, a layout vLLM supports):
        the same connector code, two process starts fewer (~35 s less per engine on this
        machine, where each vLLM process spends ~17 s importing). The tests that depend on
        separate processes (the plugin found in each, tensor parallelism) ask for them."""
        self.log_path = log_dir / f"{name}-{int(time.time() * 1000)}.log"
        r, w = os.pipe()
        e = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false", VLLM_RPC: vllm_rpc_dir()}
        if node is not None:
            host, port = node.addr.rsplit(":", 1)
            e.update(PEGAFLOW_HOST=host, PEGAFLOW_PORT=port)
        if not multiprocess and tp == 1:
            e["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if tp > 1:
            e.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(tp)))
        e.update(env or {})
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the process
        self.proc = subprocess.Popen(
            [
                python or sys.executable, "-m", "tests.harness.engine_proc", "--model", str(model), "--connector", connector,
                "--tp", str(tp), "--result-fd", str(w), *(extra_args or []),
            ],
            stdin=subprocess.PIPE,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            pass_fds=(w,),
            cwd=REPO,
            env=e,
            start_new_session=True,
        )
        os.close(w)
        self._r = os.fdopen(r, "r")
        first = self._read(ENGINE_START_TIMEOUT_S)
        assert first.get("ready"), first
        self.block_size: int = int(first["block_size"])  # what vLLM chose for this engine
        self.hybrid_kv_cache: bool = bool(first.get("hybrid_kv_cache"))  # vLLM's hybrid KV cache manager is on

    def _read(self, timeout: float) -> dict[str, Any]:
        return json.loads(next_line(self._r, self.proc, timeout, "the engine's answer", tail=self.log_tail))

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def send(self, op: str, **kw: Any) -> None:
        """Send a command without waiting for its answer (see ``recv``)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"op": op, **kw}) + "\n").encode())
        self.proc.stdin.flush()

    def recv(self, timeout: float = COMMAND_TIMEOUT_S) -> dict[str, Any]:
        out = self._read(timeout)
        if "error" in out:
            raise RuntimeError(out["error"])
        return out

    def cmd(self, op: str, timeout: float = COMMAND_TIMEOUT_S, **kw: Any) -> dict[str, Any]:
        self.send(op, **kw)
        out = self._read(timeout)
        if "error" in out:
            raise RuntimeError(out["error"])
        return out

    def generate(self, prompts: list[list[int]], max_tokens: int = 8) -> list[dict[str, Any]]:
        return self.cmd("generate", prompts=prompts, max_tokens=max_tokens)["outputs"]

    def metrics(self) -> dict[str, float]:
        return self.cmd("metrics")["metrics"]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.cmd("quit", timeout=30)
            except Exception:  # noqa: BLE001
                pass
            stop_group(self.proc, 30, term=False)
        self._r.close()
        self._log.close()

    def __enter__(self) -> EngineProc:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class KVEventSubscriber:
    """A subscriber to vLLM's ZMQ KV-event publisher (what a KV-aware router runs):
    collects every decoded event in a background thread."""

    def __init__(self, port: int, topic: str = "kv-events") -> None:
        import threading

        import zmq

        self.endpoint = f"tcp://127.0.0.1:{port}"
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sock.setsockopt(zmq.RCVTIMEO, 200)
        self._sock.connect(self.endpoint)  # before the engine binds: zmq connects when it does
        self.events: list[Any] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="kv-event-sub")
        self._thread.start()

    def _run(self) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        dec = msgspec.msgpack.Decoder(type=KVEventBatch)
        while not self._stop.is_set():
            try:
                _topic, _seq, payload = self._sock.recv_multipart()
            except zmq.Again:
                continue
            batch = dec.decode(payload)
            with self._lock:
                self.events.extend(batch.events)

    def snapshot(self) -> list[Any]:
        with self._lock:
            return list(self.events)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close(0)
        self._ctx.term()


class ApiServer:
    """A vLLM OpenAI server (``vllm.entrypoints.openai.api_server``) in its own process group.

    ``start`` returns at once (several servers start side by side); ``wait_ready`` waits,
    bounded, for its ``/health``. ``extra`` is the connector's ``kv_connector_extra_config``;
    ``node`` (a Node or an address) None starts it without a KV connector. ``host`` (a
    ``tests.harness.netns.Host``) runs it in that host's network namespace, on its
    address; it is then reached with ``curl`` run there (``post``). ``args``: more server flags; ``env``: more environment."""

    START_TIMEOUT_S = 420.0

    def __init__(self, model: Path, logs: Path, name: str, node: Node | str | None,
                 extra: dict[str, Any] | None = None, max_model_len: int = 2048, host: Any = None,
                 args: list[str] | None = None, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.model = str(model)
        self.host = host
        ip = host.ip if host is not None else "127.0.0.1"
        self.port = free_port()  # in a fresh namespace too: free there if free here
        self.url = f"http://{ip}:{self.port}"
        self.log_path = logs / f"api-{name}-{self.port}.log"
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
               "--dtype", "float16", "--host", ip, "--port", str(self.port),
               "--max-model-len", str(max_model_len), "--enforce-eager", "--no-enable-prefix-caching",
               "--enable-prompt-tokens-details", "--seed", "0", *(args or [])]
        if node is not None:
            addr = node if isinstance(node, str) else node.addr
            cfg = {"kv_connector": "PegaKVConnector", "kv_role": "kv_both",
                   "kv_connector_module_path": "pegaflow.connector",
                   "kv_connector_extra_config": {"pegaflow.addr": addr, **(extra or {})}}
            cmd += ["--kv-transfer-config", json.dumps(cfg)]
        if host is not None:
            cmd = host.argv(cmd)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
                                         env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1",
                                              "TOKENIZERS_PARALLELISM": "false", VLLM_RPC: vllm_rpc_dir(),
                                              **(env or {})})

    def _status(self, path: str) -> int:
        if self.host is None:
            try:
                with urllib.request.urlopen(self.url + path, timeout=2) as r:
                    return r.status
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                return 0
        status, _ = ns_http(self.host, "GET", self.url + path, timeout=5)
        return status

    def wait_ready(self) -> ApiServer:
        def healthy() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.log_path.read_text(errors='replace')[-3000:]}")
            return self._status("/health") == 200

        wait_until(healthy, self.START_TIMEOUT_S, f"{self.name} to start (log {self.log_path})", every=0.5)
        return self

    def post(self, path: str, body: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
        if self.host is not None:
            status, text = ns_http(self.host, "POST", self.url + path, body, timeout)
            assert status == 200, f"{self.name} answered {status}: {text[:500]}"
            return json.loads(text)
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        stop_group(self.proc, 30)


def ns_http(host: Any, method: str, url: str, body: Any = None, timeout: float = 60,
            headers: bool = False) -> tuple[int, str]:
    """One HTTP request made with ``curl`` from ``host``'s network namespace (a
    ``tests.harness.netns.Host``): (status, body), status 0 when it could not connect.
    With ``headers``, the body is preceded by the response's header lines."""
    cmd = ["curl", "-sS", "-X", method, "--max-time", str(timeout), "-w", "\n%{http_code}"]
    if headers:
        cmd.append("-i")
    if body is not None:
        # (no "Expect: 100-continue": its interim answer would precede the real one)
        cmd += ["-H", "Content-Type: application/json", "-H", "Expect:", "--data-binary", "@-"]
    r = host.run([*cmd, url], timeout=timeout + 10, input=None if body is None else json.dumps(body))
    text, _, code = r.stdout.rpartition("\n")
    return (int(code) if code.isdigit() else 0), text
