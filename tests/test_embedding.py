"""Embeddings and reranking: the engine's hidden states against a cache-free reference (causal
and bidirectional, as the model's key says), the pooling types' relations, batching, and the
server's /embedding, /v1/embeddings and /rerank on a real loopback port agreeing with
`Llama.embed` and with a direct torch computation of the rank head, plus llama-server's errors.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from embd_reference import reference_hidden, reference_score, write_llama
from test_server import Live, post

from ubatch import Llama
from ubatch.cli.context_flags import ContextFlags
from ubatch.cli.server.app import ServerOptions, create_app
from ubatch.cli.server.run import EngineOptions, load_engine, pooling_line
from ubatch.engine.context.context import Context
from ubatch.engine.context.report import memory_plan
from ubatch.engine.generation.embedding import embed_prompts, embed_sequences
from ubatch.engine.model.model import Model
from ubatch.engine.params import ContextParams

IDS = [2, *range(40, 70)]  # 31 tokens, past the tiny gemma's 8-token window
TEXTS = ["the cat sat on the mat", "a b c", "hello world, hello"]


@pytest.fixture(scope="module")
def ranker(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny llama with a rank head; no pooling key (llama.cpp's default: none), causal."""
    return write_llama(tmp_path_factory.mktemp("e") / "rank.gguf")


