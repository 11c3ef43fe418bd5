"""sentence-transformers' prompts, shared by every encoder (config_sentence_transformers.json's ``prompts`` and
``default_prompt_name``): which prompt a call resolves to, and how many tokens it puts before each text."""

from __future__ import annotations

__all__ = ["Prompts"]


class Prompts:
    """sentence-transformers' prompts, shared by every encoder: ``prompts``, ``default_prompt_name``, ``special_ids``."""

    tokenizer: object
    prompts: dict[str, str | None]
    default_prompt_name: str | None
    special_ids: frozenset[int]

    def set_prompts(self, prompts: dict[str, str | None] | None, default_prompt_name: str | None,
                    special_ids: frozenset[int] | set[int] = frozenset()) -> None:
        # SentenceTransformer's own defaults: prompt_name="query" / "document" is no prompt unless the folder sets one
        self.prompts = {"query": None, "document": None, **(prompts or {})}
        self.default_prompt_name, self.special_ids = default_prompt_name, frozenset(special_ids)
        self._prompt_lengths: dict[str, tuple[object, int]] = {}

    def prompt_length(self, prompt: str | None) -> int | None:
        """Tokens of ``prompt`` alone, less a trailing special token: what sentence-transformers leaves out of the
        pooling when include_prompt is false. None for no prompt. Kept per prompt and tokenizer (a server asks at
        every request), so the prompt is tokenized alone once."""
        if not prompt:
            return None
        cache = self.__dict__.setdefault("_prompt_lengths", {})
        tokenizer, n = cache.get(prompt, (None, 0))
        if tokenizer is not self.tokenizer:
            ids = self.tokenizer.encode(prompt).ids
            n = len(ids) - (1 if ids and ids[-1] in self.special_ids else 0)
            cache[prompt] = (self.tokenizer, n)
        return n

    def resolve_prompt(self, prompt: str | None, prompt_name: str | None) -> str | None:
        """sentence-transformers' rule: prompt wins; else prompts[prompt_name]; else the default prompt, if any."""
        if prompt is not None:
            if not isinstance(prompt, str):
                raise TypeError(f"prompt must be a str; got {type(prompt).__name__}")
            return prompt
        if prompt_name is not None:
            if prompt_name not in self.prompts:
                raise ValueError(f"prompt_name {prompt_name!r} is not one of this model's prompts {sorted(self.prompts)}")
            return self.prompts[prompt_name]
        return self.prompts.get(self.default_prompt_name) if self.default_prompt_name else None
