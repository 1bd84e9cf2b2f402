"""`Llama`: llama-cpp-python's high-level class (the commonly used subset) on ubatch's engine.

Code written for llama-cpp-python's `Llama(...).tokenize/.detokenize/.eval/.scores/
.create_completion` runs unchanged. Like llama-cpp-python, `create_completion` reuses the
longest common prefix of the previous evaluation instead of re-evaluating it. The completion
loop (ubatch/llama_completion.py) and the saved state (ubatch/llama_state.py) take what they need
from this class as arguments; neither imports it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from ubatch import llama_state
from ubatch.engine.batch import Batch, common_prefix
from ubatch.engine.context.context import Context
from ubatch.engine.errors import ContextError
from ubatch.engine.generation.embedding import embed_prompts
from ubatch.engine.grammar import Grammar, compile_grammar
from ubatch.engine.model.default_model import default_model_path
from ubatch.engine.model.hparams import POOLING_TYPES
from ubatch.engine.model.model import Model
from ubatch.engine.parallel.group import under_torchrun
from ubatch.engine.parallel.launch import Ranks, launch
from ubatch.engine.params import ContextParams
from ubatch.engine.sampling.chain import LLAMA_DEFAULT_SEED, SamplerParams
from ubatch.engine.serve.embedding_task import fit_prompt
from ubatch.engine.spec.speculative import SpecError, SpecParams, SpecStats
from ubatch.llama_completion import CompletionChunk, completion_chunks, join_logprobs, speculator_for
from ubatch.llama_state import LlamaState

Embedding = list[float] | list[list[float]]  # one text's vector (per-token rows with pooling none)


class Llama:
    def __init__(
        self,
        model_path: str | Path | None = None,
        *,
        n_ctx: int = 512,
        n_batch: int = 512,
        n_ubatch: int = 512,
        n_seq_max: int = 1,
        n_threads: int | None = None,
        seed: int = LLAMA_DEFAULT_SEED,
        logits_all: bool = False,
        type_k: str = "f16",
        type_v: str = "f16",
        verbose: bool = False,
        backend: str = "auto",
        embedding: bool = False,
        pooling_type: int | str | None = None,  # LLAMA_POOLING_TYPE_* (-1: the model's) or a name
        spec_type: str | None = None,  # speculative decoding, as --spec-type: "ngram-simple", "draft-simple"
        draft_model: str | Path | None = None,  # the draft model's GGUF, for draft-simple (-md)
        spec_draft_n_max: int = 3,
        spec_ngram_size_n: int = 12,
        spec_ngram_size_m: int = 48,
        tensor_parallel: int = 1,  # ranks each layer is split over (the CLI's -tp); started here
        lora_path: str | Path | None = None,  # a LoRA adapter (GGUF or PEFT directory), as --lora
        lora_scale: float = 1.0,  # its scale (llama-cpp-python's; alpha / rank still applies)
        **_ignored: object,
    ) -> None:
        """With `tensor_parallel` N > 1 this process is rank 0 and starts ranks 1..N-1 itself (or,
        under torchrun, joins the launcher's group: there every rank other than 0 follows rank 0
        inside this constructor and then exits). `close()` stops them; so does the interpreter's exit."""
        types = tuple(t.strip() for t in (spec_type or "").split(",") if t.strip())
        spec = SpecParams(types, spec_draft_n_max, ngram_size_n=spec_ngram_size_n, ngram_size_m=spec_ngram_size_m)
        spec.check()  # before anything loads
        if "draft-simple" in types and draft_model is None:
            raise SpecError("spec_type draft-simple needs draft_model (a GGUF path)")
        self.model_path = str(model_path or default_model_path())
        self._ranks: Ranks | None = None
        if tensor_parallel > 1 or under_torchrun():
            started = launch(self.model_path, tensor_parallel if tensor_parallel > 1 else 0)
            if started is None:  # a rank other than 0 under torchrun: it served rank 0, which ended
                raise SystemExit(0)
            self._ranks, self.model = started
        else:
            self.model = Model.load(self.model_path)
        lora = {self.model.load_adapter(lora_path): lora_scale} if lora_path is not None else {}
        self.vocab = self.model.vocab
        # n_outputs_max as llama-server sets it: every row only when all logits or embeddings are wanted
        params = ContextParams(
            n_ctx=n_ctx,
            n_batch=n_batch,
            n_ubatch=n_ubatch,
            n_seq_max=n_seq_max,
            n_threads=n_threads or 0,
            type_k=type_k,
            type_v=type_v,
            n_outputs_max=0 if logits_all or embedding else spec.n_outputs_max(n_seq_max, n_seq_max),  # 0: n_batch
            backend=backend,
        )
        if isinstance(pooling_type, int):
            pooling_type = POOLING_TYPES[pooling_type] if 0 <= pooling_type < len(POOLING_TYPES) else None
        self.ctx = Context(self.model, params, embeddings=embedding, pooling=pooling_type)
        self.ctx.set_adapters(lora)
        self.embedding = embedding
        self.speculator = speculator_for(spec, self.ctx, draft_model)
        self.spec_stats = SpecStats()  # drafts verified over this object's completions
        self.ctx.warmup()
        self.seed = seed
        self.logits_all = logits_all
        self.verbose = verbose
        self.n_tokens = 0
        self.input_ids = np.zeros(self.ctx.n_ctx, dtype=np.intc)
        rows = self.ctx.n_ctx if logits_all else self.ctx.cparams.n_batch
        self.scores = np.ndarray((rows, self.vocab.n_tokens), dtype=np.single)
        self._last_logits = torch.empty(0)

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do without them)."""
        if self._ranks is not None:
            self._ranks.stop()
            self._ranks = None

    # -- llama-cpp-python's small accessors ---------------------------------------------------
    def n_ctx(self) -> int:
        return self.ctx.n_ctx

    def n_vocab(self) -> int:
        return self.vocab.n_tokens

    def token_bos(self) -> int:
        return self.vocab.bos

    def token_eos(self) -> int:
        return self.vocab.eos

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        """llama_tokenize of `text`'s bytes: bytes that are not UTF-8 are tokenized as llama.cpp
        does them (through surrogate escapes), not replaced."""
        return self.vocab.tokenize(text.decode("utf-8", errors="surrogateescape"), add_bos, special)

    def detokenize(self, tokens: list[int], prev_tokens: list[int] | None = None, special: bool = False) -> bytes:
        out = b"".join(self.vocab.token_to_piece(t, special) for t in tokens)
        # as llama-cpp-python: a leading BOS drops the space an SPM tokenizer put before the text
        if tokens and tokens[0] == self.vocab.bos and out[:1] == b" ":
            out = out[1:]
        return out

    def reset(self) -> None:
        self.n_tokens = 0

    # -- evaluation -----------------------------------------------------------------------------
    def eval(self, tokens: list[int]) -> None:
        """Append `tokens` after the first n_tokens; logits land in `scores` by position."""
        if self.n_tokens + len(tokens) > self.ctx.n_ctx:
            raise ContextError(f"eval of {len(tokens)} tokens after {self.n_tokens} exceeds n_ctx = {self.ctx.n_ctx}")
        self.ctx.memory.seq_rm(0, self.n_tokens, -1)
        n_batch = self.ctx.cparams.n_batch
        for i in range(0, len(tokens), n_batch):
            chunk = list(tokens[i : i + n_batch])
            n_past = self.n_tokens
            self.ctx.decode(Batch.from_tokens(chunk, n_past, 0, all_logits=self.logits_all))
            logits = self.ctx.logits
            self._last_logits = logits[-1]
            if self.logits_all:
                self.scores[n_past : n_past + len(chunk)] = logits.numpy()
            else:
                self.scores[len(chunk) - 1] = logits[-1].numpy()
            self.input_ids[n_past : n_past + len(chunk)] = chunk
            self.n_tokens += len(chunk)

    def _set_evaluated(self, tokens: list[int]) -> None:
        self.input_ids[: len(tokens)] = tokens
        self.n_tokens = len(tokens)

    def after_step(self, cache: list[int], n_before: int, n_rows: int) -> None:
        """A generation step decoded rows n_before.. (the sampled token, then accepted drafts)."""
        self.input_ids[: len(cache)] = cache
        self.n_tokens = len(cache)
        logits = self.ctx.logits[:n_rows]
        self._last_logits = logits[-1]
        if self.logits_all:
            self.scores[n_before : n_before + n_rows] = logits.numpy()
        else:
            self.scores[0] = logits[-1].numpy()

    # -- state (llama-cpp-python's names) ------------------------------------------------------
    def save_state(self) -> LlamaState:
        tokens = self.input_ids[: self.n_tokens].tolist()
        return llama_state.capture(self.ctx, tokens, self._last_logits, self.seed)

    def load_state(self, state: LlamaState) -> None:
        """Restore; a state from another model or cache type is refused before anything changes."""
        tokens, last = llama_state.restore(self.ctx, state, self.n_vocab())
        self._set_evaluated(tokens)
        if last is not None:
            self._last_logits = last
            self.scores[0] = last.numpy()
        self.seed = state.seed

    def save_state_file(self, path: str | os.PathLike[str]) -> int:
        return llama_state.save_file(self.ctx, self.input_ids[: self.n_tokens].tolist(), path)

    def load_state_file(self, path: str | os.PathLike[str]) -> int:
        self._set_evaluated(llama_state.load_file(self.ctx, path))
        self._last_logits = torch.empty(0)
        return self.n_tokens

    # -- embeddings ------------------------------------------------------------------------------
    def embed(
        self, input: str | list[str], normalize: bool = True, truncate: bool = True
    ) -> Embedding | list[Embedding]:
        """The embedding of a text (a list of them for a list): the model's pooling of the
        final-norm hidden states, Euclidean-normalised; per-token rows with pooling none."""
        vecs, _ = self._embed(input, normalize, truncate)
        return vecs[0] if isinstance(input, str) else vecs

    def create_embedding(self, input: str | list[str], model: str | None = None) -> dict[str, object]:
        """OpenAI's embeddings response, as llama-cpp-python's (vectors as /v1/embeddings gives)."""
        vecs, n = self._embed(input, True, True)
        data = [{"object": "embedding", "embedding": v, "index": i} for i, v in enumerate(vecs)]
        usage = {"prompt_tokens": n, "total_tokens": n}
        return {"object": "list", "data": data, "model": model or self.model_path, "usage": usage}

    def _embed(self, input: str | list[str], normalize: bool, truncate: bool) -> tuple[list[Embedding], int]:
        if not self.embedding:
            raise RuntimeError("Llama model must be created with embedding=True to call this method")
        texts = [input] if isinstance(input, str) else list(input)
        n_ctx = self.ctx.cparams.n_ctx_seq
        prompts = [fit_prompt(self.ctx, self.vocab.tokenize(t, True, False), truncate, n_ctx) for t in texts]
        self.n_tokens = 0  # the embedding decodes reuse sequence 0: nothing evaluated is kept
        vecs = embed_prompts(self.ctx, prompts, 2 if normalize else -1)
        return [v.tolist() for v in vecs], sum(map(len, prompts))

    # -- completion -----------------------------------------------------------------------------
    def prefix_eval(self, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
        """Evaluate `prompt`, reusing the longest common prefix with what is already evaluated (at
        least one token new); (the tokens now evaluated, the logits row that predicts the next)."""
        common = min(common_prefix(self.input_ids[: self.n_tokens].tolist(), prompt), len(prompt) - 1)
        self.n_tokens = common
        self.eval(prompt[common:])
        return self.input_ids[: self.n_tokens].tolist(), self._last_logits

    def create_completion(
        self,
        prompt: str | list[int],
        suffix: str | None = None,
        max_tokens: int | None = 16,
        temperature: float = 0.8,
        top_p: float = 0.95,
        min_p: float = 0.05,
        typical_p: float = 1.0,
        logprobs: int | None = None,
        echo: bool = False,
        stop: str | list[str] | None = None,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        repeat_penalty: float = 1.0,
        top_k: int = 40,
        stream: bool = False,
        seed: int | None = None,
        mirostat_mode: int = 0,
        mirostat_tau: float = 5.0,
        mirostat_eta: float = 0.1,
        grammar: str | Grammar | None = None,
        logit_bias: dict[int, float] | None = None,
        **_ignored: object,
    ) -> CompletionChunk | Iterator[CompletionChunk]:
        """llama-cpp-python's create_completion; `grammar` is GBNF text (or a compiled Grammar)."""
        sp = SamplerParams(
            temp=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            typ_p=typical_p,
            seed=self.seed if seed is None else seed,
            repeat_penalty=repeat_penalty,
            frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty,
            mirostat=mirostat_mode,
            mirostat_tau=mirostat_tau,
            mirostat_eta=mirostat_eta,
        )
        if isinstance(grammar, str):
            grammar = compile_grammar(grammar)
        bias = [(int(t), float(b)) for t, b in (logit_bias or {}).items()]
        chunks = completion_chunks(self, prompt, max_tokens, sp, logprobs, echo, stop, grammar, bias)
        if stream:
            return chunks
        text, lps, final = "", [], None
        for c in chunks:
            choice = c["choices"][0]
            text += choice["text"]
            if choice["logprobs"]:
                lps.append(choice["logprobs"])
            final = c
        assert final is not None
        choice = final["choices"][0]
        choice["text"] = text
        choice["logprobs"] = None if logprobs is None else join_logprobs(lps)
        return final

    __call__ = create_completion
