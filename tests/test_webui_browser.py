"""The web pages in a real headless Chromium (Debian's `chromium`, driven by Playwright): chat,
stream, stop, settings sent, regenerate and edit, the API key, and `/engine` while two clients
generate. Skipped, with the reason, when Playwright or the browser is missing.

UBATCH_SCREENSHOTS=1 saves docs/webui-chat.png and docs/webui-engine.png.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import test_webui
from test_server import Live
from test_webui import webui_app, webui_options

from ubatch.cli.server.app import ServerEngine
from ubatch.cli.server.run import start_engine
from ubatch.engine.context.context import Context
from ubatch.engine.model.model import Model
from ubatch.engine.params import ContextParams
from ubatch.engine.serve.scheduler import Scheduler

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
CHROMIUM = next((p for p in ("/usr/bin/chromium", shutil.which("chromium") or "") if p and os.path.exists(p)), None)
if CHROMIUM is None:
    pytest.skip("no chromium binary (apt-get install -y chromium)", allow_module_level=True)

DOCS = Path(__file__).resolve().parent.parent / "docs"
SCREENSHOTS = os.environ.get("UBATCH_SCREENSHOTS") == "1"
Page = Any  # playwright.sync_api.Page


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


@pytest.fixture(scope="module")
def engine(tiny_gemma: Path) -> Iterator[ServerEngine]:
    """-np 2 -c 2048 -kvu: llama-server's default layout, where sequences share prefix cells."""
    ctx = Context(Model.load(tiny_gemma), ContextParams(n_ctx=2048, n_seq_max=2, n_outputs_max=2, kv_unified=True))
    eng = start_engine(Scheduler(ctx, 2))
    yield eng
    eng.stop()


served = test_webui.served  # the same fixture, run on this module's engine


@pytest.fixture
def page(browser: Any) -> Iterator[Page]:
    ctx = browser.new_context(viewport={"width": 1280, "height": 800})
    pg = ctx.new_page()
    external: list[str] = []
    pg.on("request", lambda r: external.append(r.url) if not r.url.startswith("http://127.0.0.1") else None)
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    yield pg
    ctx.close()
    assert not external, f"the page requested {external}"
    assert not errors, f"script errors: {errors}"


def ignore_eos(page: Page, url: str, n_predict: int = 24, key: str = "") -> None:
    """The tiny model's random weights end an answer at once or write newlines and control
    characters: keep it generating, among a few plain words (the body is otherwise the page's)."""
    auth = {"Authorization": f"Bearer {key}"} if key else {}
    words = httpx.post(
        url + "/tokenize", json={"content": "the quick brown fox", "with_pieces": True}, headers=auth
    ).json()
    bias = [[t["id"], 40.0] for t in words["tokens"] if isinstance(t["piece"], str) and t["piece"].strip()]

    def extend(route: Any) -> None:
        body = json.loads(route.request.post_data or "{}")
        extra = {"ignore_eos": True, "max_tokens": n_predict, "logit_bias": bias}
        route.continue_(post_data=json.dumps({**extra, **body}))

    page.route("**/v1/chat/completions", extend)


def send(page: Page, text: str) -> None:
    page.fill("#input", text)
    page.press("#input", "Enter")


def wait_answer(page: Page, n: int) -> Any:
    """The n-th assistant message once its speed line (from the final `timings`) is shown."""
    page.wait_for_selector(f"article.msg.assistant:nth-of-type({2 * n}) .speed", timeout=30_000)
    return page.locator("article.msg.assistant").nth(n - 1)


