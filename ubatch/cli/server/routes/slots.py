"""POST /slots/{id_slot}?action=save|restore|erase: llama-server's slot state files.

With `--slot-save-path DIR` a slot's cells and tokens are written to (or read from) DIR/filename
by the engine thread between two iterations (engine/serve/state_task.py); the answers, and the errors
in their order (no --slot-save-path, a slot id that is not a number, a bad filename, an unknown
action), are llama-server's. A filename is checked as llama-server's fs_validate_filename does,
so no request can name a file outside DIR.
"""

from __future__ import annotations

import os

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from ubatch.cli.server.http import api, bad_request, not_started_with, read_json
from ubatch.cli.server.state import ServerState
from ubatch.cli.server.stream import results
from ubatch.engine.serve.state_task import SlotResult, SlotTask

_FORBIDDEN = set(':*?"<>|/\\') | {"\uff0e", "\u2215", "\u2216", "\ufffd", "\ufeff"}


def valid_filename(name: str) -> bool:
    """llama-server's rules: 1-255 bytes of UTF-8, no control characters, path separators or
    characters Windows forbids (nor their look-alikes), no leading/trailing space, no trailing
    dot, no "..", not "."."""
    try:
        n_bytes = len(name.encode("utf-8"))
    except UnicodeEncodeError:  # a lone surrogate
        return False
    if not 0 < n_bytes <= 255 or name == ".":
        return False
    for c in name:
        o = ord(c)
        if o <= 0x1F or o == 0x7F or 0x80 <= o <= 0x9F or 0xD800 <= o <= 0xDFFF or c in _FORBIDDEN:
            return False
    return not (name[0] == " " or name[-1] in " ." or ".." in name)


def add_slot_routes(app: FastAPI, st: ServerState) -> None:
    @app.post("/slots/{id_slot}")
    @api
    async def slot_action(request: Request) -> Response:
        o = st.options
        if not o.slot_save_path:
            raise not_started_with("slots action", "--slot-save-path")
        try:
            slot = int(request.path_params["id_slot"])
        except ValueError:
            raise bad_request("Invalid slot ID") from None
        action = request.query_params.get("action", "")
        if action not in ("save", "restore", "erase"):
            raise bad_request("Invalid action")
        filename, path = "", ""
        if action != "erase":
            body = await read_json(request)
            name = body.get("filename") if isinstance(body, dict) else None
            if not isinstance(name, str):
                raise bad_request('"filename" must be a string: the state file\'s name under --slot-save-path')
            if not valid_filename(name):
                raise bad_request("Invalid filename")
            filename, path = name, os.path.join(o.slot_save_path, name)
        task_id = st.ids.next()
        res = await results(
            st.eng().loop, request.receive, lambda sink: [SlotTask(task_id, action, slot, filename, path, sink)]
        )
        if isinstance(res, Response):
            return res
        (ev,) = res
        assert isinstance(ev, SlotResult)
        return JSONResponse(ev.body)
