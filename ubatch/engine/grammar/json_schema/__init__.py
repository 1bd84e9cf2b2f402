"""JSON schema -> GBNF grammar, as llama.cpp's json_schema_to_grammar builds it."""
