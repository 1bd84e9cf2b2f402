"""Integer bounds as GBNF: the digit patterns that match exactly the integers in a range.

A grammar has no arithmetic, so `minimum`/`maximum` become alternatives over digit counts and
leading digits (llama.cpp's construction, kept exactly so grammars compare as text). An
unbounded side is limited to the 16 digits the generic integer rule allows.
"""

from __future__ import annotations


class _Out:
    """Collects the pieces of one range expression."""

    def __init__(self) -> None:
        self.parts: list[str] = []

    def put(self, text: str) -> None:
        self.parts.append(text)

    def digit_range(self, lo: str, hi: str) -> None:
        self.put(f"[{lo}]" if lo == hi else f"[{lo}-{hi}]")

    def more_digits(self, lo: int, hi: int | None) -> None:
        """[0-9] repeated lo..hi times (None: no limit)."""
        self.put("[0-9]")
        if lo == hi == 1:
            return
        self.put("{" + str(lo))
        if hi != lo:
            self.put("," + ("" if hi is None else str(hi)))
        self.put("}")

    def uniform_range(self, lo: str, hi: str) -> None:
        """Numbers from `lo` to `hi`, two digit strings of the same length."""
        i = 0
        while i < len(lo) and i < len(hi) and lo[i] == hi[i]:
            i += 1
        if i > 0:
            self.put(f'"{lo[:i]}"')
        if i >= len(lo) or i >= len(hi):
            return
        if i > 0:
            self.put(" ")
        sub_len = len(lo) - i - 1
        if sub_len <= 0:
            self.put(f"[{lo[i]}-{hi[i]}]")
            return
        lo_sub, hi_sub = lo[i + 1 :], hi[i + 1 :]
        zeros, nines = "0" * sub_len, "9" * sub_len
        to_reached = False
        self.put("(")
        if lo_sub == zeros:
            self.digit_range(lo[i], chr(ord(hi[i]) - 1))
            self.put(" ")
            self.more_digits(sub_len, sub_len)
        else:
            self.put(f"[{lo[i]}] (")
            self.uniform_range(lo_sub, nines)
            self.put(")")
            if ord(lo[i]) < ord(hi[i]) - 1:
                self.put(" | ")
                if hi_sub == nines:
                    self.digit_range(chr(ord(lo[i]) + 1), hi[i])
                    to_reached = True
                else:
                    self.digit_range(chr(ord(lo[i]) + 1), chr(ord(hi[i]) - 1))
                self.put(" ")
                self.more_digits(sub_len, sub_len)
        if not to_reached:
            self.put(" | ")
            self.digit_range(hi[i], hi[i])
            self.put(" ")
            self.uniform_range(zeros, hi_sub)
        self.put(")")

    def both(self, lo: int, hi: int, decimals: int) -> None:
        if lo < 0 and hi < 0:
            self.put('"-" (')
            self.range(-hi, -lo, decimals, True)
            self.put(")")
            return
        if lo < 0:
            self.put('"-" (')
            self.range(0, -lo, decimals, True)
            self.put(") | ")
            lo = 0
        lo_s, hi_s = str(lo), str(hi)
        for digits in range(len(lo_s), len(hi_s)):
            self.uniform_range(lo_s, "9" * digits)
            lo_s = "1" + "0" * digits
            self.put(" | ")
        self.uniform_range(lo_s, hi_s)

    def at_least(self, lo: int, decimals: int, top_level: bool) -> None:
        fewer = max(decimals - 1, 1)
        if lo < 0:
            self.put('"-" (')
            self.range(None, -lo, decimals, False)
            self.put(") | [0] | [1-9] ")
            self.more_digits(0, decimals - 1)
        elif lo == 0:
            if top_level:
                self.put("[0] | [1-9] ")
                self.more_digits(0, fewer)
            else:
                self.more_digits(1, decimals)
        elif lo <= 9:
            c = str(lo)
            start = "1" if top_level else "0"
            if c > start:
                self.digit_range(start, chr(ord(c) - 1))
                self.put(" ")
                self.more_digits(1, fewer)
                self.put(" | ")
            self.digit_range(c, "9")
            self.put(" ")
            self.more_digits(0, fewer)
        else:
            lo_s = str(lo)
            c = lo_s[0]
            if c > "1":
                self.digit_range("1" if top_level else "0", chr(ord(c) - 1))
                self.put(" ")
                self.more_digits(len(lo_s), fewer)
                self.put(" | ")
            self.digit_range(c, c)
            self.put(" (")
            self.range(int(lo_s[1:]), None, fewer, False)
            self.put(")")
            if c < "9":
                self.put(" | ")
                self.digit_range(chr(ord(c) + 1), "9")
                self.put(" ")
                self.more_digits(len(lo_s) - 1, fewer)

    def at_most(self, hi: int, decimals: int, top_level: bool) -> None:
        if hi >= 0:
            if top_level:
                self.put('"-" [1-9] ')
                self.more_digits(0, max(decimals - 1, 1))
                self.put(" | ")
            self.range(0, hi, decimals, True)
        else:
            self.put('"-" (')
            self.range(-hi, None, decimals, False)
            self.put(")")

    def range(self, lo: int | None, hi: int | None, decimals: int, top_level: bool) -> None:
        if lo is not None and hi is not None:
            self.both(lo, hi, decimals)
        elif lo is not None:
            self.at_least(lo, decimals, top_level)
        elif hi is not None:
            self.at_most(hi, decimals, top_level)
        else:
            raise ValueError("an integer range needs a minimum or a maximum")


def int_range_rule(minimum: int | None, maximum: int | None) -> str:
    """The GBNF body (parenthesised) matching the integers in [minimum, maximum]."""
    out = _Out()
    out.range(minimum, maximum, 16, True)
    return "(" + "".join(out.parts) + ")"
