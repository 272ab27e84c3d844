"""``pegaflow router`` as a real process in front of real HTTP servers standing in for vLLM
(tests/fakes/openai_engine.py) and real nodes: routing, streaming, retries, disaggregation's
protocol, bad input. The same router in front of real vLLM engines: tests/e2e/test_router_vllm.py."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import xxhash

from pegaflow.client import PegaClient
from pegaflow.core.identity import block_hashes
from pegaflow.core.router_protocol import ROUTER_KEY
from tests.harness.http import HTTP
from tests.harness.models import build_tokenizer, make_text
from tests.harness.node import Node
from tests.harness.router import FakeEngine, RouterProc, stop_started_since
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

MODEL = "fake-model"
BS = 4  # the fake engines' block size (they report it; the router reads it)
ROOT = f"pf1|{MODEL}|bs={BS}"  # the fake engines' namespace root
PAGE = 4096


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("router")


@pytest.fixture(autouse=True)
def _stop_what_the_test_started() -> Iterator[None]:
    with stop_started_since():
        yield


@pytest.fixture(scope="module")
def two_nodes(logs: Path) -> Iterator[list[Node]]:
    nodes = [Node(logs, "64mb", http=False, extra=["--node-id", f"node-{c}"]).start() for c in "ab"]
    yield nodes
    for n in nodes:
        n.stop()


def store(node: Node, tokens: list[int], root: str = ROOT) -> int:
    """Make ``node`` hold every full block of ``tokens`` in a fake engine's namespace (``root``:
    that of the engines serving ``fake-model``)."""
    hashes = block_hashes(xxhash.xxh3_128_digest(root.encode()), tokens, BS)
    c = PegaClient(node.addr, map_pool=False)
    try:
        c.register({root: PAGE})
        r = c.reserve(root, hashes)
        return c.commit(r.reservation_id)
    finally:
        c.close()


def tokens(seed: int, n: int = 10 * BS + 1) -> list[int]:
    return [(seed * 131 + i) % 900 + 1 for i in range(n)]


def completion(prompt: object, **kw: object) -> dict[str, object]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 3, **kw}


def test_kv_aware_sends_a_prefix_to_the_engine_whose_node_holds_it(logs: Path, two_nodes: list[Node]) -> None:
    a, b = two_nodes
    ea = FakeEngine(logs, "ea", "--node", "node-a", "--node-addr", a.addr, "--block-size", str(BS))
    eb = FakeEngine(logs, "eb", "--node", "node-b", "--node-addr", b.addr, "--block-size", str(BS))
    router = RouterProc(logs, "--engine", ea.url, eb.url, "--policy", "kv-aware", "--hint-timeout", "2")
    p_b, p_a = tokens(1), tokens(2)
    assert store(b, p_b) == 10 and store(a, p_a) == 10
    for _ in range(3):  # one at a time: no queue, so only the prefix decides
        r = router.post("/v1/completions", completion(p_b))
        assert r.status_code == 200, r.text
        assert r.headers["x-pegaflow-engine"] == eb.url
        assert r.headers["x-pegaflow-prefix-hint"] == "used"
        assert router.post("/v1/completions", completion(p_a)).headers["x-pegaflow-engine"] == ea.url
    assert len(eb.served()) == 3 and len(ea.served()) == 3
    # Predicted hit: every loadable block (never the last token's) of every request.
    assert router.metric("pegaflow_router_prefix_tokens_total") == 6 * 10 * BS
    assert router.metric("pegaflow_router_hint_fallbacks_total") == 0
    # The loads the last choice saw (requests routed in the last minute), within the bound:
    # nothing was sent away from its holder.
    assert router.metric("pegaflow_router_engine_load", engine=ea.url) == 2
    assert router.metric("pegaflow_router_engine_load", engine=eb.url) == 3
    assert router.metric("pegaflow_router_load_redirects_total") == 0
    # Text with no tokenizer to hash it: no prefix answer, routed by load, and the answer says so.
    r = router.post("/v1/completions", completion("a text prompt: the fake engines have no tokenizer"))
    assert r.status_code == 200 and r.headers["x-pegaflow-prefix-hint"] == "none", r.headers
    assert router.metric("pegaflow_router_hint_fallbacks_total", reason="no_tokens") == 1
    # The tokenizer's library (seconds of import, under the GIL) came in before the router
    # served, not under traffic.
    events = [json.loads(line).get("event") for line in router.log.read_text().splitlines()
              if line.startswith("{")]
    assert events.index("tokenizer_library_imported") < events.index("router_started"), events
    # Nothing the router asked changed the nodes: peeks take no lease and count no access.
    for n in (a, b):
        st = n.stats()
        assert st.active_leases == 0 and st.hits == 0 and st.misses == 0


@pytest.fixture(scope="module")
def two_tokenizers(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two models' tokenizers that split the same text otherwise (other vocabularies)."""
    out = tmp_path_factory.mktemp("tokenizers")
    small, large = out / "model-small", out / "model-large"
    build_tokenizer(small, vocab=300)
    build_tokenizer(large, vocab=2000)
    return small, large


