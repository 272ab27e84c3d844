"""Request bodies to the token ids an engine will see, and those to block hashes.

The router hashes with the connector's one function (``pegaflow.core.identity``), seeded
by the namespace root the engine's connector reported, so its hashes are the node's. The
token ids only steer routing: an engine tokenizes the request itself, and a router that
tokenized differently (another tokenizer, a template vLLM renders otherwise) only routes
worse, never answers differently.

* completions: ``prompt`` as text (tokenized with special tokens, as vLLM does), a list of
  token ids, or a batch of either (routed by its first prompt: a batch goes to one engine);
* chat: ``messages`` rendered by the tokenizer's chat template (``add_generation_prompt``,
  ``continue_final_message``, ``chat_template_kwargs`` as in the request), then tokenized
  without special tokens, as vLLM does. Messages with non-text parts (images) are routed
  by load: their blocks' hashes depend on content the router does not see.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import structlog

from pegaflow.core.identity import ExtraKeys, block_hashes

if TYPE_CHECKING:  # the router extra's
    from transformers import AutoTokenizer, PreTrainedTokenizerBase

log = structlog.get_logger("pegaflow.router")

COMPLETIONS, CHAT = "completions", "chat"

JsonValue = Any  # JSON from a client or an engine, as decoded: every field is read with an isinstance check
Body = dict[str, JsonValue]  # a request body (check_body has seen that it is an object)


class BadRequest(ValueError):
    """A request the router cannot forward; the message names the field (OpenAI error shape)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def check_body(kind: str, body: object) -> None:
    """What every engine would reject anyway, answered by the router (400) without a round trip."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if kind == COMPLETIONS:
        prompt = body.get("prompt")
        if prompt is None or prompt == "" or prompt == []:
            raise BadRequest("'prompt' is required", "prompt")
        if not isinstance(prompt, (str, list)):
            raise BadRequest("'prompt' must be a string, a list of token ids, or a list of those", "prompt")
    else:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise BadRequest("'messages' must be a non-empty list", "messages")
        if not all(isinstance(m, dict) for m in msgs):
            raise BadRequest("every message must be an object", "messages")
    if "model" in body and not isinstance(body["model"], str):
        raise BadRequest("'model' must be a string", "model")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise BadRequest("'stream' must be a boolean", "stream")
    try:  # what the router sends on must encode: JSON has no NaN or Infinity (a Python parser takes them)
        json.dumps(body, allow_nan=False)
    except ValueError:
        raise BadRequest("the request holds a number JSON cannot carry (NaN or Infinity)") from None


def _is_ids(x: object) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


class Prompts:
    """Token ids of request bodies: with ``tokenizer`` for every model (``--tokenizer``), else
    with the tokenizer of the model's root (``by_root``: the model path its engines report,
    loaded by the router in the background)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None = None) -> None:
        self.tokenizer = tokenizer
        self.by_root: dict[str, PreTrainedTokenizerBase] = {}

    @staticmethod
    def library() -> type[AutoTokenizer]:
        """The tokenizer class. Seconds to import (transformers imports torch): the router
        imports it before it serves (``Router._import_tokenizer_library``)."""
        from transformers import AutoTokenizer

        return AutoTokenizer

    @staticmethod
    def load(name: str) -> PreTrainedTokenizerBase:
        return Prompts.library().from_pretrained(name)

    def token_ids(self, kind: str, body: Body, root: str = "") -> list[int] | None:
        """The first prompt's token ids (text with the tokenizer of the model at ``root``),
        or None when the router cannot know them."""
        tokenizer = self.tokenizer or self.by_root.get(root)
        try:
            if kind == COMPLETIONS:
                prompt = body["prompt"]
                if isinstance(prompt, list) and prompt and not _is_ids(prompt):
                    prompt = prompt[0]  # a batch: routed by its first prompt
                if _is_ids(prompt):
                    return list(prompt)
                if isinstance(prompt, str) and tokenizer is not None:
                    return list(tokenizer(prompt).input_ids)
                return None
            if tokenizer is None:
                return None
            msgs = body["messages"]
            if any(not isinstance(m.get("content", ""), str | None) for m in msgs):
                return None  # multimodal parts
            text = tokenizer.apply_chat_template(
                msgs, tokenize=False,
                add_generation_prompt=bool(body.get("add_generation_prompt", True)),
                continue_final_message=bool(body.get("continue_final_message", False)),
                **(body.get("chat_template_kwargs") or {}))
            return list(tokenizer(text, add_special_tokens=False).input_ids)
        except Exception as exc:  # noqa: BLE001 - a template or tokenizer error only costs the hint
            log.debug("tokenize_failed", kind=kind, error=str(exc)[:200])
            return None


def extra_keys(body: Body, adapters: Mapping[str, str]) -> ExtraKeys:
    """The hash inputs besides tokens a request carries: its LoRA adapter (name, and the path
    the engine loaded it from: ``adapters``, from its /v1/models) and cache salt."""
    model = body.get("model")
    salt = body.get("cache_salt")
    lora = model if isinstance(model, str) and model in adapters else None
    path = adapters[lora] if lora is not None else ""
    return ExtraKeys(lora_name=lora, lora_path=path or None,
                     cache_salt=salt if isinstance(salt, str) and salt else None)


def hashes_of(seed: bytes, tokens: Sequence[int], block_size: int, extra: ExtraKeys) -> list[bytes]:
    """The connector's block hashes of the prompt's full blocks that an engine can load (it
    always computes the last prompt token itself)."""
    return block_hashes(seed, tokens, block_size, extra, max_blocks=max(0, (len(tokens) - 1) // block_size))
