"""The names of the sampler chain's stages, as llama.cpp's --samplers, --sampling-seq and the
server's `samplers` field spell them.

llama.cpp's common_sampler_type names are the canonical ones (`generation_settings.samplers`
reports them); each name with an underscore also answers to its kebab-case and its no-dash
spelling, plus three old aliases. llama.cpp warns about an unknown name and drops it; ubatch's
command line refuses it instead (`strict`), the server drops it as llama-server does.
"""

from __future__ import annotations

from ubatch.engine.errors import UbatchError

# canonical name -> its --sampling-seq character (common_sampler_type_to_chr)
SAMPLER_CHARS: dict[str, str] = {
    "dry": "d",
    "top_k": "k",
    "typ_p": "y",
    "top_p": "p",
    "top_n_sigma": "s",
    "min_p": "m",
    "temperature": "t",
    "xtc": "x",
    "infill": "i",
    "penalties": "e",
    "adaptive_p": "a",
}
# common_params_sampling's default chain, in order
DEFAULT_SAMPLERS: tuple[str, ...] = tuple("penalties dry top_n_sigma top_k typ_p top_p min_p xtc temperature".split())
# llama.cpp knows these; ubatch's chain does not implement them (yet)
UNSUPPORTED_SAMPLERS = frozenset({"infill", "adaptive_p"})


def _aliases() -> dict[str, str]:
    out = {name: name for name in SAMPLER_CHARS}
    for name in SAMPLER_CHARS:
        if "_" in name:
            out[name.replace("_", "-")] = name
            out[name.replace("_", "")] = name
    out.update(nucleus="top_p", temp="temperature", typ="typ_p")
    return out


SAMPLER_ALIASES = _aliases()
_BY_CHAR = {c: name for name, c in SAMPLER_CHARS.items()}


def _check(found: list[str], strict: bool) -> tuple[str, ...]:
    if strict:
        for name in found:
            if name in UNSUPPORTED_SAMPLERS:
                raise UbatchError(f"sampler '{name}' is not supported by ubatch; use {', '.join(DEFAULT_SAMPLERS)}")
    return tuple(found)


def sampler_types_from_names(names: list[str], strict: bool = True) -> tuple[str, ...]:
    """common_sampler_types_from_names: case-insensitive, aliases allowed."""
    found = []
    for name in names:
        canon = SAMPLER_ALIASES.get(name.lower())
        if canon is None:
            if strict:
                valid = ", ".join(n for n in SAMPLER_CHARS if n not in UNSUPPORTED_SAMPLERS)
                raise UbatchError(
                    f"unknown sampler '{name}' (valid: {valid}; also kebab-case, no-dash, nucleus, temp, typ)"
                )
            continue
        found.append(canon)
    return _check(found, strict)


def sampler_types_from_chars(chars: str, strict: bool = True) -> tuple[str, ...]:
    """common_sampler_types_from_chars: one character per stage."""
    found = []
    for ch in chars:
        name = _BY_CHAR.get(ch)
        if name is None:
            if strict:
                valid = "".join(c for n, c in SAMPLER_CHARS.items() if n not in UNSUPPORTED_SAMPLERS)
                raise UbatchError(f"unknown sampler character '{ch}' in '{chars}' (valid: {valid})")
            continue
        found.append(name)
    return _check(found, strict)


def parse_samplers(text: str) -> tuple[str, ...]:
    """--samplers "penalties;top_k;...": ';'-separated names (empty parts are skipped)."""
    return sampler_types_from_names([part for part in text.split(";") if part])


def parse_sampling_seq(chars: str) -> tuple[str, ...]:
    """--sampling-seq edskypmxt: one character per stage."""
    return sampler_types_from_chars(chars)
