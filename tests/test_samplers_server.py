"""The sampler request fields against `ubatch server` on a loopback port: each of llama-server's
fields is read, reported back in generation_settings / /slots under llama-server's key, reaches
the sampler, and a bad value is llama-server's 400.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_server import Live, start_server_engine

from ubatch.cli.server.app import ServerOptions, create_app

FIELDS = {
    "typical_p": 0.9,
    "top_n_sigma": 2.0,
    "xtc_probability": 0.25,
    "xtc_threshold": 0.2,
    "dynatemp_range": 0.3,
    "dynatemp_exponent": 1.5,
    "mirostat_tau": 4.0,
    "mirostat_eta": 0.2,
    "dry_multiplier": 0.8,
    "dry_base": 2.0,
    "dry_allowed_length": 3,
    "dry_penalty_last_n": 32,
    "dry_sequence_breakers": ["\n", "xyz"],
    "repeat_penalty": 1.1,
    "repeat_last_n": 16,
}
LLAMA_SAMPLERS = ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"]


@pytest.fixture(scope="module")
def url(tiny_gemma: Path) -> Iterator[str]:
    eng = start_server_engine(tiny_gemma, 1, 256)
    live = Live(create_app(eng, ServerOptions(alias="tiny")))
    yield live.url
    live.close()
    eng.stop()


def complete(url: str, **body: Any) -> httpx.Response:
    body = {"prompt": "hello world", "n_predict": 6, "ignore_eos": True, "seed": 7, **body}
    return httpx.post(url + "/completion", json=body, timeout=60)


def test_every_field_is_answered_and_reported(url: str) -> None:
    r = complete(
        url, **FIELDS, samplers=["penalties", "Dry", "top-n-sigma", "top_k", "typ", "nucleus", "min_p", "xtc", "temp"]
    )
    assert r.status_code == 200, r.text
    gs = r.json()["generation_settings"]
    assert r.json()["tokens_predicted"] == 6
    assert {k: gs[k] for k in FIELDS} == FIELDS
    assert gs["samplers"] == LLAMA_SAMPLERS
    assert (gs["mirostat"], gs["min_keep"]) == (0, 0)
    slot = httpx.get(url + "/slots", timeout=30).json()[0]["params"]  # the slot's last task
    assert {k: slot[k] for k in FIELDS} == FIELDS and slot["samplers"] == gs["samplers"]
    again = complete(url, **FIELDS)
    assert again.json()["content"] == r.json()["content"]  # the same seed, the same draws


def test_defaults_are_llama_servers(url: str) -> None:
    gs = complete(url).json()["generation_settings"]
    assert gs["samplers"] == LLAMA_SAMPLERS
    assert (gs["typical_p"], gs["top_n_sigma"], gs["mirostat"], gs["dry_penalty_last_n"]) == (1.0, -1.0, 0, 64)
    assert gs["dry_sequence_breakers"] == ["\n", ":", '"', "*"]


def test_the_fields_reach_the_sampler(url: str) -> None:
    greedy = complete(url, temperature=0).json()
    # XTC at probability 1 with threshold 0 removes every token but the least likely of the 40
    xtc = complete(url, temperature=0, top_p=1.0, min_p=0.0, xtc_probability=1.0, xtc_threshold=0.0).json()
    assert xtc["content"] != greedy["content"]
    only = {"temperature": 0, "xtc_probability": 1.0, "xtc_threshold": 0.0}
    assert complete(url, samplers="t", **only).json()["content"] == greedy["content"]  # no XTC stage
    assert complete(url, samplers="x", **only).json()["content"] != greedy["content"]  # XTC, no temperature
    m1 = complete(url, mirostat=2, seed=3).json()
    assert m1["generation_settings"]["mirostat"] == 2 and m1["tokens_predicted"] == 6
    assert complete(url, mirostat=2, seed=3).json()["content"] == m1["content"]


@pytest.mark.parametrize(
    "body, shown",
    [
        ({"samplers": "kt"}, {"samplers": ["top_k", "temperature"]}),
        ({"samplers": ["foo", "top_k"]}, {"samplers": ["top_k"]}),  # unknown names dropped
        (
            {"samplers": 5},
            {"samplers": ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"]},
        ),
        ({"mirostat": 5}, {"mirostat": 2}),  # clamped, as llama-server
        ({"xtc_probability": 2, "xtc_threshold": -1}, {"xtc_probability": 1.0, "xtc_threshold": 0.0}),
        ({"dry_base": 0.5}, {"dry_base": 1.75}),  # below 1: the server's default
        ({"dry_sequence_breakers": [""]}, {"dry_sequence_breakers": [""]}),
    ],
)
def test_soft_limits(url: str, body: dict, shown: dict) -> None:
    r = complete(url, **body)
    assert r.status_code == 200, r.text
    gs = r.json()["generation_settings"]
    assert {k: gs[k] for k in shown} == shown


BREAKERS = "Field 'dry_sequence_breakers': Error: dry_sequence_breakers must be a non-empty array of strings"


@pytest.mark.parametrize(
    "body, message",
    [
        ({"repeat_last_n": -1}, "Field 'repeat_last_n': Value must be between 0 <= value <= 2147483647, but got -1"),
        (
            {"dry_penalty_last_n": -1},
            "Field 'dry_penalty_last_n': Value must be between 0 <= value <= 2147483647, but got -1",
        ),
        (
            {"dry_allowed_length": -1},
            "Field 'dry_allowed_length': Value must be between 0 <= value <= 2147483647, but got -1",
        ),
        ({"min_keep": -1}, "Field 'min_keep': Value must be between 0 <= value <= 2147483647, but got -1"),
        ({"dry_sequence_breakers": []}, BREAKERS),
        ({"dry_sequence_breakers": "abc"}, BREAKERS),
        ({"dry_sequence_breakers": [1]}, BREAKERS),
        ({"samplers": [1]}, "Field 'samplers': [json.exception.type_error.302] type must be string, but is number"),
        ({"samplers": ["top_k", "infill"]}, "Field 'samplers': the 'infill' sampler is not supported by this server"),
        ({"typical_p": "a"}, "Field 'typical_p'"),
        ({"mirostat": "1"}, "Field 'mirostat'"),
        ({"top_n_sigma": [1]}, "Field 'top_n_sigma'"),
    ],
)
def test_bad_values_are_llama_servers_400(url: str, body: dict, message: str) -> None:
    r = complete(url, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == 400 and err["type"] == "invalid_request_error" and message in err["message"]
