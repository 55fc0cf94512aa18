"""What a process needs to know about a config's models besides their weights: where they are (their
sources), and the target's config, vocabulary size, EOS ids and tokenizer.

:func:`resolve_sources` turns a config's model specs into :class:`ModelSources` once, at start, and that
object goes down the layers in place of the specs: the engines (``Engine.from_config``,
``RemoteEngine``), the deployment and its workers (which receive it pickled: the resolved files and what
was read of the target, without the tokenizer), the draft methods' ``load`` and ``hidden_layers_of``. Each
spec is resolved (:func:`specdist.models.loader.resolve_model`) and each piece of metadata read at most
once per object, on first use, and kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specdist.config import Config
    from specdist.models.loader import ModelSource


def model_config(source: ModelSource):
    """The transformers config of a resolved model (no weights read; a GGUF file's header is parsed once
    with whatever else reads it inside an enclosing :func:`~specdist.models.loader.gguf_parsed_once`)."""
    from specdist.models.loader import gguf_errors, gguf_parsed_once, quiet_transformers

    quiet_transformers()
    from transformers import AutoConfig

    extra = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    with gguf_parsed_once(), gguf_errors(source):
        return AutoConfig.from_pretrained(source.directory, local_files_only=True, **extra)


@dataclass(eq=False)
class ModelSources:
    """A config's models: the target's spec and ``draft.model`` (a draft model for method ``model``, an EAGLE-3
    head for ``eagle3``; None for the other methods), each resolved to its :class:`~specdist.models.loader.
    ModelSource` on first use (:attr:`target`, :attr:`draft`; ConfigError naming ``target.model`` /
    ``draft.model`` as :func:`~specdist.models.loader.resolve_model` gives it), and what is read of the target
    without its weights (:meth:`config`, :meth:`vocab_size`, :meth:`eos_ids`, :meth:`tokenizer`), each at most
    once. Pickled (to a Ray worker) it carries what it has resolved and read, but not the tokenizer: a
    process that needs one loads it from the resolved files."""

    target_spec: str
    draft_spec: str | None = None
    _target: ModelSource | None = field(default=None, repr=False)
    _draft: ModelSource | None = field(default=None, repr=False)
    _config: Any = field(default=None, repr=False)
    _vocab_size: int | None = field(default=None, repr=False)
    _eos_ids: frozenset[int] | None = field(default=None, repr=False)
    _tokenizer: Any = field(default=None, repr=False)
    _tokenizer_read: bool = field(default=False, repr=False)
    # draft.method -> (target layers whose states its drafts read, values per position): set by
    # specdist.cores.draft.draft_hidden_layers
    draft_hidden_layers: dict = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, cfg: Config) -> "ModelSources":
        """The sources of ``cfg``'s models, resolved as they are first used (:func:`resolve_sources`: now)."""
        return cls(cfg.target.model, cfg.draft.model if cfg.draft.enabled else None)

    # ------------------------------------------------------------ where the models are
    @property
    def target(self) -> ModelSource:
        if self._target is None:
            from specdist.models import loader

            self._target = loader.resolve_model(self.target_spec, "target.model")
        return self._target

    @property
    def draft(self) -> ModelSource | None:
        if self._draft is None and self.draft_spec:
            from specdist.models import loader

            self._draft = loader.resolve_model(self.draft_spec, "draft.model")
        return self._draft

    def resolve(self) -> "ModelSources":
        """Resolve every spec now (the target's first); returns self."""
        _ = self.target, self.draft
        return self

    # ------------------------------------------------------------ what is read of the target
    def config(self):
        """The target's transformers config (no weights read)."""
        if self._config is None:
            self._config = model_config(self.target)
        return self._config

    def vocab_size(self) -> int:
        """The target's vocabulary size, from its config."""
        if self._vocab_size is None:
            config = self.config()
            self._vocab_size = int(getattr(config, "vocab_size", None) or config.get_text_config().vocab_size)
        return self._vocab_size

    def tokenizer(self):
        """The target's tokenizer, or None when it ships without one (loaded once, in this process)."""
        if not self._tokenizer_read:
            from specdist.models.loader import load_tokenizer

            self._tokenizer = load_tokenizer(self.target)
            self._tokenizer_read = True
        return self._tokenizer

    def use_tokenizer(self, tokenizer) -> None:
        """The caller loaded the target's tokenizer already: :meth:`tokenizer` gives that one."""
        self._tokenizer, self._tokenizer_read = tokenizer, True

    def eos_ids(self) -> frozenset[int]:
        """Every id the target treats as end of sequence: its generation config's (else its model config's)
        and its tokenizer's (:func:`~specdist.models.loader.eos_token_ids`)."""
        if self._eos_ids is None:
            from specdist.models.loader import eos_token_ids, gguf_parsed_once

            src = self.target
            with gguf_parsed_once():  # a GGUF file: one parse of its header for the config and the tokenizer
                config, tokenizer = self.config(), self.tokenizer()
                from transformers import GenerationConfig

                extra = {"gguf_file": src.gguf_file} if src.gguf_file else {}
                try:
                    gen = GenerationConfig.from_pretrained(src.directory, local_files_only=True, **extra)
                except Exception:  # no generation_config.json: the model config's values stand
                    gen = GenerationConfig.from_model_config(config)
            self._eos_ids = eos_token_ids(SimpleNamespace(config=config, generation_config=gen), tokenizer)
        return self._eos_ids

    def read_target_metadata(self) -> "ModelSources":
        """Read the target's config, vocabulary size, tokenizer and EOS ids now, from one parse of a GGUF
        file's header (what a process holding no weights needs: the coordinator); returns self."""
        from specdist.models.loader import gguf_parsed_once

        with gguf_parsed_once():
            self.tokenizer()
            self.vocab_size()
            self.eos_ids()
        return self

    @property
    def resolved(self) -> bool:
        """Whether every spec is resolved already (nothing that uses these sources resolves one)."""
        return self._target is not None and (self._draft is not None or not self.draft_spec)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_tokenizer"], state["_tokenizer_read"] = None, False  # the tokenizer stays in this process
        return state


def resolve_sources(cfg: Config) -> ModelSources:
    """``cfg``'s model specs resolved, now and once (the target's first): what the engines, the deployment and
    the draft methods take in place of the specs. ConfigError naming ``target.model`` or ``draft.model`` as
    :func:`~specdist.models.loader.resolve_model` raises it."""
    return ModelSources.of(cfg).resolve()
