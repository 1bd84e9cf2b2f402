"""Probe a `ubatch server` as an attacker and a careless user would (issue 49's points 2-5) and
print one table: the API key and `--path`, slot files, wrong-typed fields, bodies near the size
cap, and a `-tp 2` run's sockets and a rank killed mid-generation. Each row says what came back;
run it on two checkouts (PYTHONPATH=<checkout>) to compare before and after.

    python scripts/probe_server.py [--model FILE.gguf] [--skip-tp] [--skip-bodies]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from test_server_auth import raw_get  # noqa: E402  (the tests' own helpers: one copy of each)
from test_tensor_parallel import LOOPBACK, listening_sockets  # noqa: E402

KEY = "probe-key"


class Server:
    """A server subprocess; `cpu()` is its CPU seconds so far (user + system)."""

    def __init__(self, model: Path, *flags: str) -> None:
        cmd = [sys.executable, "-m", "ubatch", "server", "-m", str(model), "--port", "0", "-t", "1", "-c", "1024"]
        self.proc = subprocess.Popen([*cmd, *flags], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(iter(self.proc.stderr.readline, "")), daemon=True).start()  # type: ignore[union-attr]
        deadline = time.time() + 120
        while not any("listening on http" in x for x in self.lines):
            if self.proc.poll() is not None or time.time() > deadline:
                raise SystemExit("server did not start:\n" + "".join(self.lines[-20:]))
            time.sleep(0.1)
        line = next(x for x in self.lines if "listening on http" in x)
        self.url = line.split("listening on ")[1].split()[0].rstrip("/")
        while httpx.get(self.url + "/health").status_code != 200:
            time.sleep(0.1)

    def cpu(self) -> float:
        f = Path(f"/proc/{self.proc.pid}/stat").read_text().split()
        return (int(f[13]) + int(f[14])) / os.sysconf("SC_CLK_TCK")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def row(what: str, got: str) -> None:
    print(f"| {what} | {got} |", flush=True)


def access_and_files(model: Path, work: Path) -> None:
    site, slots, outside = work / "site", work / "slots", work / "outside.txt"
    site.mkdir()
    slots.mkdir()
    (site / "index.html").write_text("<title>site</title>")
    (site / "app.js").write_text("console.log(1)")
    (site / ".env").write_text("SECRET=1")
    outside.write_text("TOPSECRET outside the folder")
    (slots / "link.bin").symlink_to(outside)
    srv = Server(model, "--api-key", KEY, "--path", str(site), "--slot-save-path", str(slots), "-np", "2")
    auth = {"Authorization": f"Bearer {KEY}"}
    try:
        for target in ("/webui/%2e%2e/.env", "/webui/../.env", "/.env", "/app.js"):
            status, body = raw_get(srv.url, target)
            row(f"GET {target} without the key (--path)", f"{status}{' (file served)' if b'SECRET' in body else ''}")
        r = httpx.get(srv.url + "/v1/models")
        row("GET /v1/models without the key", f"{r.status_code}{' (model path shown)' if str(model) in r.text else ''}")
        httpx.post(srv.url + "/completion", json={"prompt": "hi", "n_predict": 1, "id_slot": 0}, headers=auth)
        name = "s" * 246 + ".bin"
        r = httpx.post(srv.url + "/slots/0?action=save", json={"filename": name}, headers=auth, timeout=60)
        row("save slot 0 as a 250-byte file name", str(r.status_code))
        r = httpx.post(srv.url + "/slots/0?action=restore", json={"filename": "link.bin"}, headers=auth, timeout=60)
        shown = str(int.from_bytes(b"TOPSECRE", "little")) in r.text
        row(
            "restore a symbolic link in the save folder",
            f"{r.status_code}{' (target bytes in the message)' if shown else ''}",
        )
        hi = [{"role": "user", "content": "hi"}]
        for field, value in (("tools", True), ("response_format", True), ("messages", [])):
            body = {"messages": hi, "max_tokens": 1, field: value}
            r = httpx.post(srv.url + "/v1/chat/completions", json=body, headers=auth, timeout=60)
            row(f"chat with {field}: {json.dumps(value)}", str(r.status_code))
    finally:
        srv.close()
    srv_cmd = [sys.executable, "-m", "ubatch", "server", "-m", str(model), "--port", "0", "--api-key", " "]
    p = subprocess.Popen(srv_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        rc = p.wait(60)
        row('--api-key " "', f"exit {rc}: {p.stderr.read().strip().splitlines()[-1]}")  # type: ignore[union-attr]
    except subprocess.TimeoutExpired:
        row('--api-key " "', "started (no authentication)")
        p.kill()


def bodies(model: Path) -> None:
    n = 63 * 1024 * 1024
    cases = {
        "1.8M chat messages": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}] * (n // 36)}),
        "11M prompt strings": ("/completion", {"prompt": ["ab"] * (n // 6), "n_predict": 1}),
        "22M prompt token ids": ("/completion", {"prompt": [1] * (n // 3), "n_predict": 1}),
        "5.7M logit_bias pairs": (
            "/completion",
            {"prompt": "x", "n_predict": 1, "logit_bias": [[1, -1.0]] * (n // 11)},
        ),
    }
    srv = Server(model, "-np", "2")
    try:
        for name, (route, body) in cases.items():
            data = json.dumps(body).encode()
            c0, t0 = srv.cpu(), time.time()
            try:
                r = httpx.post(srv.url + route, content=data, headers={"Content-Type": "application/json"}, timeout=180)
                got = str(r.status_code)
            except httpx.TimeoutException:
                got = "no answer in 180 s"
            row(
                f"{len(data) / 2**20:.0f} MiB body: {name}",
                f"{got}, {time.time() - t0:.1f} s, {srv.cpu() - c0:.1f} s CPU",
            )
    finally:
        srv.close()


def tensor_parallel(model: Path) -> None:
    srv = Server(model, "-np", "2", "-tp", "2", "--tp-timeout", "10", "--host", "127.0.0.1")
    try:
        rank1 = int(next(x for x in srv.lines if "rank 1 pid" in x).split("pid")[1])
        addrs = listening_sockets([srv.proc.pid, rank1])
        wide = [a for a in addrs if a not in LOOPBACK]
        row("-tp 2 --host 127.0.0.1: listening sockets off loopback", f"{len(wide)} of {len(addrs)} {wide}")
        got: dict[str, object] = {}
        body = {"prompt": "hello", "n_predict": 4000, "ignore_eos": True}
        t = threading.Thread(target=lambda: got.update(r=httpx.post(srv.url + "/completion", json=body, timeout=120)))
        t.start()
        time.sleep(1.5)
        os.kill(rank1, signal.SIGKILL)
        t.join(60)
        r = got.get("r")
        status = r.status_code if isinstance(r, httpx.Response) else r
        time.sleep(3)
        try:
            health = str(httpx.get(srv.url + "/health", timeout=5).status_code)
        except httpx.HTTPError:
            health = "refused"
        exited = srv.proc.poll()
        row("-tp 2: rank 1 killed mid-generation", f"request {status}; 3 s later /health {health}, exit code {exited}")
    finally:
        srv.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--skip-tp", action="store_true")
    ap.add_argument("--skip-bodies", action="store_true")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        model = a.model
        if model is None:
            from tiny_models import TinySpec, write_tiny_model

            model = write_tiny_model(work / "tiny-llama.gguf", TinySpec(arch="llama"))
        print("| probe | answer |\n|---|---|")
        access_and_files(model, work)
        if not a.skip_bodies:
            bodies(model)
        if not a.skip_tp:
            tensor_parallel(model)


if __name__ == "__main__":
    main()
