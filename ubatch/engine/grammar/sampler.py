"""How a grammar constrains one generation, in common/sampling.cpp's order of work.

llama.cpp samples with the whole chain first and asks the grammar about that one token; only if
the grammar rejects it are all candidates filtered and the chain run again (a second random
draw). Filtering all 262k candidates is what this module avoids: the chain only ever looks at
its k best candidates (k = 1 for greedy, top_k otherwise), and the penalties only move the logits
of tokens the sampler has seen, so the k best allowed tokens (found by the trie search of
tokens.py) plus the allowed seen tokens are every candidate the chain could pick; the rest are
left at -inf. Only generated tokens advance the grammar; end-of-generation tokens are allowed
only where the grammar is complete, so a finished grammar ends the generation.
"""

from __future__ import annotations

import bisect
import codecs
import re
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ubatch.engine.grammar import Grammar
from ubatch.engine.grammar.elements import GrammarError
from ubatch.engine.grammar.match import DEAD
from ubatch.engine.grammar.tokens import token_table, top_allowed
from ubatch.engine.sampling.chain import Sampler, SamplerParams
from ubatch.engine.vocab.vocab import Vocab


def window(sp: SamplerParams) -> int | None:
    """How many of the best allowed candidates the chain's pick can depend on (None: all).

    Read from the parameters in the chain's order; where a stage's switch is a float, it counts
    as on whenever llama.cpp's float32 test could be (never too small a window). Penalties and
    DRY only move the logits of seen tokens (handled by `penalized`); a plain temperature is
    monotonic; top-k bounds everything after it; with temp <= 0, stages that keep the best
    token leave the argmax to decide. Anything else (dynamic temperature, typical, XTC,
    top-n-sigma, min-p or top-p before any top-k, mirostat, no temperature) reads them all."""
    if sp.mirostat:
        return None
    dynatemp = sp.dynatemp_range > 0
    greedy = sp.temp <= 0 and not dynatemp
    off = {
        "top_n_sigma": sp.top_n_sigma <= 0,
        "typ_p": sp.typ_p >= 1.0,
        "top_p": sp.top_p >= 1.0,
        "min_p": sp.min_p <= 0,
        "xtc": sp.xtc_probability <= 0,
        "top_k": sp.top_k <= 0,
        "penalties": sp.repeat_penalty == 1.0 and sp.frequency_penalty == 0 and sp.presence_penalty == 0,
        "dry": sp.dry_multiplier == 0,
    }
    k_seen, filtered = None, False
    for name in sp.samplers:
        if off.get(name, False):
            continue
        if name in ("penalties", "dry"):
            if greedy and filtered:  # moved after a filter that read every candidate
                return k_seen
            continue
        if name == "top_k":
            if not greedy:
                return sp.top_k
            k_seen = k_seen or sp.top_k
            continue
        if greedy and name in ("top_p", "min_p", "top_n_sigma"):
            filtered = True
            continue  # they never drop the best token
        if name == "temperature" and not dynatemp:
            if greedy:
                return 1
            continue
        return k_seen  # a stage that reads every candidate still in (after a top-k: its k)
    return k_seen  # no temperature stage: a draw over what is left


def penalized(sp: SamplerParams) -> bool:
    """Can the chain move some logits (repetition penalties, DRY)? Only seen tokens' move."""
    off = sp.repeat_penalty == 1.0 and sp.frequency_penalty == 0 and sp.presence_penalty == 0
    return not off or sp.dry_multiplier != 0


