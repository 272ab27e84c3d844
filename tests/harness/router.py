"""``pegaflow router`` itself and stand-in engines (tests/fakes/openai_engine.py), for the router's
tests and bench/router.py."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from tests.harness.engines import ns_http
from tests.harness.http import HTTP
from tests.harness.ports import free_port
from tests.harness.procs import REPO, stop_group
from tests.waiting import wait_until

START_TIMEOUT_S = 60.0


def wait_http(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = START_TIMEOUT_S,
              status: int = 200) -> None:
    """Until ``url`` answers ``status`` (bounded), failing early if the process exits."""

    def answers() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"exited {proc.returncode}: {log.read_text(errors='replace')[-3000:]}")
        return HTTP.get(url, timeout=2).status_code == status

    wait_until(answers, timeout, f"{url} to answer {status} (log {log})", ignore=httpx.HTTPError)


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus page's samples named ``name`` whose labels include ``labels``."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


LIVE: list[Proc] = []  # started and not stopped yet, in start order (stop_started_since)


class Proc:
    def __init__(self, cmd: list[str], log: Path, health: str | None) -> None:
        self.log = log
        with open(log, "ab") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
        LIVE.append(self)
        if health is not None:
            try:
                wait_http(health, self.proc, log)
            except BaseException:
                self.stop()
                raise

    def stop(self) -> None:
        stop_group(self.proc, 15)
        if self in LIVE:
            LIVE.remove(self)


@contextmanager
def stop_started_since() -> Iterator[None]:
    """Stops, at the end, every process this module started inside the block and has not
    stopped (a test that fails halfway, or whose router fails to start, leaves no engine)."""
    before = list(LIVE)
    try:
        yield
    finally:
        for p in reversed([p for p in LIVE if p not in before]):
            p.stop()


class FakeEngine(Proc):
    def __init__(self, logs: Path, name: str, *args: str) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        super().__init__([sys.executable, "-m", "tests.fakes.openai_engine", "--port", str(self.port),
                          "--name", name, *args], logs / f"engine-{name}.log", self.url + "/health")

    def served(self) -> list[dict[str, Any]]:
        return HTTP.get(self.url + "/_requests", timeout=5).json()


class RouterProc(Proc):
    def __init__(self, logs: Path, *args: str, name: str = "router", wait: bool = True) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        super().__init__([sys.executable, "-m", "pegaflow.cli", "router", "--host", "127.0.0.1", "--port",
                          str(self.port), "--health-interval", "0.2", "--log-format", "json", *args],
                         logs / f"{name}.log", self.url + "/health" if wait else None)

    def post(self, path: str, body: Any, **kw: Any) -> httpx.Response:
        return HTTP.post(self.url + path, json=body, timeout=60, **kw)

    def metric(self, name: str, **labels: str) -> float:
        return metric_sum(HTTP.get(self.url + "/metrics", timeout=5).text, name, **labels)


class NsRouter:
    """``pegaflow router`` in a host's network namespace (``tests.harness.netns.Host``),
    reached with ``curl`` run there (the test process stays in the root namespace)."""

    def __init__(self, host: Any, logs: Path, *args: str, name: str = "router") -> None:
        self.host = host
        self._http = ns_http
        self.url = f"http://{host.ip}:{free_port()}"
        self.log = logs / f"{name}.log"
        port = self.url.rsplit(":", 1)[1]
        with open(self.log, "ab") as f:
            self.proc = subprocess.Popen(
                host.argv([sys.executable, "-m", "pegaflow.cli", "router", "--host", host.ip, "--port", port,
                           "--health-interval", "1", "--log-format", "json", *args]),
                stdout=f, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)

    def wait_ready(self, tokenizer: bool = True, timeout: float = 120.0) -> NsRouter:
        """Until /health is 200 and (``tokenizer``: a kv-aware router) the tokenizer is
        loaded, so text prompts are hashed."""
        import json

        def ready() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited {self.proc.returncode}: {self.log.read_text()[-3000:]}")
            status, text = self._http(self.host, "GET", self.url + "/health", timeout=5)
            return status == 200 and (not tokenizer or json.loads(text).get("tokenizer") == "loaded")

        wait_until(ready, timeout, f"{self.url} to be ready with its tokenizer (log {self.log})", every=0.2)
        return self

    def post(self, path: str, body: Any, timeout: float = 300) -> tuple[int, str, dict[str, str]]:
        """(status, body, lower-cased headers)."""
        status, text = self._http(self.host, "POST", self.url + path, body, timeout, headers=True)
        head, _, payload = text.replace("\r\n", "\n").partition("\n\n")
        headers = {}
        for line in head.split("\n")[1:]:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
        return status, payload, headers

    def metric(self, name: str, **labels: str) -> float:
        status, text = self._http(self.host, "GET", self.url + "/metrics", timeout=10)
        assert status == 200, text
        return metric_sum(text, name, **labels)

    def stop(self) -> None:
        stop_group(self.proc, 15)
