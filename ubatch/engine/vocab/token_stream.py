"""Streaming detokenisation: byte tokens can split a UTF-8 character across steps, so text is
handed out only once each character is complete (what a terminal or an SSE client can show)."""

from __future__ import annotations

import codecs

from ubatch.engine.vocab.vocab import Vocab


class TokenStreamer:
    """Incremental detokeniser: byte tokens split characters, so incomplete UTF-8 is held back.

    Like llama.cpp's streamed output (common_token_to_piece), no leading space is stripped.
    """

    def __init__(self, vocab: Vocab, special: bool = False) -> None:
        self._vocab, self._special = vocab, special
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, tok: int) -> str:
        """The text completed by `tok` ("" while a character is still incomplete)."""
        return self._decoder.decode(self._vocab.token_to_piece(tok, self._special))

    def flush(self) -> str:
        """Whatever is held back, an incomplete tail becoming U+FFFD."""
        return self._decoder.decode(b"", final=True)
