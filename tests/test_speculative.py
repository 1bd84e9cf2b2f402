"""Speculative decoding: drafts verified in one decode give the same greedy tokens as plain
decoding (n-gram drafts, the default model as its own draft, a tiny random draft with the same
vocabulary), in `complete` and in the server's slots under concurrency; the rejection rule keeps
the target's distribution; -ub below the verification rows costs passes; bad input is one line."""

from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from cli_inproc import run_cli
from test_server import Live, metric, post
from tiny_models import TinySpec, write_tiny_model

from ubatch.cli.context_flags import ContextFlags
from ubatch.cli.server.app import ServerOptions, create_app
from ubatch.cli.server.run import EngineOptions, load_engine
from ubatch.cli.spec_flags import SpecFlags
from ubatch.engine.completion.complete import CompletionStats, complete
from ubatch.engine.context.context import Context
from ubatch.engine.generation.generation import GenerationParams
from ubatch.engine.gguf.file import open_gguf
from ubatch.engine.model.model import Model
from ubatch.engine.params import ContextParams
from ubatch.engine.sampling.chain import Sampler, SamplerParams
from ubatch.engine.spec.draft import NgramSimple, create_speculator
from ubatch.engine.spec.speculative import SpecError, SpecParams
from ubatch.engine.spec.verify import rejection_choice

CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
# every greedy margin of this prompt's first 40 tokens is above 1.7 logits, so no rounding
# difference between a GEMV, a GEMM or another ubatch split can flip a token (CODE[:20] has a
# 0.0003 tie at its 7th token)
PROMPT = "Copy the code exactly.\n" + CODE * 2 + "Copy:\n" + CODE[:25]
NGRAM = SpecParams(types=("ngram-simple",), ngram_size_n=3, ngram_size_m=6)


def greedy(model: Model, n: int, spec: SpecParams | None = None, draft: Model | None = None, ub: int = 512) -> Any:
    ctx = Context(model, ContextParams(n_ctx=1024, n_ubatch=ub, n_outputs_max=16))
    sp = None
    if spec is not None:
        dctx = Context(draft, ContextParams(n_ctx=1024, n_outputs_max=1)) if draft is not None else None
        sp = create_speculator(spec, ctx, dctx)
    st = CompletionStats()
    ids = model.vocab.tokenize(PROMPT, add_special=True)
    toks = [
        e.token
        for e in complete(ctx, ids, Sampler(SamplerParams(temp=0)), GenerationParams(n_predict=n), st, speculator=sp)
        if e.token >= 0
    ]
    return toks, st


@pytest.fixture(scope="module")
def plain(default_model: Model) -> list[int]:
    return greedy(default_model, 32)[0]


def test_ngram_simple_follows_llama_cpp() -> None:
    d = NgramSimple(2, 3)
    hist = [9, 1, 2, 3, 4, 5, 6, 7, 1]  # the last token 1 plus the sampled 2 occurred at position 1
    assert d.draft(0, hist, 2, 3).tokens == [3, 4, 5]
    assert d.draft(0, hist, 8, 3).tokens == []  # no earlier "1 8"
    assert d.draft(0, hist[:6], 2, 3).tokens == []  # too little history: n + m + 1 tokens needed
    assert NgramSimple(2, 9).draft(0, [5, 1, 2, 8, 0, 0, 0, 0, 0, 0, 0, 0, 1], 2, 9).tokens[:2] == [8, 0]


@pytest.mark.parametrize("ub", [512, 4])
def test_ngram_drafts_give_the_same_greedy_tokens(default_model: Model, plain: list[int], ub: int) -> None:
    toks, st = greedy(default_model, 32, NGRAM, ub=ub)
    assert toks == plain
    assert st.spec.n_drafts > 0 and st.spec.n_accepted > 0  # speculation really happened
    assert st.n_eval_calls < st.n_eval  # fewer decode calls than tokens
    # every verification of 1 + k rows took ceil((1 + k) / ub) forward passes
    d = st.spec.drafted_per_pos + [0]
    lengths = {k + 1: d[k] - d[k + 1] for k in range(len(d) - 1)}
    assert st.spec.n_verify_ubatches == sum(n * math.ceil((1 + k) / ub) for k, n in lengths.items())