def test_chat_streams_an_answer(served: str, page: Page) -> None:
    ignore_eos(page, served)
    page.goto(served + "/")
    # the tiny model has no chat template: the page says so
    page.wait_for_selector(".notice.warn")
    assert "no chat template" in page.inner_text("#notices")
    chunks: list[int] = []
    page.on("response", lambda r: chunks.append(r.status) if "chat/completions" in r.url else None)
    send(page, "Hello **there**")
    msg = wait_answer(page, 1)
    assert msg.locator(".content").inner_text().strip()
    speed = msg.locator(".speed").inner_text()
    assert "Prompt:" in speed and "Generation:" in speed and "t/s" in speed
    assert chunks == [200]
    assert page.locator("article.msg.user .content").inner_text() == "Hello **there**"  # user text is not rendered
    # kept in localStorage: a reload shows the conversation
    page.reload()
    page.wait_for_selector("article.msg.assistant")
    assert page.locator("#conversations li").count() == 1
    if SCREENSHOTS:
        send(page, "Write `code` and a list:\n- one\n- two")
        wait_answer(page, 2)
        page.screenshot(path=str(DOCS / "webui-chat.png"))


def test_stop_midway(served: str, page: Page, engine: ServerEngine) -> None:
    page.goto(served + "/")
    page.evaluate("localStorage.setItem('ubatch.settings', JSON.stringify({max_tokens: 900}))")
    page.reload()
    ignore_eos(page, served)
    cancelled = engine.scheduler.stats.n_cancelled
    send(page, "a long answer please")
    page.wait_for_function("() => document.querySelector('article.msg.assistant .content')?.textContent.length > 0")
    page.click("#stop")
    page.wait_for_selector("article.msg.assistant .stopped")
    assert page.is_visible("#send") and not page.is_visible("#stop")
    for _ in range(100):
        if engine.scheduler.stats.n_cancelled > cancelled:
            break
        page.wait_for_timeout(50)
    assert engine.scheduler.stats.n_cancelled > cancelled  # the server's slot was freed