class GrammarSampler:
    """One generation's position in a grammar: a matcher state plus a pending partial character."""

    def __init__(self, grammar: Grammar, vocab: Vocab) -> None:
        self.m, self.vocab, self.table = grammar.matcher, vocab, token_table(vocab)
        self.sid = self.m.start
        self.stacks = self.m.states[self.sid]  # the state itself: its id may change (match.py)
        self.epoch = self.m.epoch
        self.partial = (0, 0)  # (value, n_remain) of a character split across tokens
        self.seen: set[int] = set()  # every token fed to the sampler (prompt and generated)
        self.n_resampled = 0  # tokens the chain picked that the grammar refused
        # a lazy grammar waits for a trigger: until then every token is allowed (see _trigger)
        self.awaiting = grammar.lazy
        self._words = grammar.trigger_words
        self._patterns = [re.compile(p) for p in grammar.trigger_patterns]
        self._text = ""  # the generated text while awaiting
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    @contextmanager
    def _session(self) -> Iterator[None]:
        """The matcher's session (state ids hold within it), with this generation's state id
        found again if the matcher dropped its states since the last call."""
        with self.m.session():
            if self.epoch != self.m.epoch:
                self.sid, self.epoch = self.m.intern(self.stacks), self.m.epoch
            yield

    @property
    def accepting(self) -> bool:
        if self.awaiting:
            return True
        with self._session():
            return self.m.info(self.sid).accepting

    def allows(self, tok: int) -> bool:
        """llama_grammar_apply for one token."""
        with self._session():
            return self._allows(tok)

    def _trigger(self, tok: int) -> None:
        """A lazy grammar's wait (llama.cpp's trigger buffer): add the token's text; once a
        trigger appears, the grammar takes over from where the trigger starts, as if it had
        generated the text since. A trigger the grammar cannot start with leaves it free."""
        before = len(self._text)
        self._text += self._utf8.decode(self.table.pieces[tok])
        start = -1
        for w in self._words:  # only a word that ends in the new text can be new
            i = self._text.find(w, max(0, before - len(w) + 1))
            if i >= 0 and (start < 0 or i < start):
                start = i
        if start < 0:
            for p in self._patterns:
                hit = p.search(self._text)
                if hit is not None:
                    start = hit.start(1) if p.groups else hit.start()
                    break
        if start < 0:
            return
        self.awaiting = False
        with self._session():
            sid = self.m.walk(self.m.start, self._text[start:])
            if sid < 0:  # the model went another way: stay unconstrained
                self.awaiting, self._words, self._patterns = True, (), []
                return
            self.sid, self.stacks, self.partial = sid, self.m.states[sid], (0, 0)
        self._text = ""

    def _allows(self, tok: int) -> bool:
        if self.awaiting:
            return True
        if tok in self.vocab.eog:
            return self.m.info(self.sid).accepting
        dec = self.table.decoded(tok, *self.partial)
        if dec is None or dec[2] < 0:
            return False
        cps, value, n_remain = dec
        m, sid = self.m, self.sid
        for c in cps:
            info = m.info(sid)
            if info.token_tops and any((v == tok) != neg for neg, v in info.token_tops):
                return True  # a token reference matches by id, whatever text is left
            sid = info.nexts[bisect.bisect_right(info.bounds, c if isinstance(c, int) else ord(c)) - 1]
            if sid == DEAD:
                return False
        return n_remain == 0 or m.partial_ok(sid, value, n_remain)

    def accept(self, tok: int) -> None:
        """llama_grammar_accept_impl: advance past a generated token (one `allows` accepted)."""
        self.seen.add(tok)
        if tok in self.vocab.eog:
            return
        if self.awaiting:
            self._trigger(tok)
            return
        with self._session():
            dec = self.table.decoded(tok, *self.partial)
            m = self.m
            base = m.without_complete(self.sid)
            sid = DEAD
            if dec is not None and dec[2] >= 0 and base != DEAD:
                if m.info(base).token_tops:
                    sid = m.union(m.walk(m.char_only(base), dec[0]), m.after_token(base, tok))
                else:
                    sid = m.walk(base, dec[0])
            if sid == DEAD or dec is None:
                piece = self.table.pieces[tok].decode("utf-8", "replace")
                raise GrammarError(f"the grammar has no state left after token {tok} ({piece!r})")
            self.sid, self.stacks, self.partial = sid, m.states[sid], (dec[1], dec[2])

    def choose(self, x: torch.Tensor, tok: int, sampler: Sampler) -> int:
        """The chain picked `tok` from `x`; keep it if allowed, else sample among allowed tokens."""
        if self.awaiting:
            return tok
        with self._session():
            if self._allows(tok):
                return tok
            self.n_resampled += 1
            keep = self._candidates(x, window(sampler.params), penalized(sampler.params))
        if not keep:  # nothing allowed can be sampled: end the generation
            return self.table.eog[0] if self.table.eog else self.vocab.eos
        idx = torch.tensor(keep, dtype=torch.long)
        masked = torch.full_like(x, float("-inf"))
        masked[idx] = x[idx]
        return sampler.sample(masked)

    def candidates(self, x: torch.Tensor, k: int | None, penalties: bool) -> list[int]:
        """Allowed tokens with a finite logit: at least the k best unseen ones (all if k is None)
        and, when penalties may reorder them, every allowed seen token."""
        with self._session():
            return self._candidates(x, k, penalties)

    def _candidates(self, x: torch.Tensor, k: int | None, penalties: bool) -> list[int]:
        xn = x.detach().cpu().numpy()
        skip = self.seen if penalties else set()
        best: list[int] = []
        if self.partial[1] > 0:  # a split character: only continuation bytes (or EOG) fit
            pool = self.table.continuations + self.table.eog
        else:
            t = self.table
            pool = t.odd + sorted(skip)
            best = self._scan(x, k, skip) if k is not None else []
            if k is None or len(best) < k:  # the first few did not settle it: search the trie
                best = top_allowed(t, self.m, self.sid, xn[t.ids], xn, k or self.vocab.n_tokens, skip)
        inf = float("-inf")
        return best + [t for t in dict.fromkeys(pool) if xn[t] > inf and t not in best and self._allows(t)]

    def _scan(self, x: torch.Tensor, k: int, skip: set[int]) -> list[int]:
        """The k best allowed unseen tokens if they are among the best 4k + 32 (often: inside
        a string almost every token is allowed), else fewer."""
        vals, ids = torch.topk(x, min(4 * k + 32, 512, x.numel()))
        out = []
        for v, t in zip(vals.tolist(), ids.tolist()):
            if v == float("-inf"):
                break
            if t not in skip and self._allows(t):
                out.append(t)
                if len(out) == k:
                    break
        return out
