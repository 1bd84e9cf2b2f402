"""--samplers / --sampling-seq parsing (engine/sampler_names.py) and SamplerParams' defaults,
against llama.cpp's common_sampler_types_from_names / _from_chars and common.h."""

from __future__ import annotations

import pytest

from ubatch.engine.errors import UbatchError
from ubatch.engine.sampling.chain import Sampler, SamplerParams
from ubatch.engine.sampling.names import (
    DEFAULT_SAMPLERS,
    parse_samplers,
    parse_sampling_seq,
    sampler_types_from_chars,
    sampler_types_from_names,
)

# llama.cpp's --samplers / --sampling-seq defaults, as its --help prints them
LLAMA_DEFAULT_NAMES = "penalties;dry;top_n_sigma;top_k;typ_p;top_p;min_p;xtc;temperature"
LLAMA_DEFAULT_CHARS = "edskypmxt"


def test_defaults_are_llama_cpps() -> None:
    p = SamplerParams()
    assert (
        p.samplers == DEFAULT_SAMPLERS == parse_samplers(LLAMA_DEFAULT_NAMES) == parse_sampling_seq(LLAMA_DEFAULT_CHARS)
    )
    assert (p.typ_p, p.top_n_sigma, p.xtc_probability, p.xtc_threshold) == (1.0, -1.0, 0.0, 0.1)
    assert (p.dynatemp_range, p.dynatemp_exponent, p.mirostat, p.mirostat_tau, p.mirostat_eta) == (
        0.0,
        1.0,
        0,
        5.0,
        0.1,
    )
    assert (p.dry_multiplier, p.dry_base, p.dry_allowed_length, p.dry_penalty_last_n) == (0.0, 1.75, 2, 64)
    assert p.dry_sequence_breakers == ("\n", ":", '"', "*")


def test_aliases_and_case() -> None:
    got = parse_samplers("Top-K;nucleus;TEMP;typ;minp;top-n-sigma;topp;typ-p;Penalties;DRY;xtc")
    assert got == (
        "top_k",
        "top_p",
        "temperature",
        "typ_p",
        "min_p",
        "top_n_sigma",
        "top_p",
        "typ_p",
        "penalties",
        "dry",
        "xtc",
    )
    assert parse_samplers("top_k;;temperature;") == ("top_k", "temperature")  # empty parts skipped
    assert parse_samplers("top_k;top_k") == ("top_k", "top_k")  # a stage may repeat
    assert parse_sampling_seq("kt") == ("top_k", "temperature")
    assert parse_sampling_seq("") == ()


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: parse_samplers("top_k;topx"), "unknown sampler 'topx' (valid: dry, top_k, typ_p, top_p"),
        (lambda: parse_sampling_seq("kqt"), "unknown sampler character 'q' in 'kqt' (valid: dkypsmtxe)"),
        (lambda: parse_samplers("infill"), "sampler 'infill' is not supported by ubatch"),
        (lambda: parse_sampling_seq("a"), "sampler 'adaptive_p' is not supported by ubatch"),
        (lambda: Sampler(SamplerParams(samplers=("top_k", "bogus"))), "unknown sampler 'bogus'"),
        (lambda: Sampler(SamplerParams(mirostat=3)), "mirostat must be 0 (off), 1 or 2, not 3"),
    ],
)
def test_bad_names_are_one_line_errors(call, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(UbatchError) as e:
        call()
    assert message in str(e.value) and "\n" not in str(e.value)


def test_the_server_drops_unknown_names_as_llama_server() -> None:
    assert sampler_types_from_names(["foo", "Top-K"], strict=False) == ("top_k",)
    assert sampler_types_from_chars("xyz", strict=False) == ("xtc", "typ_p")
