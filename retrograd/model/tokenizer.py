"""Tokenization through llama.cpp's own vocabulary, so token ids equal llama.cpp's."""

from __future__ import annotations

from pathlib import Path

from retrograd.errors import GGUFError
from retrograd.runtime.llamacpp import C, llama_cpp


class Tokenizer:
    def __init__(self, path: str | Path):
        try:
            self._llama = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        except Exception as e:  # llama.cpp refuses the vocabulary
            raise GGUFError(f"{path}: llama.cpp cannot load the vocabulary ({e})") from None
        vocab = C.llama_model_get_vocab(self._llama.model)
        self._vocab = vocab
        self.n_vocab = C.llama_vocab_n_tokens(vocab)
        self.add_bos = bool(C.llama_vocab_get_add_bos(vocab))
        self.bos_id = _opt(C.llama_vocab_bos(vocab))
        self.eos_id = _opt(C.llama_vocab_eos(vocab))
        self._eog: frozenset[int] | None = None

    def encode(self, text: str, *, add_bos: bool | None = None, special: bool = True) -> list[int]:
        """Text -> ids. BOS only where the model adds one (or when asked); special-token
        text such as `<|im_start|>` becomes its special id, as in llama.cpp's prompts."""
        bos = self.add_bos if add_bos is None else add_bos
        return self._llama.tokenize(text.encode("utf-8"), add_bos=bos, special=special)

    def decode(self, ids: list[int], *, special: bool = True) -> str:
        return self._llama.detokenize(list(ids), special=special).decode("utf-8", errors="replace")

    def piece(self, token: int) -> bytes:
        return self._llama.detokenize([token], special=True)

    @property
    def eog_ids(self) -> frozenset[int]:
        """Every end-of-generation id (EOS, EOT, <|im_end|>, <end_of_turn>, ...)."""
        if self._eog is None:
            self._eog = frozenset(i for i in range(self.n_vocab) if C.llama_vocab_is_eog(self._vocab, i))
        return self._eog


def _opt(token: int) -> int | None:
    return None if token < 0 else int(token)
