"""What a process that holds no weights needs to know about a model: tokenizer, vocabulary, EOS ids."""

from __future__ import annotations

from types import SimpleNamespace


def model_config(spec: str, key: str = "target.model"):
    """The transformers config of a model spec (no weights read)."""
    from specdist.models.loader import quiet_transformers, resolve_model

    src = resolve_model(spec, key)
    quiet_transformers()
    from transformers import AutoConfig

    extra = {"gguf_file": src.gguf_file} if src.gguf_file else {}
    return AutoConfig.from_pretrained(src.directory, local_files_only=True, **extra)


def model_metadata(spec: str, key: str = "target.model"):
    """(tokenizer or None, vocabulary size, EOS ids) of a model spec, reading only its config files."""
    from specdist.models.loader import eos_token_ids, load_tokenizer, resolve_model

    src = resolve_model(spec, key)
    config = model_config(spec, key)
    from transformers import GenerationConfig

    extra = {"gguf_file": src.gguf_file} if src.gguf_file else {}
    try:
        gen = GenerationConfig.from_pretrained(src.directory, local_files_only=True, **extra)
    except Exception:  # no generation_config.json: the model config's values stand
        gen = GenerationConfig.from_model_config(config)
    tokenizer = load_tokenizer(src)
    vocab = int(getattr(config, "vocab_size", None) or config.get_text_config().vocab_size)
    return tokenizer, vocab, eos_token_ids(SimpleNamespace(config=config, generation_config=gen), tokenizer)
