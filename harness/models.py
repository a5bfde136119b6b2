"""A tiny causal LM and tokenizer, built offline in seconds: random weights, real shapes and code paths.

Random weights produce arbitrary text, so tests assert lengths, shapes, determinism and batch-invariance,
never the words.
"""
from __future__ import annotations

import random
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tiny_llama(folder: Path, *, context: int = 256) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    rng = random.Random(0)
    words = ["the", "cat", "sat", "on", "a", "mat", "batch", "model", "token", "queue", "fast", "slow", "red",
             "blue", "worker", "request", "answer", "hello", "world", "poison"]
    corpus = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(400)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    from tokenizers import decoders

    tok.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>", padding_side="left")
    tokenizer.chat_template = CHAT_TEMPLATE
    config = LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=context, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    import torch

    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
