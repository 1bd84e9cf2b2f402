"""llama.cpp's sampling flags, declared once for every command that samples (`ubatch cli`,
`ubatch server`): `@sampling_options` adds them to a command's signature and hands the function
one `SamplingFlags`, which checks them and builds the engine's `SamplerParams` and grammar.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from ubatch.cli import validate
from ubatch.cli.common import read_text_file
from ubatch.cli.flag_group import flag, flag_group
from ubatch.cli.options import SAMPLING
from ubatch.engine.errors import UbatchError

_flag = functools.partial(flag, panel=SAMPLING)


@dataclass
class SamplingFlags:
    """The sampling flags as typed (llama.cpp's names and defaults)."""

    seed: int = _flag(-1, "-s", "--seed", help="RNG seed (-1 = random)")
    temp: float = _flag(0.8, "--temp", "--temperature", help="temperature (<= 0: greedy)")
    top_k: int = _flag(40, "--top-k", help="top-k sampling (0 = disabled)")
    top_p: float = _flag(0.95, "--top-p", help="top-p sampling (1.0 = disabled)")
    min_p: float = _flag(0.05, "--min-p", help="min-p sampling (0.0 = disabled)")
    top_n_sigma: float = _flag(-1.0, "--top-n-sigma", "--top-nsigma", help="top-n-sigma (-1 = off)")
    xtc_probability: float = _flag(0.0, "--xtc-probability", help="XTC probability (0 = off)")
    xtc_threshold: float = _flag(0.1, "--xtc-threshold", help="XTC threshold (> 0.5 = off)")
    typical: float = _flag(1.0, "--typical", "--typical-p", help="locally typical sampling p (1 = off)")
    repeat_last_n: int = _flag(64, "--repeat-last-n", help="tokens the penalties look at (-1 = ctx)")
    repeat_penalty: float = _flag(1.0, "--repeat-penalty", help="repetition penalty (1 = off)")
    presence_penalty: float = _flag(0.0, "--presence-penalty", help="presence penalty (0 = off)")
    frequency_penalty: float = _flag(0.0, "--frequency-penalty", help="frequency penalty")
    dry_multiplier: float = _flag(0.0, "--dry-multiplier", help="DRY multiplier (0 = off)")
    dry_base: float = _flag(1.75, "--dry-base", help="DRY base")
    dry_allowed_length: int = _flag(2, "--dry-allowed-length", help="DRY allowed length")
    dry_penalty_last_n: int = _flag(64, "--dry-penalty-last-n", help="DRY window (-1 = ctx)")
    dry_sequence_breaker: Optional[list[str]] = _flag(
        None, "--dry-sequence-breaker", help="DRY sequence breaker (repeatable; 'none' clears the defaults)"
    )
    dynatemp_range: float = _flag(0.0, "--dynatemp-range", help="dynamic temperature range")
    dynatemp_exp: float = _flag(1.0, "--dynatemp-exp", help="dynamic temperature exponent")
    mirostat: int = _flag(0, "--mirostat", help="Mirostat: 0 off, 1 v1, 2 v2")
    mirostat_lr: float = _flag(0.1, "--mirostat-lr", help="Mirostat learning rate (eta)")
    mirostat_ent: float = _flag(5.0, "--mirostat-ent", help="Mirostat target entropy (tau)")
    samplers: Optional[str] = _flag(None, "--samplers", help="sampler order, ';'-separated names")
    sampling_seq: Optional[str] = _flag(
        None, "--sampling-seq", "--sampler-seq", help="sampler order as letters (edskypmxt)"
    )
    ignore_eos: bool = _flag(False, "--ignore-eos", help="keep generating past end-of-generation tokens")
    logit_bias: Optional[list[str]] = _flag(None, "-l", "--logit-bias", help="TOKEN_ID(+/-)BIAS (repeatable)")
    grammar: Optional[str] = _flag(None, "--grammar", help="GBNF grammar the output must follow")
    grammar_file: Optional[Path] = _flag(None, "--grammar-file", help="file with a GBNF grammar")
    json_schema: Optional[str] = _flag(None, "-j", "--json-schema", help="JSON schema the output must follow")
    json_schema_file: Optional[Path] = _flag(None, "-jf", "--json-schema-file", help="file with a JSON schema")

    def check(self) -> None:
        """Every value checked before anything loads (one line naming the flag)."""
        validate.sampling_flags(
            self.temp, self.top_k, self.top_p, self.min_p, self.seed, self.repeat_penalty, self.repeat_last_n
        )
        validate.finite("--top-n-sigma", self.top_n_sigma, "top_n_sigma")
        validate.fraction("--xtc-probability", self.xtc_probability, "xtc_probability")
        validate.fraction("--xtc-threshold", self.xtc_threshold, "xtc_threshold")
        validate.finite("--typical", self.typical, "typ_p")
        validate.finite("--presence-penalty", self.presence_penalty, "presence_penalty")
        validate.finite("--frequency-penalty", self.frequency_penalty, "frequency_penalty")
        validate.finite("--dry-multiplier", self.dry_multiplier, "dry_multiplier", 0.0)
        validate.finite("--dry-base", self.dry_base, "dry_base", 0.0)
        validate.at_least("--dry-allowed-length", self.dry_allowed_length, "dry_allowed_length", 0)
        validate.at_least("--dry-penalty-last-n", self.dry_penalty_last_n, "dry_penalty_last_n", -1)
        validate.finite("--dynatemp-range", self.dynatemp_range, "dynatemp_range", 0.0)
        validate.finite("--dynatemp-exp", self.dynatemp_exp, "dynatemp_exponent")
        validate.in_range("--mirostat", self.mirostat, "mirostat", 0, 2)
        validate.finite("--mirostat-lr", self.mirostat_lr, "mirostat_eta", 0.0)
        validate.finite("--mirostat-ent", self.mirostat_ent, "mirostat_tau", 0.0)
        given = [f for f, v in (("--grammar", self.grammar), ("--grammar-file", self.grammar_file)) if v is not None]
        given += [f for f, v in (("-j", self.json_schema), ("-jf", self.json_schema_file)) if v is not None]
        if len(given) > 1:
            raise UbatchError(f"{' and '.join(given)} both give the grammar; use one of them")
        self.logit_biases(None)  # the format now; the token range once the vocabulary is known

    def sampler_params(self) -> Any:
        """The engine's SamplerParams (llama.cpp's common_params_sampling)."""
        from ubatch.engine.sampling.chain import LLAMA_DEFAULT_SEED, SamplerParams
        from ubatch.engine.sampling.names import parse_samplers, parse_sampling_seq

        extra: dict[str, Any] = {}
        if self.sampling_seq is not None:
            extra["samplers"] = parse_sampling_seq(self.sampling_seq)
        if self.samplers is not None:
            extra["samplers"] = parse_samplers(self.samplers)
        if self.dry_sequence_breaker is not None:  # "none" clears llama.cpp's defaults
            extra["dry_sequence_breakers"] = tuple(b for b in self.dry_sequence_breaker if b != "none")
        return SamplerParams(
            temp=self.temp,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            seed=LLAMA_DEFAULT_SEED if self.seed < 0 else self.seed,
            repeat_penalty=self.repeat_penalty,
            repeat_last_n=self.repeat_last_n,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            typ_p=self.typical,
            top_n_sigma=self.top_n_sigma,
            xtc_probability=self.xtc_probability,
            xtc_threshold=self.xtc_threshold,
            dynatemp_range=self.dynatemp_range,
            dynatemp_exponent=self.dynatemp_exp,
            mirostat=self.mirostat,
            mirostat_tau=self.mirostat_ent,
            mirostat_eta=self.mirostat_lr,
            dry_multiplier=self.dry_multiplier,
            dry_base=self.dry_base,
            dry_allowed_length=self.dry_allowed_length,
            dry_penalty_last_n=self.dry_penalty_last_n,
            **extra,
        )

    def grammar_text(self) -> str:
        """The GBNF the flags ask for ('' for none): --grammar(-file), or -j / -jf converted."""
        if self.grammar is not None:
            return self.grammar
        if self.grammar_file is not None:
            return read_text_file(self.grammar_file, "grammar file")
        schema = self.json_schema
        if self.json_schema_file is not None:
            schema = read_text_file(self.json_schema_file, "JSON schema file")
        if schema is None:
            return ""
        import json

        from ubatch.engine.grammar.json_schema.convert import schema_to_gbnf

        try:
            parsed = json.loads(schema)
        except json.JSONDecodeError as e:
            raise UbatchError(f"-j: the JSON schema is not valid JSON ({e.msg} at offset {e.pos})") from None
        return schema_to_gbnf(parsed)

    def compiled_grammar(self) -> Any:
        """The grammar object for GenerationParams.grammar (None without one), compiled once:
        the command calls this before loading (a bad grammar fails first), the run reuses it."""
        if "_grammar" not in self.__dict__:
            text = self.grammar_text()
            if text:
                from ubatch.engine.grammar import compile_grammar

                # probed: an ambiguous grammar fails here, not in the middle of an answer
                self.__dict__["_grammar"] = compile_grammar(text, probe=True)
            else:
                self.__dict__["_grammar"] = None
        return self.__dict__["_grammar"]

    def logit_biases(self, n_vocab: int | None) -> list[tuple[int, float]]:
        """-l TOKEN_ID(+/-)BIAS, e.g. `-l 15043+1` or `-l 15043-inf` (llama.cpp's format)."""
        out = []
        for item in self.logit_bias or []:
            head = item.lstrip("+-")
            cut = next((i for i, c in enumerate(head) if c in "+-"), -1)
            try:
                if cut < 0:
                    raise ValueError
                tok, bias = int(item[: len(item) - len(head) + cut]), float(head[cut:])
            except ValueError:
                raise UbatchError(f"-l {item}: expected TOKEN_ID(+/-)BIAS, e.g. 15043+1 or 15043-inf") from None
            if math.isnan(bias):
                raise UbatchError(f"-l {item}: the bias is not a number")
            if n_vocab is not None and not 0 <= tok < n_vocab:
                raise UbatchError(f"-l {item}: token id out of range (the vocabulary has {n_vocab} tokens)")
            out.append((tok, bias))
        return out


# Add the sampling flags to a command; it receives them as `sampling: SamplingFlags`.
sampling_options = flag_group(SamplingFlags, "sampling")
