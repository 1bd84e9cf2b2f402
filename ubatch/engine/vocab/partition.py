"""Special-token partitioning (llama.cpp's tokenizer_st_partition): a text is split around the
special tokens it contains, longest first, before the merge loop sees the pieces between them."""

from __future__ import annotations

Groups = dict[str, tuple[dict[str, tuple[int, str, int]], list[int]]]


def group_specials(ids: list[int], text: dict[int, str]) -> Groups:
    """Specials as (rank in partition order, text, id), grouped by their first 3 characters."""
    groups: Groups = {}
    for rank, i in enumerate(ids):
        t = text[i]
        members, lengths = groups.setdefault(t[:3], ({}, []))
        members[t] = (rank, t, i)
        if len(t) not in lengths:
            lengths.append(len(t))
    return groups


_C_SPACE = " \t\n\v\f\r"  # C isspace: what LSTRIP/RSTRIP take off beside a special token


def partition(text: str, groups: Groups, strip: dict[int, tuple[bool, bool]] | None = None) -> list[str | int]:
    """llama.cpp's tokenizer_st_partition: split special texts out, longest token first.
    strip: token -> (lstrip, rstrip): whitespace before / after it is dropped."""
    # Only specials present in the whole text can split a fragment. A 3-char prefix test
    # skips most groups; big groups (6,242 "<unusedN>") are matched at each prefix hit.
    present: set[tuple[int, str, int]] = set()
    for prefix, (members, lengths) in groups.items():
        if prefix not in text:
            continue
        if len(members) <= 16:
            present.update(m for t, m in members.items() if t in text)
            continue
        pos = text.find(prefix)
        while pos >= 0:
            present.update(members[t] for k in lengths if (t := text[pos : pos + k]) in members)
            pos = text.find(prefix, pos + 1)
    frags: list[str | int] = [text] if text else []
    for _, tok_text, tok in sorted(present):
        out: list[str | int] = []
        for f in frags:
            if isinstance(f, str) and tok_text in f:
                parts = f.split(tok_text)
                lstrip, rstrip = strip.get(tok, (False, False)) if strip else (False, False)
                for j, part in enumerate(parts):
                    if rstrip and j:
                        part = part.lstrip(_C_SPACE)
                    if lstrip and j < len(parts) - 1:
                        part = part.rstrip(_C_SPACE)
                    out.extend(([tok] if j else []) + ([part] if part else []))
            else:
                out.append(f)
        frags = out
    return frags
