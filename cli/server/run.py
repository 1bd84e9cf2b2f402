"""Starting and running `ubatch server` once its flags are checked (cli/server.py).

Startup has an order that llama-server users can see: the socket is bound first, so a busy
port fails at once, and answers 503 ("Loading model") while a thread loads the model, builds
the context (-np sequences, -c split across them unless unified) and starts the scheduler;
then every route serves. SIGTERM / Ctrl+C shut down gracefully within a few seconds whatever
`n_predict` is (see `_quiet_server`): a generating request ends with its text so far and
`stop_type` "limit" (`finish_reason` "length"), streamed or not; one not yet generating gets
503; the process exits 0. A second signal exits at once. The startup and per-slot log lines are
llama-server's.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ubatch.cli.common import fail, resolve_model
from ubatch.cli.server.app import ServerOptions, ServerState, create_app
from ubatch.cli.server.bind import bind_all, parse_hosts
from ubatch.cli.server.log import LOG_LEVEL_INFO, log

GRACEFUL_SHUTDOWN_S = 5  # how long a stopping server waits for clients to take their last bytes


def _quiet_server(config: Any, on_shutdown: Callable[[], None]) -> Any:
    """uvicorn's Server, stopping as llama-server does. The first SIGTERM / SIGINT stops
    accepting and calls `on_shutdown` (the engine ends every running generation with a final
    event and answers queued requests 503), then uvicorn waits for the responses to go out, at
    most GRACEFUL_SHUTDOWN_S, and the process exits 0; a second signal exits at once (1)."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            if self.should_exit:
                log("srv    operator(): received a second signal, terminating immediately")
                sys.stderr.flush()
                os._exit(1)
            self.should_exit = True  # not re-raised after shutdown, unlike uvicorn's: exit 0

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            on_shutdown()  # in the event loop, not in the signal handler: it takes the engine's lock
            await super().shutdown(sockets)

    return Server(config)


def serve(
    host: str,
    port: int,
    options: ServerOptions,
    make_scheduler: Callable[[], Any],
    *,
    timeout: int,
    log_disable: bool,
    log_verbosity: int = LOG_LEVEL_INFO,
) -> None:
    """Bind, serve 503 while `make_scheduler` runs in a thread, then serve until stopped; a
    failed load ends the server with its one-line error."""
    import uvicorn

    hosts = parse_hosts(host)
    socks, addrs = bind_all(hosts, port)
    tcp = [x.getsockname()[1] for x in socks if x.family != socket.AF_UNIX]
    bound_port = tcp[0] if tcp else port
    state = ServerState(options)
    app = create_app(state=state, log_verbosity=None if log_disable else log_verbosity)
    result: dict[str, Any] = {}

    def on_shutdown() -> None:
        sch = result.get("scheduler")
        if sch is not None and not sch.shutting_down:
            if not log_disable:
                log("srv    operator(): cleaning up before exit...")
            sch.shutdown()

    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_keep_alive=timeout,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        server_header=False,  # llama-server's "Server: llama.cpp" comes from the app
    )
    srv = _quiet_server(config, on_shutdown)
    if not log_disable:
        log(f"main: HTTP server is listening, hostname: {host}, port: {bound_port}, http threads: 1")
        log("main: loading model")

    def load() -> None:
        try:
            sch = make_scheduler()
            result["scheduler"] = sch
            try:
                state.attach(sch)
            except Exception:
                sch.stop()
                raise
            if not log_disable:
                assert state.chat is not None
                log(f"srv  init: chat template: {state.chat.describe}")
                log("main: model loaded")
                for a in addrs:
                    log(f"srv  llama_server: listening on {a}")
                log("srv  update_slots: all slots are idle")
        except Exception as e:  # a bad model or flag: one line, exit 1
            result["error"] = str(e)
            srv.should_exit = True

    loader = threading.Thread(target=load, name="ubatch-load", daemon=True)
    loader.start()
    try:
        srv.run(sockets=socks)
    except KeyboardInterrupt:
        pass
    finally:
        for h in hosts:
            if h.endswith(".sock"):
                Path(h).unlink(missing_ok=True)
        sch = result.get("scheduler")
        if sch is not None:
            sch.stop()
    if "error" in result:
        fail(result["error"].replace("[", r"\["))