def test_the_model_as_its_own_draft(default_model: Model, plain: list[int]) -> None:
    spec = SpecParams(types=("draft-simple",), n_max=4)
    toks, st = greedy(default_model, 32, spec, draft=default_model)
    assert toks == plain
    assert st.spec.acceptance > 0.9  # the draft is the target: nearly everything is accepted


def test_a_tiny_random_draft_with_the_same_vocabulary(
    default_model: Model, default_model_path: Path, plain: list[int], tmp_path: Path
) -> None:
    md = open_gguf(default_model_path).metadata
    vocab = (
        list(md["tokenizer.ggml.tokens"]),
        [float(x) for x in md["tokenizer.ggml.scores"]],
        [int(x) for x in md["tokenizer.ggml.token_type"]],
    )
    path = write_tiny_model(tmp_path / "draft.gguf", TinySpec(n_embd=32, n_layer=2, n_ff=64, vocab=vocab))
    spec = SpecParams(types=("draft-simple",), n_max=3)
    toks, st = greedy(default_model, 32, spec, draft=Model.load(path))
    assert toks == plain  # a bad draft costs speed, never tokens
    assert st.spec.n_drafted > 0


def test_a_draft_with_another_vocabulary_is_refused(default_model: Model, tiny_gemma_model: Model) -> None:
    ctx = Context(default_model, ContextParams(n_ctx=256))
    with pytest.raises(SpecError, match="vocabulary has 326 tokens but the target's has 262144"):
        create_speculator(SpecParams(types=("draft-simple",)), ctx, Context(tiny_gemma_model, ContextParams(n_ctx=256)))


def test_rejection_sampling_keeps_the_target_distribution() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0])
    p = torch.softmax(logits.double(), 0)
    q = {0: 0.1, 1: 0.6, 2: 0.3}  # the draft's distribution: far from p
    s = Sampler(SamplerParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7))
    draw = torch.multinomial(
        torch.tensor(list(q.values())), 6000, replacement=True, generator=torch.Generator().manual_seed(1)
    )
    keys = list(q)
    counts = torch.zeros(4)
    for i in draw.tolist():
        counts[rejection_choice(s, logits, keys[i], q)] += 1
    assert torch.allclose(counts / counts.sum(), p.float(), atol=0.02)
    greedy_s = Sampler(SamplerParams(temp=0))
    assert rejection_choice(greedy_s, logits, 1, q) is None  # greedy chains sample and match


def test_spec_params_are_checked() -> None:
    for p, msg in [
        (SpecParams(types=("draft-eagle3",)), "not supported by ubatch"),
        (SpecParams(types=("bogus",)), "unknown --spec-type"),
        (SpecParams(types=("ngram-simple",), n_max=-1), "--spec-draft-n-max must be >= 0"),
        (SpecParams(types=("draft-simple",), n_min=5, n_max=3), "--spec-draft-n-min"),
    ]:
        with pytest.raises(SpecError, match=msg):
            p.check()
    assert SpecParams(types=("draft-simple", "ngram-simple")).ordered() == ["ngram-simple", "draft-simple"]
    assert SpecParams(types=("ngram-simple",)).n_outputs_max(1, 4) == 4 * 49


@pytest.mark.parametrize(
    "args, msg",
    [
        (["-md", "/nope.gguf", "--spec-type", "draft-simple"], "draft model not found: /nope.gguf"),
        (["--spec-type", "draft-simple"], "needs a draft model"),
        (["-md", "{m}", "--spec-type", "draft-simple", "--spec-draft-n-max", "0"], "--spec-draft-n-max 0 leaves"),
        (["--spec-type", "ngram-mod"], "--spec-type ngram-mod is not supported"),
        (["--spec-draft-sampling", "sometimes"], "must be one of: greedy, probabilistic"),
    ],
)
def test_bad_speculative_flags_are_one_line(args: list[str], msg: str, tiny_gemma: Path) -> None:
    args = [a.replace("{m}", str(tiny_gemma)) for a in args]
    r = run_cli(["cli", "-m", str(tiny_gemma), "-no-cnv", "-p", "hi", "-n", "2", *args])
    assert r.returncode == 1 and msg in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_cli_refuses_another_vocabulary_and_notes_an_unused_draft(
    tiny_gemma: Path, tiny_llama: Path, default_model_path: Path
) -> None:
    base = ["cli", "-m", str(tiny_gemma), "-no-cnv", "-p", "hi", "-n", "4", "--temp", "0"]
    other = run_cli([*base, "-md", str(default_model_path), "--spec-type", "draft-simple"])
    assert other.returncode == 1 and "vocabulary has 262144 tokens but the target's has 326" in other.stderr
    assert "Traceback" not in other.stderr and len(other.stderr.strip().splitlines()) == 1
    r = run_cli([*base, "-md", str(tiny_llama)])  # llama.cpp loads a draft only with --spec-type draft-simple
    assert r.returncode == 0 and "notice: -md" in r.stderr and "add --spec-type draft-simple" in r.stderr


