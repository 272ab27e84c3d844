"""A small Llama built locally (no downloads): BPE tokenizer + random-init LlamaConfig, float16.

``build_tiny_llama(dir, seed=...)`` writes a complete Hugging Face model folder that vLLM
loads. Different seeds (or sizes) give different models with the same tokenizer.
``initializer_range`` is large so that outputs depend strongly on the whole context: wrong
or missing KV changes the greedy tokens, which is what the negative controls rely on.
"""

from __future__ import annotations

import random
from pathlib import Path

WORDS = (
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho "
    "sigma tau upsilon phi chi psi omega red green blue cyan magenta yellow black white north "
    "south east west river mountain valley forest desert ocean island city village road bridge "
    "tower castle garden market harbor station engine signal packet buffer cache memory page "
    "block token layer head value key query vector matrix tensor kernel thread process socket"
).split()


def make_text(n_words: int, seed: int) -> str:
    """Deterministic pseudo-random text over a fixed vocabulary of words."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def build_tiny_llama(
    out: Path,
    *,
    seed: int = 0,
    hidden: int = 256,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 512,
    vocab: int = 2000,
    max_pos: int = 16384,
) -> Path:
    """Write tokenizer + config + random weights (float16) to ``out`` and return it."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = [make_text(200, s) for s in range(200)]
    tok.train_from_iterator(corpus, trainer)
    from tokenizers import decoders

    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)
    real_vocab = tok.get_vocab_size()

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=real_vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_pos,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="float16",
    )
    model = LlamaForCausalLM(cfg).to(torch.float16)
    model.save_pretrained(out)
    return out
