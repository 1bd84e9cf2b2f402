"""What ubatch does with each llama.cpp flag it does not implement: accept it with a one-line
notice (it only moves work between devices, threads or files, so results are the same), or refuse
it (it would change the tokens produced, or it asks for something ubatch cannot do), with the why.

Implemented flags are the options the commands declare; every other flag a llama.cpp tool takes
must be listed here (tests/test_llama_args.py checks it), so no llama.cpp command line meets
"No such option".
"""

from __future__ import annotations

from dataclasses import dataclass

from ubatch.cli.llama.flags import LlamaFlag

NO_EFFECT, REFUSED = "no effect", "refused"


@dataclass(frozen=True, slots=True)
class Policy:
    status: str  # NO_EFFECT or REFUSED
    reason: str


_GPU = (
    "ubatch runs each rank's part of the model on one device (--device cuda|cpu), the whole model or with "
    "-tp N one cut per rank: no per-layer, per-tensor or partial offload"
)
_LOAD = "weights are read from the GGUF file into ubatch's own buffers (no mmap/mlock/direct-I/O choice)"
_THREADS = "one pool of -t threads runs prompt and generation; affinity and priority are left to the OS"
_FA = "ubatch has one attention implementation over the KV cells (no separate flash-attention path)"
_SPEC = "ubatch's drafters (ngram-simple, draft-simple) do not use this setting; verified tokens are the target's either way"
_SPEC_DEV = "the draft model runs where the target runs, with the same -t threads"
_LOG = "ubatch's log lines have one fixed format"
_ROUTER = "one model per server: there is no router mode"
_UI = "the bundled pages keep their settings in the browser: no UI config and no MCP proxy"
_TOOLS = "no tool runtime or agent is bundled with ubatch"
_REASON = (
    "the output is not parsed for reasoning or tool calls; text is returned as generated (ubatch server parses them)"
)
# the server parses replies and budgets thinking (--reasoning-format, -rea, --reasoning-budget and
# --reasoning-budget-message are implemented); these stay unread
_SERVER_REASON = "the server's templates get no reasoning_effort / preserve_reasoning; replies are always parsed"
_SERVER_REASON_FLAGS = {"--reasoning-effort", "--reasoning-preserve", "--skip-chat-parsing"}
_CKPT = "ubatch keeps no context checkpoints and needs no defragmentation; the server keeps prompts that leave the KV cache in --cache-ram"
_PRESET = "presets download models; ubatch never downloads: give a local GGUF with -m"
_DOWNLOAD = "ubatch never downloads: give a local GGUF file with -m"
_MTMD = "ubatch is text-only: no multimodal projector, images, audio or video"
_ADAPTER = "control vectors are not supported"
_ROPE = "RoPE/YaRN overrides are not supported: the model's own RoPE settings are used"
_REMOVED = "the argument has been removed (as in llama.cpp): use --spec-draft-n-max or --spec-ngram-mod-n-max"