def test_cli_reports_acceptance(tiny_gemma: Path) -> None:
    base = run_cli(
        ["cli", "-m", str(tiny_gemma), "-no-cnv", "-p", "a b a b a b", "-n", "40", "--temp", "0", "--ignore-eos"]
    )
    spec = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "1", "--spec-ngram-simple-size-m", "4"]
    r = run_cli(
        ["cli", "-m", str(tiny_gemma), "-no-cnv", "-p", "a b a b a b", "-n", "40", "--temp", "0", "--ignore-eos", *spec]
    )
    assert r.returncode == 0 and r.stdout == base.stdout
    assert "speculative: drafters = ngram-simple (n_max = 4)" in r.stderr
    assert "n_outputs_max         = 5" in r.stderr  # 1 x (1 + 4)
    assert "draft acceptance = " in r.stderr and "forward passes = " in r.stderr


def test_server_slots_verify_drafts_under_concurrency(default_model_path: Path, default_model: Model) -> None:
    # Which rows share a ubatch (GEMV for at most 16, the GEMM above) moves logits by up to
    # ~0.01, so a concurrent schedule needs prompts without near-ties: both keep every greedy
    # margin above 1.7 for 24 tokens.
    prompts = [PROMPT, "Repeat: one two three, one two three, one two three, one two"]
    expected = []
    for p in prompts:
        ctx = Context(default_model, ContextParams(n_ctx=1024))
        ids = default_model.vocab.tokenize(p, add_special=True)
        expected.append(
            [
                e.token
                for e in complete(
                    ctx, ids, Sampler(SamplerParams(temp=0)), GenerationParams(n_predict=24, ignore_eos=True)
                )
                if e.token >= 0
            ]
        )
    spec = SpecFlags(spec_type=["ngram-simple"], spec_ngram_simple_size_n=3, spec_ngram_simple_size_m=5)
    eng = load_engine(
        EngineOptions(default_model_path, ContextFlags(ctx_size=2048, parallel=2), warmup=False, spec=spec, quiet=True)
    )
    sch = eng.scheduler
    assert sch.ctx.cparams.n_outputs_max == 2 * (1 + 5)
    live = Live(create_app(eng, ServerOptions(metrics=True, alias="gemma")))
    try:
        out: list[Any] = [None, None]
        barrier = threading.Barrier(2)

        def ask(i: int) -> None:
            barrier.wait()
            body = {"prompt": prompts[i], "n_predict": 24, "temperature": 0, "ignore_eos": True, "return_tokens": True}
            out[i] = post(live.url, "/completion", body).json()

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i in range(2):
            assert out[i]["tokens"] == expected[i]
        assert any(o["timings"].get("draft_n", 0) > 0 for o in out)
        assert metric(live.url, "llamacpp:spec_decode_num_drafts_total") > 0
        assert metric(live.url, "llamacpp:spec_decode_num_accepted_tokens_total") > 0
        assert 'spec_decode_num_accepted_tokens_per_pos_total{position="0"}' in httpx.get(live.url + "/metrics").text
        assert all(s["speculative"] for s in httpx.get(live.url + "/slots").json())
        assert any(len(r.rows) == 2 for r in sch.records)  # both slots rode in the same decode
    finally:
        live.close()
        eng.stop()


