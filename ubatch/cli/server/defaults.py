"""The server's limits as its flags default them: their own module, free of heavy imports, so
`ubatch server --help` and a usage error answer without loading the HTTP stack or the engine."""

from __future__ import annotations

MiB = 1 << 20
# A full 128k-token context sent as JSON text, every character \u-escaped (6 bytes per char at
# ~4 chars per token: 12 MiB), with room for a long chat history around it; a 100 MB body is
# refused before it is read, so it costs nothing.
DEFAULT_MAX_BODY_SIZE = 64 * MiB
# Deeper than any real request (a JSON schema nests a few dozen levels), far below the depth at
# which Python's recursive code (schema conversion, json.dumps) would raise RecursionError.
DEFAULT_MAX_JSON_DEPTH = 256
DEFAULT_TIMEOUT_S = 600  # llama-server's -to: read/write timeout
HEADER_TIMEOUT_CAP_S = 30  # a client sends its headers at once; 600 s would let idle sockets pile up
