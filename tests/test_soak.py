"""scripts/soak.py on the tiny model: a short soak with every request kind and an injected decode
failure loses nothing, matches every solo greedy run, leaves the slots clean, and exits 0."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import soak  # noqa: E402


def figure(out: str, pattern: str) -> int:
    m = re.search(pattern, out, re.M)
    assert m, f"no {pattern!r} in the report:\n{out}"
    return int(m.group(1))


def test_soak_loses_nothing_and_matches_solo(tiny_gemma: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # 3 clients x 4 requests: each of the ten kinds at least once; every 7th decode fails
    argv = ["-m", str(tiny_gemma), "--clients", "3", "--rounds", "1", "--per-client", "4", "--prompts", "2"]
    argv += ["-np", "2", "-n", "4", "--fail-every", "7", "--time-limit", "60"]
    rc = soak.main(argv)
    out = capsys.readouterr().out
    assert figure(out, r"^  lost +(\d+)$") == 0
    assert figure(out, r"^greedy +\d+ solo references, (\d+) mismatches$") == 0
    assert figure(out, r"^greedy +(\d+) solo references") > 0
    assert figure(out, r"^  unexpected +(\d+)$") == 0
    assert figure(out, r"^  served +(\d+)$") > 0
    assert figure(out, r"^  failed by inj\. +\d+ \((\d+) decodes raised\)$") > 0  # the fault fired
    assert figure(out, r"^  failed by inj\. +(\d+)") > 0  # and its requests got an error
    kinds = re.search(r"^by kind +(.*)$", out, re.M)
    assert kinds and {k.split()[0] for k in kinds.group(1).split(", ")} == {k.name for k in soak.KINDS}
    assert "slots after      all idle, KV cells accounted for" in out
    assert out.rstrip().endswith("PASS") and rc == 0


def test_a_mismatch_or_a_lost_request_fails_the_run() -> None:
    rep = soak.Report()
    assert rep.ok
    rep.mismatches.append("round 1 native #0: 'a' != solo 'b'")
    assert not rep.ok
    rep = soak.Report()
    rep.outcomes["lost"] += 1
    assert not rep.ok and soak.format_report(rep)[-1].endswith("FAIL")
