"""A tiny random-weight Llama with a byte-level BPE tokenizer, built offline in seconds (exactness tests)."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

WEIGHT_STD = 0.08
# A minimal ChatML-like template, so the tiny model serves /v1/chat/completions too.
CHAT_TEMPLATE = (
    "{% for message in messages %}<s>{{ message['role'] }}\n{{ message['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def _training_text() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [path.read_text(errors="ignore") for path in sorted(stdlib.glob("*.py"))[:60]]


def build_tiny_llama(directory: Path, *, rope_scaling: dict | None = None, vocab_size: int = 2000,
                     bos_on_encode: bool = False, max_positions: int = 4096) -> Path:
    """Writes config, fp32 weights and tokenizer to `directory` (a plain HF folder) and returns it.
    `bos_on_encode`: the tokenizer adds <s> when asked for special tokens, as Llama-3's does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_training_text(), trainer=trainer)
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
