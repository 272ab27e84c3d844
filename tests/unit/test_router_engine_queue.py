"""The router reads an engine's queue (vLLM's running + waiting gauges) from its /metrics
without parsing the rest of it."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pegaflow.router.engines import QUEUE_METRICS, engine_queue


def full_parse(text: str) -> int:
    """The oracle: every family parsed, as the router did before."""
    return int(sum(s.value for fam in text_string_to_metric_families(text) if fam.name in QUEUE_METRICS
                   for s in fam.samples))


def vllm_like(running: dict[str, float], waiting: dict[str, float]) -> str:
    """An exposition shaped like vLLM's: the two gauges per engine among histograms, and
    lookalike names and awkward label values that must not count."""
    reg = CollectorRegistry()
    run = Gauge("vllm:num_requests_running", "running", ["engine", "model_name"], registry=reg)
    wait = Gauge("vllm:num_requests_waiting", "waiting", ["engine", "model_name"], registry=reg)
    for eng, v in running.items():
        run.labels(eng, 'tiny "llama" } 7.0').set(v)
    for eng, v in waiting.items():
        wait.labels(eng, "m").set(v)
    by_reason = Gauge("vllm:num_requests_waiting_by_reason", "lookalike", ["reason"], registry=reg)
    by_reason.labels("capacity").set(11)
    Gauge("vllm:num_requests_running_max", "lookalike", registry=reg).set(13)
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_prompt_tokens"):
        h = Histogram(name, "histogram", ["model_name"], registry=reg,
                      buckets=[0.001 * 2 ** i for i in range(20)])
        for k in range(50):
            h.labels("m").observe(0.0001 * k * k)
    return generate_latest(reg).decode()


def test_sums_running_and_waiting_over_every_label_set() -> None:
    text = vllm_like({"0": 3, "1": 1}, {"0": 2, "1": 4})
    assert engine_queue(text) == 10
    assert engine_queue(text) == full_parse(text)


def test_lookalike_names_and_label_values_do_not_count() -> None:
    text = vllm_like({"0": 0}, {"0": 0})
    # The lookalikes are in the text with non-zero values; the queue is empty.
    assert "vllm:num_requests_waiting_by_reason" in text and "vllm:num_requests_running_max" in text
    assert engine_queue(text) == 0 == full_parse(text)


def test_an_engine_without_the_gauges_has_no_queue() -> None:
    assert engine_queue("# HELP other x\n# TYPE other gauge\nother 5.0\n") == 0
    assert engine_queue("") == 0