def test_each_models_text_is_tokenized_with_that_models_tokenizer(
    logs: Path, two_nodes: list[Node], two_tokenizers: tuple[Path, Path]
) -> None:
    """A router before engines of two models loaded only the first engine's tokenizer and
    hashed the other model's prompts with it: their prefixes were never found."""
    from transformers import AutoTokenizer

    a, b = two_nodes
    small, large = two_tokenizers
    ea = FakeEngine(logs, "tok-small", "--node", "node-a", "--node-addr", a.addr, "--block-size", str(BS),
                    "--model", str(small))
    eb = FakeEngine(logs, "tok-large", "--node", "node-b", "--node-addr", b.addr, "--block-size", str(BS),
                    "--model", str(large))
    router = RouterProc(logs, "--engine", ea.url, eb.url, "--policy", "kv-aware", "--hint-timeout", "2",
                        name="router-two-models")
    wait_until(lambda: HTTP.get(router.url + "/health", timeout=5).json()["tokenizers"]
               == {str(small): "loaded", str(large): "loaded"}, 60, "both models' tokenizers to load")
    assert HTTP.get(router.url + "/health", timeout=5).json()["tokenizer"] == "loaded"
    expected = 0
    for i, (model, node, engine) in enumerate(((small, a, ea), (large, b, eb))):
        text = make_text(40, seed=100 + i)
        ids = AutoTokenizer.from_pretrained(model)(text).input_ids  # as vLLM tokenizes a completion
        held = store(node, ids, root=f"pf1|{model}|bs={BS}")
        assert held >= 2
        r = router.post("/v1/completions", {**completion(text), "model": str(model)})
        assert r.status_code == 200 and r.headers["x-pegaflow-engine"] == engine.url, r.headers
        expected += min(held, (len(ids) - 1) // BS) * BS  # every loadable block (never the last token's)
        assert router.metric("pegaflow_router_prefix_tokens_total") == expected, model


def test_kv_aware_bounds_the_holders_share_of_a_popular_prefix(logs: Path, two_nodes: list[Node]) -> None:
    """Every request shares one prefix, held by b's node: routing by prefix alone would send b
    all of them; the bound (--load-bound 0.15, requests in the last minute) gives b at most
    ceil(1.15 x (routed + 1) / 2) at each choice, and the overflow goes to a."""
    a, b = two_nodes
    ea = FakeEngine(logs, "bound-a", "--node", "node-a", "--node-addr", a.addr, "--block-size", str(BS))
    eb = FakeEngine(logs, "bound-b", "--node", "node-b", "--node-addr", b.addr, "--block-size", str(BS))
    # --skip-tokenizer-init: token-id prompts are routed by prefix all the same, and the
    # router imports no tokenizer library (~3 s of CPU).
    router = RouterProc(logs, "--engine", ea.url, eb.url, "--policy", "kv-aware", "--hint-timeout", "2",
                        "--load-bound", "0.15", "--skip-tokenizer-init", name="router-bound")
    popular = tokens(7)
    assert store(b, popular) == 10
    to_b = 0
    for k in range(20):
        r = router.post("/v1/completions", completion(popular))
        assert r.status_code == 200, r.text
        to_b += r.headers["x-pegaflow-engine"] == eb.url
        assert to_b <= -(-1.15 * (k + 1) // 2) + 1  # the cap at this choice, this request counted
    assert 10 <= to_b <= 12 and len(ea.served()) == 20 - to_b
    assert router.metric("pegaflow_router_load_redirects_total") >= 1
    assert router.metric("pegaflow_router_hint_fallbacks_total") == 0
    assert HTTP.get(router.url + "/health", timeout=5).json()["tokenizer"] == "skipped"
    events = {json.loads(line).get("event") for line in router.log.read_text().splitlines() if line.startswith("{")}
    assert "router_started" in events and not events & {"tokenizer_library_imported", "tokenizer_loaded"}, events


def test_round_robin_ignores_the_prefix(logs: Path, two_nodes: list[Node]) -> None:
    a, b = two_nodes
    ea = FakeEngine(logs, "rr-a", "--node", "node-a", "--node-addr", a.addr, "--block-size", str(BS))
    eb = FakeEngine(logs, "rr-b", "--node", "node-b", "--node-addr", b.addr, "--block-size", str(BS))
    router = RouterProc(logs, "--engine", f"{ea.url},{eb.url}", "--policy", "round-robin", name="router-rr")
    p = tokens(3)
    store(b, p)
    got = [router.post("/v1/completions", completion(p)).headers["x-pegaflow-engine"] for _ in range(4)]
    assert sorted(got) == sorted([ea.url, eb.url] * 2)


@pytest.fixture(scope="module")
def good_and_bad(logs: Path) -> Iterator[tuple[FakeEngine, RouterProc, RouterProc]]:
    """A good engine, and two routers that each also have a failing one: answering 500, or
    crashing with the request unanswered."""
    with stop_started_since():
        good = FakeEngine(logs, "good")
        failing = FakeEngine(logs, "failing", "--fail", "500")
        resetting = FakeEngine(logs, "crashing", "--fail", "crash")
        r500 = RouterProc(logs, "--engine", good.url, failing.url, "--policy", "round-robin", name="router-500")
        reset = RouterProc(logs, "--engine", good.url, resetting.url, "--policy", "round-robin", name="router-reset")
        yield good, r500, reset


@pytest.mark.parametrize("which", [1, 2], ids=["http-500", "engine-crash"])
def test_a_request_that_fails_before_streaming_is_retried_on_another_engine(good_and_bad, which: int) -> None:  # noqa: ANN001
    good, router = good_and_bad[0], good_and_bad[which]
    for i in range(6):
        r = router.post("/v1/completions", completion(f"hello {i}", stream=i % 2 == 1))
        assert r.status_code == 200, r.text
        assert r.headers["x-pegaflow-engine"] == good.url
    assert router.metric("pegaflow_router_retries_total") >= 1
    assert router.metric("pegaflow_router_requests_total", outcome="ok") == 6


def test_a_streamed_answer_is_relayed_chunk_by_chunk(good_and_bad) -> None:  # noqa: ANN001
    router = good_and_bad[1]
    with httpx.stream("POST", router.url + "/v1/chat/completions", timeout=30,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                            "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    words = [json.loads(e[6:])["choices"][0]["delta"]["content"] for e in events[:-1]]
    assert words == [f"good-{i}" for i in range(4)]


@pytest.mark.parametrize(("body", "status", "needle"), [
    (b"{not json", 400, "invalid JSON"),
    (json.dumps({"model": MODEL}).encode(), 400, "'prompt' is required"),
    (json.dumps({"model": MODEL, "prompt": "x", "stream": "yes"}).encode(), 400, "'stream' must be a boolean"),
    (json.dumps({"model": "no-such-model", "prompt": "x"}).encode(), 404, "does not exist"),
    # Python parses NaN; JSON (and so the router's request to the engine) has none: it held the
    # engine's in-flight count up for good, and answered 500.
    (b'{"model": "fake-model", "prompt": "x", "temperature": NaN}', 400, "NaN or Infinity"),
])
def test_bad_requests_get_the_openai_error_shape(good_and_bad, body: bytes, status: int, needle: str) -> None:  # noqa: ANN001
    router = good_and_bad[1]
    r = HTTP.post(router.url + "/v1/completions", content=body, timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == status
    err = r.json()["error"]
    assert needle in err["message"] and err["code"] == status and "type" in err
    good = good_and_bad[0]
    assert router.metric("pegaflow_router_in_flight", engine=good.url) == 0


def test_a_header_the_router_cannot_forward_is_a_400_that_holds_no_load(good_and_bad) -> None:  # noqa: ANN001
    good, router = good_and_bad[0], good_and_bad[1]
    r = HTTP.post(router.url + "/v1/completions", content=json.dumps(completion("x")).encode(), timeout=10,
                  headers={"content-type": "application/json", "x-request-id": "café".encode("latin-1")})
    assert r.status_code == 400 and "ASCII" in r.json()["error"]["message"]
    assert router.metric("pegaflow_router_in_flight", engine=good.url) == 0


def test_models_and_metrics_are_served(good_and_bad) -> None:  # noqa: ANN001
    router = good_and_bad[1]
    models = HTTP.get(router.url + "/v1/models", timeout=5).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    text = HTTP.get(router.url + "/metrics", timeout=5).text
    assert "pegaflow_router_engine_up" in text and "pegaflow_router_ttft_seconds" in text
    # Its event loop's lag is sampled (every 100 ms) from the start.
    wait_until(lambda: router.metric("pegaflow_router_event_loop_lag_seconds_count") >= 2, 10,
               "the router's loop lag to be sampled")


def test_a_5xx_whose_body_breaks_off_is_tried_on_another_engine(logs: Path) -> None:
    """Reading the broken body failed, and the answer's content was then read anyway:
    ResponseNotRead, a 500 of the router's own, and no second engine tried."""
    bad, good = FakeEngine(logs, "broken5xx", "--fail", "500-broken"), FakeEngine(logs, "fine5xx")
    router = RouterProc(logs, "--engine", bad.url, good.url, "--policy", "round-robin", "--skip-tokenizer-init",
                        name="router-5xx")
    for i in range(4):  # each engine's turn comes: every request ends on the good one
        r = router.post("/v1/completions", completion(f"p{i}"))
        assert r.status_code == 200 and r.headers["x-pegaflow-engine"] == good.url


def test_a_stream_the_engine_breaks_off_ends_with_an_error_event(logs: Path) -> None:
    """A stream that just stopped would read as a whole, shorter answer to the client."""
    e = FakeEngine(logs, "mid", "--fail", "midstream")
    router = RouterProc(logs, "--engine", e.url, "--skip-tokenizer-init", name="router-mid")
    r = router.post("/v1/completions", {**completion("x", max_tokens=4), "stream": True})
    events = [line for line in r.text.splitlines() if line.startswith("data:")]
    assert len(events) == 2 and "[DONE]" not in events[-1], events
    assert json.loads(events[-1][5:])["error"]["code"] == 502


def test_an_engine_slower_than_the_request_timeout_stays_in_rotation_and_runs_it_once(logs: Path) -> None:
    """A read timeout is an engine at work (a long generation, a long queue): taking it out
    of rotation and running the request again elsewhere doubled the work, for a 502."""
    es = [FakeEngine(logs, f"slow{i}", "--delay", "3") for i in range(2)]
    router = RouterProc(logs, "--engine", *(e.url for e in es), "--policy", "round-robin", "--request-timeout", "1",
                        "--skip-tokenizer-init", name="router-slow")
    r = router.post("/v1/completions", completion("x", max_tokens=1))
    assert r.status_code == 504 and "--request-timeout" in r.json()["error"]["message"]
    wait_until(lambda: sum(len(e.served()) for e in es) >= 1, 10, "the engine to have the request")
    assert sum(len(e.served()) for e in es) == 1, "run on a second engine"
    assert all(router.metric("pegaflow_router_engine_up", engine=e.url) == 1 for e in es)
    assert router.metric("pegaflow_router_slow_answers_total") == 1


def test_engines_behind_an_api_key_come_into_rotation_with_the_routers_key(logs: Path) -> None:
    """vLLM's --api-key guards /v1: the router's own checks (/v1/models, the describe probe)
    carry --engine-api-key; clients' requests carry their own key, never the router's."""
    e = FakeEngine(logs, "keyed", "--api-key", "k3y")
    router = RouterProc(logs, "--engine", e.url, "--engine-api-key", "k3y", "--skip-tokenizer-init",
                        name="router-key")
    assert router.post("/v1/completions", completion("x"), headers={"authorization": "Bearer k3y"}).status_code == 200
    assert router.post("/v1/completions", completion("x")).status_code == 401, "the router lent a client its key"


def test_a_second_served_name_and_an_adapter_loaded_later_are_served(logs: Path) -> None:
    """vLLM's --served-model-name a b lists two base models; an adapter loaded at run time
    (/v1/load_lora_adapter) appears in /v1/models later: both were a 404 at the router."""
    e = FakeEngine(logs, "alias", "--alias", "fake-alias")
    router = RouterProc(logs, "--engine", e.url, "--skip-tokenizer-init", name="router-alias")
    assert router.post("/v1/completions", {**completion("x"), "model": "fake-alias"}).status_code == 200
    assert HTTP.post(e.url + "/_adapters", json={"name": "sql", "root": "/adapters/sql"}, timeout=5).status_code == 200
    wait_until(lambda: router.post("/v1/completions", {**completion("x"), "model": "sql"}).status_code == 200, 10,
               "the adapter loaded later to be served")


def test_a_client_that_goes_away_before_its_answer_frees_the_engine(logs: Path) -> None:
    """A client that stopped waiting (its timeout, a retry): vLLM aborts a request whose
    connection closes; through the router the engine's connection stayed open and the
    request ran to its end, counted in flight all along."""
    e = FakeEngine(logs, "gone", "--delay", "6")
    router = RouterProc(logs, "--engine", e.url, "--skip-tokenizer-init", name="router-gone")
    with pytest.raises(httpx.ReadTimeout):
        HTTP.post(router.url + "/v1/completions", json=completion("x", max_tokens=1), timeout=0.5)
    wait_until(lambda: router.metric("pegaflow_router_in_flight", engine=e.url) == 0, 3,
               "the router to let go of the request", every=0.05)
    wait_until(lambda: router.metric("pegaflow_router_requests_total", endpoint="/v1/completions",
                                     outcome="cancelled") == 1, 3, "the request counted cancelled")


def test_an_engine_that_stops_answering_leaves_rotation_and_returns(logs: Path) -> None:
    e1, e2 = FakeEngine(logs, "k1"), FakeEngine(logs, "k2")
    router = RouterProc(logs, "--engine", e1.url, e2.url, "--policy", "round-robin", "--backoff-max", "1",
                        name="router-kill")
    e2.proc.kill()
    e2.proc.wait()
    for i in range(6):  # none fails: the dead engine's refusal is retried on e1
        r = router.post("/v1/completions", completion(f"p{i}"))
        assert r.status_code == 200 and r.headers["x-pegaflow-engine"] == e1.url
    assert router.metric("pegaflow_router_engine_up", engine=e2.url) == 0


def test_disaggregation_sends_the_prompt_to_prefill_then_the_stored_count_to_decode(logs: Path) -> None:
    p = FakeEngine(logs, "p0", "--block-size", str(BS))
    d = FakeEngine(logs, "d0", "--block-size", str(BS))
    router = RouterProc(logs, "--prefill", p.url, "--decode", d.url, "--skip-tokenizer-init", name="router-pd")
    prompt = tokens(9)
    r = router.post("/v1/completions", completion(prompt, max_tokens=5, stream=True))
    assert r.status_code == 200 and r.headers["x-pegaflow-engine"] == d.url
    (pre,) = p.served()
    assert pre["max_tokens"] == 1 and pre["stream"] is False
    assert pre["kv_transfer_params"] == {ROUTER_KEY: {"prefill": True}}
    (dec,) = d.served()
    assert dec["max_tokens"] == 5 and dec["stream"] is True and dec["prompt"] == prompt
    assert dec["kv_transfer_params"] == {ROUTER_KEY: {"expect_blocks": len(prompt) // BS}}
    assert [line for line in r.text.splitlines() if line.startswith("data:")][-1] == "data: [DONE]"


@pytest.mark.parametrize("policy", ["round-robin", "least-loaded"])
def test_disaggregation_spreads_over_every_prefill_and_decode_engine(logs: Path, policy: str) -> None:
    """One turn shared by both halves advanced twice a request: the prefill half always
    chose the first engine and the decode half the second."""
    ps = [FakeEngine(logs, f"p{i}-{policy}", "--block-size", str(BS)) for i in range(2)]
    ds = [FakeEngine(logs, f"d{i}-{policy}", "--block-size", str(BS)) for i in range(2)]
    router = RouterProc(logs, "--prefill", *(e.url for e in ps), "--decode", *(e.url for e in ds), "--policy", policy,
                        "--skip-tokenizer-init", name=f"router-pd-{policy}")
    for i in range(4):
        assert router.post("/v1/completions", completion(tokens(20 + i), max_tokens=2)).status_code == 200
    assert [len(e.served()) for e in ps] == [2, 2] and [len(e.served()) for e in ds] == [2, 2]


@pytest.mark.parametrize(("argv", "needle"), [
    ([], "no engines"),
    (["--prefill", "http://127.0.0.1:1"], "needs at least one --prefill and one --decode"),
    (["--engine", "http://a:1", "--decode", "http://b:1", "--prefill", "http://c:1"], "not both"),
    (["--engine", "ftp://a:1"], "is not http://HOST:PORT"),
    (["--policy", "random", "--engine", "http://a:1"], "--policy"),
])
def test_bad_flags_exit_with_one_line(argv: list[str], needle: str) -> None:
    r = subprocess.run([sys.executable, "-m", "pegaflow.cli", "router", *argv], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], r.stderr


@pytest.mark.parametrize("where", ["unresolvable", "taken"])
def test_an_address_the_router_cannot_listen_on_is_one_line_before_it_starts(where: str) -> None:
    """The router bound its port after its startup: a host that does not resolve logged
    router_started, then uvicorn's ERROR, and exited 3."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        host, port = ("no-such-host.invalid", "8000") if where == "unresolvable" else \
            ("127.0.0.1", str(taken.getsockname()[1]))
        r = subprocess.run([sys.executable, "-m", "pegaflow.cli", "router", "--host", host, "--port", port,
                            "--engine", "http://127.0.0.1:9", "--skip-tokenizer-init"],
                           capture_output=True, text=True, timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert lines[0].startswith(f"pegaflow router: error: cannot listen on {host}:{port}: "), lines[0]
    assert "router_started" not in r.stdout + r.stderr


def test_no_engine_up_is_503_not_a_hang(logs: Path) -> None:
    dead = "http://127.0.0.1:9"  # discard port: refused
    router = RouterProc(logs, "--engine", dead, "--skip-tokenizer-init", name="router-none", wait=False)
    r = wait_until(lambda: HTTP.get(router.url + "/health", timeout=2), 30, "the router to answer /health",
                   ignore=httpx.HTTPError)
    assert r.status_code == 503
    r = router.post("/v1/completions", completion("x"))
    assert r.status_code == 503 and r.json()["error"]["code"] == 503


@pytest.fixture
def silent_hub() -> Iterator[socket.socket]:
    """A Hub that accepts connections and never answers."""
    with socket.create_server(("127.0.0.1", 0)) as hub:
        yield hub


def test_a_router_still_loading_its_tokenizer_stops_at_once(
    logs: Path, monkeypatch: pytest.MonkeyPatch, silent_hub: socket.socket
) -> None:
    """SIGTERM while the tokenizer's files are still being fetched (here from a Hub that
    accepts the connection and never answers): the router exits at once, with 0. It used to
    wait for the fetch and its retries (asyncio's executor threads are joined at exit)."""
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{silent_hub.getsockname()[1]}")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    engine = FakeEngine(logs, "tok-e0")
    router = RouterProc(logs, "--engine", engine.url, "--policy", "kv-aware", "--tokenizer", "no-org/no-model",
                        name="router-tokenizer")
    wait_until(lambda: HTTP.get(router.url + "/health", timeout=5).json()["tokenizer"] == "loading", 30,
               "the router to start loading its tokenizer")
    router.proc.terminate()
    assert router.proc.wait(timeout=5) == 0, router.log.read_text()[-2000:]


def test_without_the_router_extra_the_command_is_one_line(tmp_path: Path) -> None:
    """httpx (or fastapi, uvicorn) missing was a ModuleNotFoundError traceback."""
    shadow = tmp_path / "shadow" / "httpx"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('No module named httpx (test shadow)')\n")
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-m", "pegaflow.cli", "router", "--engine", "http://127.0.0.1:9"],
                       env={"PYTHONPATH": f"{shadow.parent}:{root}", "PATH": "/usr/bin:/bin"}, capture_output=True,
                       text=True, timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "pegaflow[router]" in lines[0], r.stderr[-2000:]
