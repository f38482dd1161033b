"""A tiny random-weight Llama with a byte-level BPE tokenizer, built offline in seconds (exactness tests), and a
Llama-3-style tokenizer (Llama-3's special tokens, pre-tokenizer and chat template on the same tiny BPE)."""

from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tokenizers import Tokenizer

WEIGHT_STD = 0.08
# A minimal ChatML-like template, so the tiny model serves /v1/chat/completions too.
CHAT_TEMPLATE = (
    "{% for message in messages %}<s>{{ message['role'] }}\n{{ message['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
# Llama-3-8B-Instruct's chat template (it trims each message's content).
LLAMA3_CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
    " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
LLAMA3_SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                         "<|eot_id|>", *(f"<|reserved_special_token_{index}|>" for index in range(8))]
# Llama-3's pre-tokenizer split (then byte-level without its own regex).
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")


def _training_text() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [path.read_text(errors="ignore") for path in sorted(stdlib.glob("*.py"))[:60]]


def build_tiny_llama(directory: Path, *, rope_scaling: dict | None = None, vocab_size: int = 2000,
                     bos_on_encode: bool = False, max_positions: int = 4096) -> Path:
    """Writes config, fp32 weights and tokenizer to `directory` (a plain HF folder) and returns it.
    `bos_on_encode`: the tokenizer adds <s> when asked for special tokens, as Llama-3's does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    _train(tokenizer, vocab_size, ["<s>", "</s>", "<pad>"])
    if bos_on_encode:
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)

    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, bos_token_id=0, eos_token_id=1,
        pad_token_id=2, tie_word_embeddings=False, dtype="float32",
    )
    if rope_scaling is not None:
        config.rope_scaling = rope_scaling
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, WEIGHT_STD)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def _train(tokenizer: Tokenizer, vocab_size: int, special_tokens: list[str]) -> None:
    """Trains `tokenizer`'s BPE on a slice of the standard library's source, `special_tokens` first."""
    from tokenizers import pre_tokenizers, trainers

    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(_training_text(), trainer=trainer)


def build_llama3_style_tokenizer(directory: Path, vocab_size: int = 2000) -> Path:
    """Writes a tokenizer (no model) to `directory`: a tiny byte-level BPE with Llama-3's pre-tokenizer, special
    tokens (and some reserved ones), BOS added on encode, and Llama-3's chat template; returns `directory`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    _train(tokenizer, vocab_size, LLAMA3_SPECIAL_TOKENS)
    bos = LLAMA3_SPECIAL_TOKENS[0]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.token_to_id(bos))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=bos, eos_token="<|eot_id|>")
    fast.chat_template = LLAMA3_CHAT_TEMPLATE
    fast.save_pretrained(directory)
    return directory