# reason -> the flags it applies to (space-separated)
_NO_EFFECT = {
    _GPU: (
        "--n-gpu-layers --split-mode --tensor-split --main-gpu --override-tensor --cpu-moe "
        "--n-cpu-moe --n-cpu-ffn --kv-offload --no-kv-offload --op-offload --no-op-offload "
        "--no-host --repack --fit --fit-target --fit-ctx --list-devices --backend-sampling "
        "--mmproj-offload --mmproj-device --rpc"
    ),
    "this command computes nothing on a device (--device is taken where a model runs)": "--device",
    _LOAD: "--load-mode --lazy-mode --numa --check-tensors --mlock --mmap --direct-io",
    _THREADS: (
        "--threads-batch --cpu-mask --cpu-range --cpu-strict --prio --poll --cpu-mask-batch "
        "--cpu-range-batch --cpu-strict-batch --prio-batch --poll-batch --threads-http"
    ),
    _FA: "--flash-attn",
    _SPEC_DEV: (
        "--spec-draft-threads --spec-draft-threads-batch --spec-draft-ngl --spec-draft-device "
        "--spec-draft-cpu-mask --spec-draft-cpu-range --spec-draft-cpu-strict --spec-draft-prio "
        "--spec-draft-poll --spec-draft-cpu-mask-batch --spec-draft-cpu-range-batch "
        "--spec-draft-cpu-strict-batch --spec-draft-prio-batch --spec-draft-poll-batch "
        "--spec-draft-override-tensor --spec-draft-cpu-moe --spec-draft-n-cpu-moe"
    ),
    _LOG: (
        "--log-file --log-jsonl --log-colors --log-prefix --log-timestamps --log-prompts-dir "
        "--perf --verbose-prompt --print-token-count"
    ),
    _ROUTER: "--models-dir --models-preset --models-max --models-autoload",
    _UI: "--ui-config --ui-config-file --ui-mcp-proxy",
    _TOOLS: "--tools --tools-runtime --mcp-servers-config --mcp-servers-json --agent",
    _REASON: (
        "--reasoning-format --reasoning --reasoning-effort --reasoning-budget "
        "--reasoning-budget-message --reasoning-preserve --skip-chat-parsing"
    ),
    _CKPT: "--ctx-checkpoints --checkpoint-min-step --cache-idle-slots --kv-unified-per-slot --defrag-thold",
    "the host-memory prompt cache is the server's (ubatch server -cram); a one-shot run keeps --prompt-cache files": "--cache-ram",
    _DOWNLOAD: "--offline",
    "there is no server-side idle sleep: the model stays loaded": "--sleep-idle-seconds",
    "no keep-alive pings are sent on idle streams": "--sse-ping-interval",
    "one socket per address is bound": "--reuse-port",
    "media files are not served (text-only)": "--media-path",
    "the prompt is always processed with the chat template's BOS": "--in-prefix-bos",
    _MTMD: "--no-mmproj --mmproj-auto --no-mmproj-auto",
    "-lv 4 (debug) gives a line per request": "--log-verbose",
    "the one-shot log has one level: --log-disable turns it off, -v adds detail": "--log-verbosity",
}
_REFUSED = {
    _DOWNLOAD: "--spec-draft-hf --hf-repo --hf-file --hf-token --model-url --docker-repo --cache-list",
    _REMOVED: "--draft --draft-n --draft-max --draft-min --draft-n-min",
    _PRESET: (
        "--embd-gemma-default --fim-qwen-1.5b-default --fim-qwen-3b-default --fim-qwen-7b-default "
        "--fim-qwen-7b-spec --fim-qwen-14b-spec --fim-qwen-30b-default --gpt-oss-20b-default "
        "--gpt-oss-120b-default --vision-gemma-4b-default --vision-gemma-12b-default "
        "--spec-default"
    ),
    _MTMD: (
        "--mmproj --mmproj-url --image --image-min-tokens --image-max-tokens "
        "--mtmd-batch-max-tokens --video-fps --video-timestamp-interval --video-ffmpeg-dir"
    ),
    _ADAPTER: "--control-vector --control-vector-scaled --control-vector-layer-range",
    _ROPE: (
        "--rope-scaling --rope-scale --rope-freq-base --rope-freq-scale --yarn-orig-ctx "
        "--yarn-ext-factor --yarn-attn-factor --yarn-beta-slow --yarn-beta-fast --grp-attn-n "
        "--grp-attn-w"
    ),
    "GGUF metadata overrides are not supported": "--override-kv",
    "the adaptive-p sampler is not implemented": "--adaptive-target --adaptive-decay",
    "binary prompt files are not supported: use -f with text": "--binary-file",
    "HTTPS is not built in: put a TLS proxy in front of the server": "--ssl-key-file --ssl-cert-file",
    "fill-in-the-middle (/infill) is not implemented": "--spm-infill",
    "bash completion scripts are not generated": "--completion-bash",
    "llama-cli's client mode is not implemented: run `ubatch server` and a client": "--server-base",
    "chat template kwargs are not supported: the template gets the messages only": "--chat-template-kwargs",
    "the output goes to stdout: redirect it to a file": "--output-file",
}
_TABLE = {
    name: (status, reason)
    for status, table in ((NO_EFFECT, _NO_EFFECT), (REFUSED, _REFUSED))
    for reason, names in table.items()
    for name in names.split()
}

# flags a tool takes from llama.cpp's common set but has no use for (as in llama.cpp itself)
_UNUSED = {
    "tokenize": "tokenizing does not generate or allocate a context: this flag is not used",
    "batched-bench": "the benchmark makes its own prompts (-npp, -ntg, -npl) and does not sample",
    "info": "info plans memory only: this flag shapes requests or the HTTP server, not the plan",
    "server": "requests carry their own text",
    "bench": "llama-bench's table is the output",
}


# the flags _UNUSED applies to, per tool
_UNUSED_FLAGS = {"server": {"--escape"}, "bench": {"--embeddings", "--progress", "--verbose"}}


_LORA_BENCH = "the benchmarks time the base model: LoRA adapters are applied by ubatch cli, server and info"


def policy_for(flag: LlamaFlag, tool: str = "") -> Policy | None:
    """How ubatch treats an undeclared llama.cpp flag; speculative flags share one reason."""
    if tool in ("bench", "batched-bench") and set(flag.all_names) & {"--lora", "--lora-scaled"}:
        return Policy(REFUSED, _LORA_BENCH)  # timing the base model instead would mislead
    if tool == "server" and set(flag.all_names) & _SERVER_REASON_FLAGS:
        return Policy(NO_EFFECT, _SERVER_REASON)
    for n in flag.all_names:
        if n in _TABLE:
            return Policy(*_TABLE[n])
    if tool in ("tokenize", "batched-bench", "info") or set(flag.names) & _UNUSED_FLAGS.get(tool, set()):
        return Policy(NO_EFFECT, _UNUSED[tool])
    if flag.spec or any(n.startswith(("--draft", "--spec-")) for n in flag.names):
        return Policy(NO_EFFECT, _SPEC)
    if any(n.startswith("--lookup-cache") for n in flag.names):
        return Policy(NO_EFFECT, _SPEC)
    return None