@pytest.fixture(scope="module")
def bidir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same weights with attention.causal = false and pooling_type = mean (1)."""
    return write_llama(tmp_path_factory.mktemp("e") / "bidir.gguf", causal=False, pooling=1)


def hidden(path_or_model: Path | Model, ids: list[int], **kw: int) -> torch.Tensor:
    m = path_or_model if isinstance(path_or_model, Model) else Model.load(path_or_model)
    ctx = Context(m, ContextParams(n_ctx=256, type_k="f32", type_v="f32", **kw), embeddings=True)
    return embed_sequences(ctx, [(0, ids)])[0]


# -- the engine ----------------------------------------------------------------------------------


def test_hidden_states_are_the_reference_final_norm_rows(ranker: Path, bidir: Path, tiny_gemma_model) -> None:
    m = Model.load(ranker)
    assert torch.allclose(hidden(m, IDS), reference_hidden(m, IDS), atol=2e-5)
    # gemma3: sliding window, iSWA cache, ubatches of 8 rows continued through the cache
    g = tiny_gemma_model
    assert torch.allclose(hidden(g, IDS, n_ubatch=8), reference_hidden(g, IDS), atol=2e-5)
    b = Model.load(bidir)
    assert m.hparams.causal_attn and not b.hparams.causal_attn
    hb = hidden(b, IDS)
    assert torch.allclose(hb, reference_hidden(b, IDS, causal=False), atol=2e-5)
    assert not torch.allclose(hb, reference_hidden(b, IDS), atol=1e-3)


def test_causal_rows_ignore_later_tokens_bidirectional_ones_do_not(ranker: Path, bidir: Path) -> None:
    other = IDS[:10] + [80] + IDS[11:]
    for path, causal in ((ranker, True), (bidir, False)):
        a, b = hidden(path, IDS), hidden(path, other)
        assert torch.allclose(a[:10], b[:10], atol=1e-6) == causal
        assert not torch.allclose(a[10:], b[10:], atol=1e-4)


def test_pooling_types_relate_as_llama_cpp_defines_them(ranker: Path, bidir: Path) -> None:
    kw = {"n_ctx": 256, "type_k": "f32", "type_v": "f32", "embedding": True}
    rows = torch.tensor(Llama(ranker, pooling_type="none", **kw).embed("the cat sat", normalize=False))
    pooled = {
        p: torch.tensor(Llama(ranker, pooling_type=p, **kw).embed("the cat sat", False))
        for p in ("mean", "cls", "last")
    }
    assert rows.shape[1] == 64 and rows.shape[0] > 3
    assert torch.allclose(pooled["mean"], rows.mean(0), atol=1e-5)
    assert torch.allclose(pooled["cls"], rows[0]) and torch.allclose(pooled["last"], rows[-1])
    unit = torch.tensor(Llama(ranker, pooling_type=1, **kw).embed("the cat sat"))
    assert torch.allclose(unit, pooled["mean"] / pooled["mean"].norm(), atol=1e-6)
    assert Llama(bidir, **kw).ctx.pooling == "mean" and Llama(ranker, **kw).ctx.pooling == "none"
    # rank pooling: the head on the first row without causal attention (the last row with it)
    b = Model.load(bidir)
    score = Llama(bidir, pooling_type="rank", **kw).embed("the cat sat", normalize=False)
    assert score == pytest.approx([reference_score(b, b.vocab.tokenize("the cat sat"), causal=False)], rel=1e-5)
    with pytest.raises(RuntimeError, match="embedding=True"):
        Llama(ranker, n_ctx=256).embed("x")


def test_several_prompts_in_one_decode_equal_one_at_a_time(ranker: Path, bidir: Path) -> None:
    for path in (ranker, bidir):
        m = Model.load(path)
        ctx = Context(m, ContextParams(n_ctx=768, n_seq_max=3), embeddings=True, pooling="mean")
        prompts = [m.vocab.tokenize(t) for t in TEXTS]
        n0 = ctx.perf.n_decode
        together = embed_prompts(ctx, prompts)
        # causal: one decode (its ubatches continue through the cache); bidirectional with a
        # stream per sequence: only prompts of one length share a ubatch, so one decode each
        assert ctx.perf.n_decode - n0 == (1 if ctx.cparams.causal_attn else 3)
        for p, v in zip(prompts, together):
            assert torch.allclose(embed_prompts(ctx, [p])[0], v, atol=1e-4)  # f16 cells, other kernel shapes
        # the output buffer grew to the rows of the largest embedding decode, and the plan says so
        rows = sum(map(len, prompts)) if ctx.cparams.causal_attn else max(map(len, prompts))
        assert ctx.workspace_regrows == 0 and ctx.embd_bytes == rows * 64 * 4
        assert memory_plan(ctx).output_bytes == (m.hparams.n_vocab * ctx.output_rows + rows * 64) * 4


# -- the server ----------------------------------------------------------------------------------


@contextmanager
def served(path: Path, **kw: object) -> Iterator[str]:
    """`ubatch server` with these flags, in-process on a free loopback port: -np 2 -c 512 -ub 64."""
    flags = {k: kw.pop(k) for k in ("embedding", "pooling", "reranking") if k in kw}
    eng = load_engine(
        EngineOptions(model=path, context=ContextFlags(parallel=2, ctx_size=512, ubatch_size=64), quiet=True, **flags)
    )  # type: ignore[arg-type]
    live = Live(create_app(eng, ServerOptions(alias="tiny", **flags)))  # type: ignore[arg-type]
    try:
        yield live.url
        assert eng.scheduler.ctx.workspace_regrows == 0  # the reservation covered every embedding graph
    finally:
        live.close()
        eng.stop()


def error(r: httpx.Response, code: int, needle: str) -> None:
    assert r.status_code == code, r.text
    e = r.json()["error"]
    assert e["code"] == code and needle in e["message"], e


def test_embedding_routes_agree_with_llama_embed(ranker: Path) -> None:
    ref = Llama(ranker, n_ctx=256, n_ubatch=64, embedding=True, pooling_type="mean")
    want = ref.embed(TEXTS)
    assert ref.ctx.workspace_regrows == 0 and ref.ctx.cparams.n_outputs_max == 256  # llama.cpp: n_batch
    with served(ranker, embedding=True, pooling="mean") as url:
        native = post(url, "/embedding", {"content": TEXTS[0]}).json()
        assert native[0]["index"] == 0 and len(native[0]["embedding"]) == 1
        assert np.allclose(native[0]["embedding"][0], want[0], atol=1e-4)
        oai = post(url, "/v1/embeddings", {"input": TEXTS, "model": "m1"}).json()
        assert oai["object"] == "list" and oai["model"] == "m1" and [d["index"] for d in oai["data"]] == [0, 1, 2]
        n_tokens = sum(
            len(httpx.post(url + "/tokenize", json={"content": t, "add_special": True}).json()["tokens"]) for t in TEXTS
        )
        assert oai["usage"] == {"prompt_tokens": n_tokens, "total_tokens": n_tokens}
        for d, w in zip(oai["data"], want):  # three inputs in one decode = each alone (Llama.embed)
            assert np.allclose(d["embedding"], w, atol=1e-4) and abs(np.linalg.norm(d["embedding"]) - 1) < 1e-5
        b64 = post(url, "/v1/embeddings", {"input": TEXTS[1], "encoding_format": "base64"}).json()["data"][0]
        assert b64["encoding_format"] == "base64"
        assert np.allclose(
            np.frombuffer(base64.b64decode(b64["embedding"]), "<f4"), oai["data"][1]["embedding"], atol=1e-6
        )
        raw = post(url, "/embeddings", {"input": TEXTS[1], "embd_normalize": -1}).json()[0]["embedding"][0]
        assert np.allclose(np.array(raw) / np.linalg.norm(raw), oai["data"][1]["embedding"], atol=1e-5)
        maxabs = post(url, "/embeddings", {"input": TEXTS[1], "embd_normalize": 0}).json()[0]["embedding"][0]
        assert abs(max(abs(x) for x in maxabs) - 32760) < 1e-2
        toks = post(url, "/v1/embeddings", {"input": [[2, 40, 41], [2, 40, 41]]}).json()["data"]
        assert toks[0]["embedding"] == toks[1]["embedding"]
        # embeddings while the other slot generates: the same vectors
        with ThreadPoolExecutor(4) as pool:
            gen = pool.submit(post, url, "/completion", {"prompt": "hi", "n_predict": 40, "ignore_eos": True})
            embs = [pool.submit(post, url, "/v1/embeddings", {"input": t}) for t in TEXTS]
            assert gen.result().json()["tokens_predicted"] == 40
            for e, w in zip(embs, want):
                assert np.allclose(e.result().json()["data"][0]["embedding"], w, atol=1e-4)
        # llama-server's errors, each a 4xx; the server keeps serving
        error(post(url, "/v1/embeddings", {"input": []}), 400, '"input" must not be empty')
        error(post(url, "/v1/embeddings", {"input": True}), 400, '"input"')
        error(post(url, "/v1/embeddings", {"input": "x", "encoding_format": 1}), 400, "float or base64")
        error(post(url, "/v1/embeddings", {}), 400, '"input" or "content" must be provided')
        error(post(url, "/v1/embeddings", {"input": "a " * 100}), 400, "too large to process")
        error(post(url, "/rerank", {"query": "a", "documents": ["b"]}), 501, "Start it with `--reranking`")
        assert httpx.get(url + "/health").status_code == 200
        assert np.allclose(
            post(url, "/v1/embeddings", {"input": TEXTS[2]}).json()["data"][0]["embedding"], want[2], atol=1e-4
        )


def test_pooling_none_gives_token_rows_and_no_oai_answer(ranker: Path) -> None:
    rows = Llama(ranker, n_ctx=256, n_ubatch=64, embedding=True).embed(TEXTS[0], normalize=False)
    with served(ranker, embedding=True, pooling="none") as url:
        got = post(url, "/embedding", {"content": TEXTS[0]}).json()[0]["embedding"]
        assert len(got) == len(rows) and np.allclose(got, rows, atol=1e-4)
        r = post(url, "/v1/embeddings", {"input": TEXTS[0]})
        error(r, 400, "Pooling type 'none' is not OAI compatible")
        # the status and type stay llama-server's; the message adds the pooling in force and the fix
        assert "from --pooling" in r.json()["error"]["message"] and "--pooling mean" in r.json()["error"]["message"]
        assert httpx.get(url + "/health").status_code == 200


def test_startup_names_the_pooling_and_the_flag() -> None:
    none = pooling_line("none", from_flag=False)
    assert "'none' (from the model's metadata)" in none and "--pooling mean" in none and "/v1/embeddings" in none
    assert pooling_line("mean", from_flag=True) == "embeddings pooling 'mean' (from --pooling); --pooling changes it"


def test_rerank_orders_by_the_rank_head_score(ranker: Path, tiny_gemma: Path) -> None:
    m = Model.load(ranker)
    # the last document (81 tokens) is longer than -ub 64: rank pooling of a causal model reads
    # the last row, so it is evaluated in two decodes, continued through the KV cache
    query, docs = "what sat", ["the cat sat on the mat", "zz yy", "a dog ran", "cat " * 20]
    want = [reference_score(m, [2, *m.vocab.tokenize(query, False), *m.vocab.tokenize(d, False)]) for d in docs]
    with served(ranker, reranking=True) as url:
        for path in ("/rerank", "/reranking", "/v1/rerank", "/v1/reranking"):
            r = post(url, path, {"query": query, "documents": docs}).json()
            assert [x["index"] for x in r["results"]] == sorted(range(4), key=lambda i: -want[i])
            assert np.allclose(
                [x["relevance_score"] for x in r["results"]], sorted(want, reverse=True), rtol=1e-3
            )  # f16 cells
        assert r["usage"]["prompt_tokens"] > 4 * 2 and r["model"] == "tiny"
        top = post(url, "/rerank", {"query": query, "documents": docs, "top_n": 2}).json()["results"]
        assert [x["index"] for x in top] == [x["index"] for x in r["results"][:2]]
        tei = post(url, "/rerank", {"query": query, "texts": docs, "return_text": True}).json()
        assert [(x["index"], x["text"]) for x in tei] == [(x["index"], docs[x["index"]]) for x in r["results"]]
        error(post(url, "/rerank", {"query": query, "documents": []}), 400, '"documents" must be a non-empty')
        error(post(url, "/rerank", {"query": query, "documents": [1, 2]}), 400, '"documents" must be a non-empty')
        error(post(url, "/rerank", {"documents": docs}), 400, '"query" must be provided')
        error(post(url, "/rerank", {"query": query, "documents": ["a " * 300]}), 400, "exceeds the available context")
        error(post(url, "/v1/embeddings", {"input": "x"}), 400, "use /rerank")
        assert httpx.get(url + "/health").status_code == 200
    with served(tiny_gemma, reranking=True) as url:  # --reranking starts the server on any model
        error(post(url, "/rerank", {"query": "a", "documents": ["b"]}), 400, "no rank head")
        assert httpx.get(url + "/health").status_code == 200
    with served(ranker) as url:
        msg = "This server does not support embeddings. Start it with `--embeddings`"
        for path in ("/embedding", "/embeddings", "/v1/embeddings"):
            error(post(url, path, {"input": "x"}), 501, msg)
        assert post(url, "/v1/embeddings", {"input": "x"}).json()["error"]["type"] == "not_supported_error"