def test_window_cache_keeps_what_the_next_row_needs_after_a_rejected_draft(tmp_path: Path) -> None:
    """gemma3's sliding-window cache reuses cells the window left. With n_swa + n_ubatch exactly
    one 256-cell pad there is no slack: a verification split over several ubatches must not reuse
    a cell that the row after a rejected draft still sees (nor fail: it verifies fewer rows)."""
    model = Model.load(write_tiny_model(tmp_path / "w.gguf", TinySpec(n_swa=254, seed=3)))
    draft = Model.load(write_tiny_model(tmp_path / "d.gguf", TinySpec(arch="llama", n_layer=1, seed=5)))

    def run(spec: SpecParams | None) -> tuple[list[int], CompletionStats]:
        ctx = Context(model, ContextParams(n_ctx=1024, n_batch=64, n_ubatch=2, n_outputs_max=8))
        assert ctx.memory.caches[1].size == 256  # the window cache wraps within this run
        sp = None
        if spec is not None:  # a random draft with the tiny vocabulary: 4-token drafts, mostly rejected
            dctx = Context(draft, ContextParams(n_ctx=1024, n_batch=64, n_ubatch=2))
            sp = create_speculator(spec, ctx, dctx)
        swa = ctx.memory.caches[1]

        def window_complete(batch: Any, ub: Any, rec: Any) -> None:  # what the first row must see
            if batch.kind_of(int(ub.batch_idx[0])) == "g":
                p, cells = int(ub.pos[0]), swa.streams[0]
                missing.extend(set(range(max(0, p - 253), p)) - set(cells.pos[cells.pos >= 0].tolist()))

        ctx.observers.append(window_complete)
        st = CompletionStats()
        ids = model.vocab.tokenize("a b c a b c a b", add_special=True)
        sampler = Sampler(SamplerParams(temp=0))
        params = GenerationParams(n_predict=300, ignore_eos=True)
        return [e.token for e in complete(ctx, ids, sampler, params, st, speculator=sp)], st

    missing: list[int] = []
    plain, _ = run(None)
    toks, st = run(SpecParams(types=("draft-simple",), n_max=4))
    assert not missing
    assert st.spec.n_drafts > 20 and st.spec.n_accepted < st.spec.n_drafted  # drafts were rejected
    assert toks == plain


def test_llama_api_speculates_with_the_same_text(default_model_path: Path, plain: list[int]) -> None:
    from ubatch import Llama

    kw = {"n_ctx": 1024, "verbose": False}
    spec = Llama(str(default_model_path), spec_type="ngram-simple", spec_ngram_size_n=3, spec_ngram_size_m=6, **kw)
    got = spec.create_completion(PROMPT, max_tokens=32, temperature=0)
    assert got["choices"][0]["text"] == spec.detokenize(plain[:32]).decode()
    assert got["usage"]["completion_tokens"] == 32 and spec.spec_stats.n_accepted > 0
    assert spec.n_tokens == len(spec.tokenize(PROMPT.encode())) + 31  # the last token is sampled, not decoded
    with pytest.raises(SpecError, match="needs draft_model"):
        Llama(str(default_model_path), spec_type="draft-simple", **kw)


def test_probabilistic_drafts_are_verified_by_rejection(tiny_gemma_model: Model) -> None:
    ctx = Context(tiny_gemma_model, ContextParams(n_ctx=512, n_outputs_max=8))
    dctx = Context(tiny_gemma_model, ContextParams(n_ctx=512, n_outputs_max=1))
    sp = create_speculator(SpecParams(types=("draft-simple",), n_max=4, probabilistic=True), ctx, dctx)
    sampler = Sampler(SamplerParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=3))
    ids = tiny_gemma_model.vocab.tokenize("a b c", add_special=True)
    st = CompletionStats()
    params = GenerationParams(n_predict=64, ignore_eos=True)
    toks = [e.token for e in complete(ctx, ids, sampler, params, st, speculator=sp) if e.token >= 0]
    assert len(toks) == 64 and st.spec.n_drafts > 0
    assert all(q for q in sp.drafters[0].draft(0, ids, toks[0], 2).q)  # the draft's probabilities travel
    # the draft is the target at temperature 1 over its top 10: most drafted tokens pass p/q
    assert st.spec.acceptance > 0.5
