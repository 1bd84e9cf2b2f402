"""Starting and running `ubatch server` once its flags are checked (cli/server/command.py).

Startup has an order that llama-server users can see: the socket is bound first, so a busy
port fails at once, and answers 503 ("Loading model") while a thread loads the model, builds
the context (-np sequences, -c split across them unless unified) and starts the engine (the
scheduler, the side runners and the engine loop that drives them, assembled here by
`start_engine`); then every route serves. SIGTERM / Ctrl+C shut down gracefully within a few seconds whatever
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
from types import FrameType

import uvicorn
from starlette.types import ASGIApp

from ubatch.cli.common import fail, resolve_model
from ubatch.cli.present import startup_lines
from ubatch.cli.server.app import ServerEngine, ServerOptions, ServerState, create_app
from ubatch.cli.server.bind import bind_all, parse_hosts
from ubatch.cli.server.defaults import HEADER_TIMEOUT_CAP_S
from ubatch.cli.server.limits import cancel_all
from ubatch.cli.server.log import LOG_LEVEL_INFO, log
from ubatch.cli.server.options import EngineOptions
from ubatch.cli.server.protocol import guarded_h11
from ubatch.cli.server.responses import timings_json
from ubatch.cli.spec_view import spec_startup_lines, spec_summary_lines
from ubatch.engine.context.context import Context
from ubatch.engine.serve.embedding_task import EmbeddingRunner
from ubatch.engine.serve.engine_loop import EngineLoop
from ubatch.engine.serve.scheduler import Scheduler, SlotEvent
from ubatch.engine.serve.slot import Slot
from ubatch.engine.serve.state_task import StateRunner

GRACEFUL_SHUTDOWN_S = 5  # how long a stopping server waits for clients to take their last bytes
# How long a thread running Python keeps the GIL while another waits (CPython's default: 5 ms).
# The engine thread and the event loop give the GIL up at every C call and wait to take it
# back; beside a request worker compiling a hostile grammar they waited 5 ms each time, many
# times a token. 0.5 ms keeps them responsive at a small cost in switches.
SWITCH_INTERVAL_S = 0.0005


def _quiet_server(config: uvicorn.Config, on_shutdown: Callable[[], None]) -> uvicorn.Server:
    """uvicorn's Server, stopping as llama-server does. The first SIGTERM / SIGINT stops
    accepting and calls `on_shutdown` (the engine ends every running generation with a final
    event and answers queued requests 503), then uvicorn waits for the responses to go out, at
    most GRACEFUL_SHUTDOWN_S, and the process exits 0; a second signal exits at once (1)."""

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            if self.should_exit:
                log("srv    operator(): received a second signal, terminating immediately")
                sys.stderr.flush()
                os._exit(1)
            self.should_exit = True  # not re-raised after shutdown, unlike uvicorn's: exit 0

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            on_shutdown()  # in the event loop, not in the signal handler: it takes the engine's lock
            await super().shutdown(sockets)

    return Server(config)


def uvicorn_config(app: ASGIApp, timeout: int) -> uvicorn.Config:
    """How `ubatch server` runs uvicorn: -to is the idle keep-alive timeout and (capped at
    HEADER_TIMEOUT_CAP_S) the time a connection has to send its request headers."""
    return uvicorn.Config(
        app,
        http=guarded_h11(min(timeout, HEADER_TIMEOUT_CAP_S)),
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_keep_alive=timeout,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        server_header=False,  # llama-server's "Server: llama.cpp" comes from the app
    )


def serve(
    host: str,
    port: int,
    options: ServerOptions,
    load: Callable[[], ServerEngine],
    *,
    timeout: int,
    log_disable: bool,
    log_verbosity: int = LOG_LEVEL_INFO,
) -> None:
    """Bind, serve 503 while `load` runs in a thread, then serve until stopped; a failed load
    ends the server with its one-line error."""
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    hosts = parse_hosts(host)
    socks, addrs = bind_all(hosts, port)
    tcp = [x.getsockname()[1] for x in socks if x.family != socket.AF_UNIX]
    bound_port = tcp[0] if tcp else port
    state = ServerState(options)
    app = create_app(state=state, log_verbosity=None if log_disable else log_verbosity)
    engines: list[ServerEngine] = []  # the one engine, once loaded
    errors: list[str] = []

    def on_shutdown() -> None:
        cancel_all()  # a request still being prepared stops at its next check (a grammar's)
        for eng in engines:
            if not eng.loop.shutting_down:
                if not log_disable:
                    log("srv    operator(): cleaning up before exit...")
                eng.loop.shutdown()

    srv = _quiet_server(uvicorn_config(app, timeout), on_shutdown)
    if not log_disable:
        log(f"main: HTTP server is listening, hostname: {host}, port: {bound_port}, http threads: 1")
        log("main: loading model")

    def engine_down(e: Exception) -> None:  # the engine answered what it held with 503: exit 1
        errors.append(str(e))
        srv.should_exit = True

    def load_and_attach() -> None:
        try:
            eng = load()
            engines.append(eng)
            try:
                state.attach(eng)
            except Exception:
                eng.stop()
                raise
            eng.loop.on_down = engine_down
            if not log_disable:
                assert state.chat is not None
                log(f"srv  init: chat template: {state.chat.describe}")
                log("main: model loaded")
                for a in addrs:
                    log(f"srv  llama_server: listening on {a}")
                log("srv  update_slots: all slots are idle")
        except Exception as e:  # a bad model or flag: one line, exit 1
            errors.append(str(e))
            srv.should_exit = True

    loader = threading.Thread(target=load_and_attach, name="ubatch-load", daemon=True)
    loader.start()
    try:
        srv.run(sockets=socks)
    except KeyboardInterrupt:
        pass
    finally:
        for h in hosts:
            if h.endswith(".sock"):
                Path(h).unlink(missing_ok=True)
        for eng in engines:
            eng.stop()
    if errors:
        fail(errors[0].replace("[", r"\["))


def load_engine(o: EngineOptions) -> ServerEngine:
    """The model, its context (one sequence and one output row per slot) and the started engine,
    logging llama-server's startup lines unless quiet. With embeddings n_batch is cut to
    n_ubatch, as llama-server does; each slot verifies the drafts of `o.spec`, so n_outputs_max
    grows to n_parallel x (1 + draft)."""
    m = o.tp.load(resolve_model(o.model), o.device)
    lora = o.lora.load(m)  # before the context, which reserves room for the adapters
    embedding, pooling = o.embedding or o.reranking, "rank" if o.reranking else o.pooling
    notes = []
    cache_ram = o.cache_ram
    if m.shard is not None and cache_ram != 0:  # a saved prompt is whole K/V rows; a rank holds its heads'
        notes.append(f"--cache-ram {cache_ram} has no effect with tensor parallelism (-tp): the host cache is off")
        cache_ram = 0
    c = o.context
    if embedding and c.batch_size > (c.ubatch_size or c.batch_size):
        notes.append(f"embeddings enabled with n_batch ({c.batch_size}) > n_ubatch ({c.ubatch_size})")
        notes.append(f"setting n_batch = n_ubatch = {c.ubatch_size} to avoid assertion failure")
    # llama-server: one sequence per slot; one output row per slot (and drafted token) and iteration
    params = c.params(spec=o.spec.params() if o.spec is not None else None, embedding=embedding)
    ctx = Context(m, params, embeddings=embedding, pooling=pooling)
    ctx.set_adapters(lora)
    speculator = o.spec.build(ctx) if o.spec is not None and not embedding else None
    if o.warmup:
        ctx.warmup()
    sch = Scheduler(
        ctx,
        c.parallel,
        context_shift=o.context_shift,
        cache_reuse=o.cache_reuse,
        cache_ram_mib=cache_ram,
        slot_prompt_similarity=o.slot_prompt_similarity,
        cont_batching=o.cont_batching,
        speculator=speculator,
    )
    if not o.quiet:
        for line in startup_lines(ctx) + o.tp.lines() + spec_startup_lines(speculator, ctx):
            log(line)
        for w in notes:
            log(f"srv    load_model: WARN {w}")
        if embedding:
            log(f"srv    load_model: {pooling_line(ctx.pooling, o.pooling is not None)}")
        for w in sch.warnings:
            log(f"srv  load_model: WARN {w}")
        if sch.n_ctx_slot < ctx.cparams.n_ctx_seq:
            log(
                f"srv  load_model: WARN the slot context ({ctx.cparams.n_ctx_seq}) exceeds the training "
                f"context of the model ({m.hparams.n_ctx_train}) - capping"
            )
        log(
            f"srv  init: initializing slots, n_slots = {c.parallel}, n_ctx_slot = {sch.n_ctx_slot}, kv_unified = '{str(ctx.cparams.kv_unified).lower()}'"
        )
        sch.listener = _slot_logger(sch)
    return start_engine(sch)


def pooling_line(pooling: str, from_flag: bool) -> str:
    """The start-up line that says which pooling the embeddings use, where it came from and what
    it means for /v1/embeddings (which refuses 'none', as llama-server does)."""
    origin = "--pooling" if from_flag else "the model's metadata"
    if pooling == "none":
        return (
            f"embeddings pooling 'none' (from {origin}): one vector per token on /embeddings; "
            "/v1/embeddings needs a pooled vector: start with --pooling mean (or cls, last)"
        )
    return f"embeddings pooling '{pooling}' (from {origin}); --pooling changes it"


def start_engine(scheduler: Scheduler) -> ServerEngine:
    """The engine loop around `scheduler` and the side runners (slot files, then embeddings,
    each on the scheduler's context, slots and stats), started."""
    ctx, slots, stats = scheduler.ctx, scheduler.slots, scheduler.stats
    embeddings = EmbeddingRunner(ctx, slots, stats)
    loop = EngineLoop(scheduler, (StateRunner(ctx, slots, stats), embeddings))
    loop.start()
    return ServerEngine(scheduler, loop, embeddings)


def _slot_logger(sch: Scheduler) -> Callable[[SlotEvent, Slot], None]:
    """llama-server's per-slot INFO lines, printed from the engine thread."""

    def on(kind: SlotEvent, s: Slot) -> None:
        if kind is SlotEvent.LAUNCH:
            t = s.task
            assert t is not None
            log(
                f"slot launch_slot_: id {s.id:2d} | task {t.id} | processing task, n_prompt = {len(t.prompt)}, n_cached = {s.n_prompt_cache}"
            )
            return
        rec = sch.releases[-1]
        if rec.reason in ("cancelled", "error"):
            log(f"slot      release: id {s.id:2d} | task {rec.task} | {rec.reason} at iteration {rec.iteration}")
            return
        tm = timings_json(s.timings())
        log(
            f"slot print_timing: id {s.id:2d} | task {rec.task} | prompt eval time = {tm['prompt_ms']:10.2f} ms / "
            f"{tm['prompt_n']:5d} tokens ({tm['prompt_per_token_ms']:8.2f} ms per token, "
            f"{tm['prompt_per_second']:8.2f} tokens per second) | eval time = {tm['predicted_ms']:10.2f} ms / "
            f"{tm['predicted_n']:5d} tokens ({tm['predicted_per_second']:8.2f} tokens per second) | "
            f"stop = {rec.reason}, truncated = {int(s.truncated)}, n_tokens = {len(s.cache)}"
        )
        if s.spec.n_drafts:  # llama-server's acceptance line at the end of a speculative slot
            log(f"slot print_timing: id {s.id:2d} | task {rec.task} | {spec_summary_lines(s.spec)[0]}")

    return on
