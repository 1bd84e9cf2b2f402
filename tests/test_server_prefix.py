"""Shared prefixes seen from the HTTP side: `/slots` says where a request's cached prompt tokens
came from and `/metrics` counts them by source, as the engine's PrefixReuse records them; and
`-cram` reaches the scheduler as its host-memory budget."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
from test_server import Live

from ubatch.cli.context_flags import ContextFlags
from ubatch.cli.server.app import ServerOptions, create_app
from ubatch.cli.server.run import EngineOptions, load_engine

SYSTEM = " ".join(f"rule {i}: be brief." for i in range(24))  # a long common prefix


def _metric(text: str, name: str, label: str) -> float:
    m = re.search(rf"^ubatch:{name}{re.escape(label)} (\S+)$", text, re.M)
    assert m is not None, f"ubatch:{name}{label} missing from /metrics"
    return float(m.group(1))


@pytest.mark.parametrize("cache_ram", [0, 64])
def test_a_second_slot_takes_the_prefix_from_the_first(tiny_llama: Path, cache_ram: int) -> None:
    ctx = ContextFlags(parallel=2, kv_unified=True, ctx_size=1024)
    eng = load_engine(EngineOptions(model=tiny_llama, context=ctx, cache_ram=cache_ram, warmup=False, quiet=True))
    assert eng.scheduler.host.enabled == (cache_ram != 0)
    live = Live(create_app(eng, ServerOptions(metrics=True, slots=True), log_verbosity=None))
    try:
        body = {"n_predict": 4, "temperature": 0, "cache_prompt": True}
        first = httpx.post(f"{live.url}/completion", json={**body, "prompt": SYSTEM + " Q: one", "id_slot": 0})
        assert first.status_code == 200, first.text
        second = httpx.post(f"{live.url}/completion", json={**body, "prompt": SYSTEM + " Q: two", "id_slot": 1})
        assert second.status_code == 200, second.text
        assert second.json()["tokens_cached"] > 16  # the common prefix came from slot 0's cells
        slot1 = next(s for s in httpx.get(f"{live.url}/slots").json() if s["id"] == 1)
        assert slot1["n_prompt_tokens_cache_shared"] == slot1["n_prompt_tokens_cache"] > 16
        assert slot1["n_prompt_tokens_cache_own"] == 0 and slot1["prompt_cache_source_slot"] == 0
        text = httpx.get(f"{live.url}/metrics").text
        assert _metric(text, "prompt_tokens_reused_total", '{source="shared"}') == slot1["n_prompt_tokens_cache"]
        assert _metric(text, "prompt_cache_hits_total", '{source="shared"}') == 1
        assert _metric(text, "kv_cells_shared", "") > 16
    finally:
        live.close()
        eng.stop()