def test_settings_are_sent(served: str, page: Page) -> None:
    ignore_eos(page, served)
    page.goto(served + "/")
    bodies: list[dict[str, Any]] = []
    page.on(
        "request", lambda r: bodies.append(json.loads(r.post_data or "{}")) if "chat/completions" in r.url else None
    )
    page.click("#open-settings")
    page.fill("#s-system", "Be brief.")
    page.fill("#s-temperature", "0.3")
    page.fill("#s-top_k", "7")
    page.fill("#s-top_p", "0.9")
    page.fill("#s-min_p", "0.05")
    page.fill("#s-max_tokens", "5")
    page.click("#settings-save")
    send(page, "hi")
    msg = wait_answer(page, 1)
    b = bodies[-1]
    assert b["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    sent = {k: b[k] for k in ("temperature", "top_k", "top_p", "min_p", "max_tokens", "stream")}
    assert sent == {"temperature": 0.3, "top_k": 7, "top_p": 0.9, "min_p": 0.05, "max_tokens": 5, "stream": True}
    assert "Generation: 5 tokens" in msg.locator(".speed").inner_text()
    # regenerate: the same request again, one answer replaced
    page.click("article.msg.assistant .regenerate")
    page.wait_for_function(
        "() => document.querySelector('article.msg.assistant .speed') !== null && !document.querySelector('#stop:not([hidden])')"
    )
    assert len(bodies) == 2 and bodies[1]["messages"] == b["messages"]
    assert page.locator("article.msg").count() == 2
    # edit the question: the answer after it is asked again
    page.click("article.msg.user .edit")
    page.fill("article.msg.user textarea", "hello again")
    page.press("article.msg.user textarea", "Enter")
    page.wait_for_function(
        "() => document.querySelectorAll('article.msg').length === 2 && document.querySelector('article.msg.assistant .speed') !== null"
    )
    assert bodies[-1]["messages"][-1] == {"role": "user", "content": "hello again"}
    assert page.locator("article.msg.user .content").inner_text() == "hello again"


def test_engine_page_shows_two_sequences(served: str, browser: Any) -> None:
    ctx = browser.new_context(viewport={"width": 1280, "height": 1000})
    page = ctx.new_page()
    try:
        page.goto(served + "/engine")
        page.wait_for_selector("#membar .seg")  # the hello event: the memory plan
        assert "weights" in page.inner_text("#memlegend") and "compute buffer" in page.inner_text("#memlegend")
        page.wait_for_function("() => document.getElementById('conn').textContent === 'live'")
        prompt = "tell me a story about two sequences, " * 4  # long enough to be worth sharing
        body = {"prompt": prompt, "n_predict": 900, "temperature": 0, "ignore_eos": True}
        # slot 1 starts once slot 0's prompt is in the cells, so it takes them instead of
        # prefilling its own copy in the same iteration (which a busy machine can make happen)
        threads = [
            threading.Thread(
                target=httpx.post,
                args=(served + "/completion",),
                kwargs={"json": {**body, "id_slot": i}, "timeout": 60},
            )
            for i in (0, 1)
        ]
        threads[0].start()
        page.wait_for_function(
            "() => [...document.querySelectorAll('#slots *')].some(e => e.textContent.includes('generating'))",
            timeout=30_000,
        )
        threads[1].start()
        # both sequences' rows in one decode, and both in the cells' legend
        page.wait_for_selector('li.decode[data-seqs="0,1"]', timeout=30_000)
        page.wait_for_function("() => document.getElementById('kv-legend').textContent.includes('seq 1')")
        legend = page.inner_text("#kv-legend")
        assert "seq 0" in legend and "seq 1" in legend
        page.wait_for_function("() => document.querySelector('#kv figcaption').textContent.includes('shared')")
        caption = page.inner_text("#kv figcaption")
        assert "padding to 256" in caption and "shared" in caption  # one unified stream: the prompt's cells shared
        assert "generating" in page.inner_text("#slots") or "processing" in page.inner_text("#slots")
        labels = page.inner_text("#decodes")
        assert "generated" in labels and "graph" in labels and "ms" in labels
        if SCREENSHOTS:
            page.wait_for_timeout(1500)  # a few samples in the charts
            page.screenshot(path=str(DOCS / "webui-engine.png"), full_page=True)
        for t in threads:
            t.join()
    finally:
        ctx.close()


def test_phone_width_has_no_sideways_scroll(served: str, browser: Any) -> None:
    ctx = browser.new_context(viewport={"width": 390, "height": 844}, is_mobile=True)
    page = ctx.new_page()
    try:
        for path in ("/", "/engine"):
            page.goto(served + path)
            page.wait_for_timeout(500)
            assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1"), path
    finally:
        ctx.close()


def test_api_key(engine: ServerEngine, browser: Any) -> None:
    app = webui_app(engine, webui_options(api_keys=("sekret",)))
    live = Live(app)
    ctx = browser.new_context()
    page = ctx.new_page()
    try:
        page.goto(live.url + "/")
        page.wait_for_selector("#keydlg[open]")  # /props answered 401: the page asks for the key
        assert "401" in page.inner_text("#notices")
        page.fill("#key-input", "wrong")
        page.click("#key-save")
        page.wait_for_function("() => document.getElementById('notices').textContent.includes('refused the API key')")
        page.fill("#key-input", "sekret")
        page.click("#key-save")
        page.wait_for_function("() => !document.getElementById('notices').textContent.includes('401')")
        ignore_eos(page, live.url, key="sekret")
        auth: list[str] = []
        page.on(
            "request",
            lambda r: auth.append(r.headers.get("authorization", "")) if "chat/completions" in r.url else None,
        )
        send(page, "hello")
        wait_answer(page, 1)
        assert auth == ["Bearer sekret"]
        # a key that stops working: the answer says so
        page.evaluate("localStorage.setItem('ubatch.apiKey', 'revoked')")
        send(page, "again")
        page.wait_for_selector("article.msg.assistant .error")
        assert "401" in page.locator("article.msg.assistant .error").last.inner_text()
        # the engine page: refused without the key, live with it
        page.goto(live.url + "/engine")
        page.wait_for_selector("#keydlg[open]")
        page.fill("#key-input", "sekret")
        page.click("#key-save")
        page.wait_for_function("() => document.getElementById('conn').textContent === 'live'")
    finally:
        ctx.close()
        live.close()
