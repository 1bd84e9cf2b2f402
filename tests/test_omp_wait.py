"""The OpenMP spin count ubatch sets before torch loads libgomp (ubatch/__init__.py): its own
default, and the user's value (or wait policy) kept as given."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = "import ubatch, os, torch; print(os.environ.get('GOMP_SPINCOUNT'), torch.get_num_threads() > 0)"


def _spin(extra: dict[str, str]) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")} | extra
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()[0]


@pytest.mark.parametrize(
    ("extra", "want"), [({}, "3000"), ({"GOMP_SPINCOUNT": "77"}, "77"), ({"OMP_WAIT_POLICY": "active"}, "None")]
)
def test_spin_count_default_and_user_values(extra: dict[str, str], want: str) -> None:
    assert _spin(extra) == want
