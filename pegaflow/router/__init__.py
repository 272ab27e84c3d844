"""``pegaflow router``: an OpenAI-compatible HTTP front end that routes requests to vLLM
engines by where their prompt's KV blocks are (kv-aware), by load, or in turn, and runs
prefill/decode disaggregation through PegaFlow. See docs/router.md.

Modules, in the direction they depend on each other:

* :mod:`.routing` — pure routing arithmetic (no I/O): candidates in, one engine out;
* :mod:`.engines` — each engine's health, load and identity (what its connector reports);
* :mod:`.hints` — who holds a prefix: the metaserver, or each engine's node directly;
* :mod:`.prompts` — request bodies to token ids and block hashes (the connector's hash);
* :mod:`.app` — the HTTP service: forwarding, streaming, retries, disaggregation;
* :mod:`.cli` — the command.
"""
