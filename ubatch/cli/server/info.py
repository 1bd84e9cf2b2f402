"""The discovery bodies of `ubatch server`: /v1/models (also /models) and /props, with the keys
this llama-server version sends, so clients that read them (the web UI, OpenAI-style model
pickers, Ollama-style `models`) see the same shapes.

The model's names follow llama-server (`ServerOptions.model_aliases`, `model_name`): the aliases
(`-a a,b`) are a set, listed sorted, and the first of them is the model's id; with no alias the
id is the model path as given.
"""

from __future__ import annotations

import secrets
import string
import time
from typing import Any

from ubatch.cli.server import responses as sj
from ubatch.cli.server.state import ServerState
from ubatch.cli.sysinfo import FTYPE_NAMES
from ubatch.engine.serve.task import TaskParams

# a per-process marker, as llama-server's get_media_marker (this server takes no media)
MEDIA_MARKER = "<__media_" + "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(32)) + "__>"


def ftype_name(metadata: dict[str, Any]) -> str:
    ft = metadata.get("general.file_type")
    if ft is None:
        return "unknown"
    return FTYPE_NAMES.get(int(ft), f"ftype {int(ft)}")


def models_json(st: ServerState) -> dict[str, Any]:
    """GET /v1/models: the Ollama-style `models` list and the OpenAI-style `data` list."""
    s = st.handle()
    m = s.model
    hp, name = m.hparams, st.model_id
    aliases = st.options.model_aliases() or [name]  # llama-server adds the path as the one alias
    ollama = {
        "name": name,
        "model": name,
        "modified_at": "",
        "size": "",
        "digest": "",
        "type": "model",
        "description": "",
        "tags": [""],
        "capabilities": ["completion"],
        "parameters": "",
        "details": {
            "parent_model": "",
            "format": "gguf",
            "family": "",
            "families": [""],
            "parameter_size": "",
            "quantization_level": "",
        },
    }
    info = {
        "id": name,
        "aliases": aliases,
        "tags": sorted(set(st.options.tags)),
        "object": "model",
        "architecture": {"input_modalities": ["text"], "output_modalities": ["text"]},
        "created": int(time.time()),
        "owned_by": "llamacpp",
        "meta": {
            "vocab_type": 1,  # LLAMA_VOCAB_TYPE_SPM
            "n_vocab": hp.n_vocab,
            "n_ctx": s.n_ctx_slot,
            "n_ctx_train": hp.n_ctx_train,
            "n_embd": hp.n_embd,
            "n_params": m.n_params,
            "size": m.size_bytes,
            "ftype": ftype_name(m.metadata),
        },
    }
    return {"models": [ollama], "object": "list", "data": [info]}


def template_caps(st: ServerState) -> dict[str, bool]:
    """chat_template_caps: what the template renders. This server renders string content only
    and no tools; a system message is supported when its text reaches the prompt."""
    assert st.chat is not None
    probe = "\x01ubatch-system-probe\x01"
    try:
        system = probe in st.chat.apply([{"role": "system", "content": probe}, {"role": "user", "content": "x"}])
    except Exception:  # a template that raises on a system message does not support it
        system = False
    caps = (
        "supports_object_arguments supports_parallel_tool_calls supports_preserve_reasoning "
        "supports_reasoning_effort supports_string_content supports_system_role supports_tool_calls "
        "supports_tools supports_typed_content"
    ).split()
    return {c: (c == "supports_string_content" or (c == "supports_system_role" and system)) for c in caps}


def props_json(st: ServerState) -> dict[str, Any]:
    """GET /props, with llama-server's keys."""
    s, o = st.handle(), st.options
    vocab = s.vocab
    assert st.chat is not None
    lora = st.eng().loop.lora_scales()  # the global scales a request without `lora` applies
    params = TaskParams(
        n_predict=st.defaults.n_predict, sampling=st.defaults.sampling, cache_prompt=o.cache_prompt, lora=lora
    )
    return {
        "default_generation_settings": {"params": sj.params_json(params), "n_ctx": s.n_ctx_slot},
        "total_slots": s.n_slots,
        "model_alias": st.model_id,
        "model_ftype": ftype_name(s.model.metadata),
        "model_path": str(s.model.path),
        "modalities": {"vision": False, "video": False, "audio": False},
        "media_marker": MEDIA_MARKER,
        "endpoint_slots": o.slots,
        "endpoint_props": o.props,
        "endpoint_metrics": o.metrics,
        "ui": o.webui,  # the chat page at / (cli/server/routes/webui.py)
        "ui_settings": {},
        "chat_template": st.chat.source or st.chat.name,
        "chat_template_caps": template_caps(st),
        "bos_token": vocab.token_text(vocab.bos),
        "eos_token": vocab.token_text(vocab.eos),
        "build_info": sj.BUILD_INFO,
        "is_sleeping": False,
        "cors_proxy_enabled": False,
    }