def load_scheduler(
    model: Path | None,
    n_parallel: int,
    ctx_size: int,
    batch_size: int,
    ubatch_size: int,
    kv_unified: bool,
    ctk: str,
    ctv: str,
    swa_full: bool,
    threads: int,
    no_warmup: bool,
    context_shift: bool,
    cache_reuse: int,
    sps: float,
    cont_batching: bool,
    quiet: bool,
    backend: str = "auto",
    embedding: bool = False,
    pooling: str | None = None,
    reranking: bool = False,
    spec: Any = None,
    device: str = "cpu",
) -> Any:
    """The model, its context (one sequence and one output row per slot) and the started
    scheduler, logging llama-server's startup lines unless quiet. `embedding` (--embedding)
    reserves hidden-state rows and, as llama-server, every row of a batch as an output, with
    n_batch cut to n_ubatch; `pooling` is --pooling (None: the model's); `reranking` is
    --reranking (embedding with rank pooling); `spec` the speculative flags (cli/spec_flags.py),
    whose drafts each slot verifies, so n_outputs_max grows to n_parallel x (1 + draft)."""
    from ubatch.engine.context.context import Context
    from ubatch.engine.model.model import Model
    from ubatch.engine.params import ContextParams
    from ubatch.engine.serve.scheduler import Scheduler

    m = Model.load(resolve_model(model), device)
    embedding, pooling = embedding or reranking, "rank" if reranking else pooling
    notes = []
    if embedding and batch_size > (ubatch_size or batch_size):
        notes.append(f"embeddings enabled with n_batch ({batch_size}) > n_ubatch ({ubatch_size})")
        notes.append(f"setting n_batch = n_ubatch = {ubatch_size} to avoid assertion failure")
        batch_size = ubatch_size
    # llama-server: one sequence per slot; one output row per slot and iteration
    params = ContextParams(
        n_ctx=ctx_size,
        n_batch=batch_size,
        n_ubatch=ubatch_size,
        n_seq_max=n_parallel,
        n_threads=threads if threads > 0 else 0,
        n_outputs_max=batch_size if embedding else min(batch_size, _n_outputs(spec, n_parallel)),
        type_k=ctk,
        type_v=ctv,
        kv_unified=kv_unified,
        swa_full=swa_full,
        backend=backend,
    )
    ctx = Context(m, params, embeddings=embedding, pooling=pooling)
    speculator = spec.build(ctx) if spec is not None and not embedding else None
    if not no_warmup:
        ctx.warmup()
    sch = Scheduler(
        ctx,
        n_parallel,
        context_shift=context_shift,
        cache_reuse=cache_reuse,
        slot_prompt_similarity=sps,
        cont_batching=cont_batching,
        speculator=speculator,
    )
    if not quiet:
        from ubatch.cli.present import startup_lines
        from ubatch.cli.spec_view import spec_startup_lines

        for line in startup_lines(ctx) + spec_startup_lines(speculator, ctx):
            log(line)
        for w in notes:
            log(f"srv    load_model: WARN {w}")
        for w in sch.warnings:
            log(f"srv  load_model: WARN {w}")
        if sch.n_ctx_slot < ctx.cparams.n_ctx_seq:
            log(
                f"srv  load_model: WARN the slot context ({ctx.cparams.n_ctx_seq}) exceeds the training "
                f"context of the model ({m.hparams.n_ctx_train}) - capping"
            )
        log(
            f"srv  init: initializing slots, n_slots = {n_parallel}, n_ctx_slot = {sch.n_ctx_slot}, kv_unified = '{str(ctx.cparams.kv_unified).lower()}'"
        )
        sch.listener = _slot_logger(sch)
    sch.start()
    return sch


def _n_outputs(spec: Any, n_parallel: int) -> int:
    """One output row per slot, and with speculation one per drafted token too."""
    return n_parallel if spec is None else spec.params().n_outputs_max(n_parallel, n_parallel)


def _slot_logger(sch: Any) -> Any:
    """llama-server's per-slot INFO lines, printed from the engine thread."""

    def on(kind: str, s: Any) -> None:
        if kind == "launch":
            t = s.task
            log(
                f"slot launch_slot_: id {s.id:2d} | task {t.id} | processing task, n_prompt = {len(t.prompt)}, n_cached = {s.n_prompt_cache}"
            )
            return
        t, rec = s.last_task, sch.releases[-1]
        if rec.reason in ("cancelled", "error"):
            log(f"slot      release: id {s.id:2d} | task {rec.task} | {rec.reason} at iteration {rec.iteration}")
            return
        tm = s.timings().to_json()
        log(
            f"slot print_timing: id {s.id:2d} | task {t.id} | prompt eval time = {tm['prompt_ms']:10.2f} ms / "
            f"{tm['prompt_n']:5d} tokens ({tm['prompt_per_token_ms']:8.2f} ms per token, "
            f"{tm['prompt_per_second']:8.2f} tokens per second) | eval time = {tm['predicted_ms']:10.2f} ms / "
            f"{tm['predicted_n']:5d} tokens ({tm['predicted_per_second']:8.2f} tokens per second) | "
            f"stop = {rec.reason}, truncated = {int(s.truncated)}, n_tokens = {len(s.cache)}"
        )
        if s.spec.n_drafts:  # llama-server's acceptance line at the end of a speculative slot
            from ubatch.cli.spec_view import spec_summary_lines

            log(f"slot print_timing: id {s.id:2d} | task {t.id} | {spec_summary_lines(s.spec)[0]}")

    return on
