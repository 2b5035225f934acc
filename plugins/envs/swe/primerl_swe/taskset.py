"""The shipped SWE task set: a small Python library, and 21 real bugs in it.

``pyutils`` is a little utility library (text, maths, collections, parsing) with a test
suite. Each task is one bug as programmers make them — an off-by-one, a missed edge case,
a wrong default, an order-losing shortcut — committed into its own copy of the library,
with the issue a user would file, the gold fix (``patch``), and a regression test
(``test_patch``) that fails before the fix and passes after. ``PASS_TO_PASS`` is the
library's existing suite, which must keep passing. :mod:`primerl_swe.build_tasks` turns
this into git repositories and a SWE-bench-format JSONL.
"""

from __future__ import annotations

LIBRARY: dict[str, str] = {
    "pyutils/__init__.py": '"""Small utilities."""\n',
    "pyutils/text.py": '''"""Text helpers."""

import re


def slugify(s):
    """Lower-case words joined by single dashes: "Hello,  World!" -> "hello-world"."""
    s = re.sub(r"[^a-z0-9]+", "-", s.lower())
    return s.strip("-")


def truncate(s, n, suffix="..."):
    """``s`` cut to at most ``n`` characters, ending in ``suffix`` when cut."""
    if len(s) <= n:
        return s
    return s[: n - len(suffix)] + suffix


def word_count(s):
    """Number of whitespace-separated words."""
    return len(s.split())


def is_palindrome(s):
    """True if ``s`` reads the same backwards, ignoring case and non-alphanumerics."""
    chars = [c.lower() for c in s if c.isalnum()]
    return chars == chars[::-1]


def capitalize_words(s):
    """Upper-case the first letter of every word, leaving the rest as it is."""
    return " ".join(w[:1].upper() + w[1:] for w in s.split(" "))
''',
    "pyutils/maths.py": '''"""Maths helpers."""


def mean(xs):
    """Arithmetic mean; ValueError for an empty sequence."""
    xs = list(xs)
    if not xs:
        raise ValueError("mean of an empty sequence")
    return sum(xs) / len(xs)


def median(xs):
    """Median; the mean of the two middle values for an even count."""
    s = sorted(xs)
    if not s:
        raise ValueError("median of an empty sequence")
    mid = len(s) // 2
    if len(s) % 2:
        return s[mid]
    return (s[mid - 1] + s[mid]) / 2


def clamp(x, lo, hi):
    """``x`` limited to [lo, hi]."""
    if x < lo:
        return lo
    if x > hi:
        return hi
    return x


def gcd(a, b):
    """Greatest common divisor, always >= 0."""
    a, b = abs(a), abs(b)
    while b:
        a, b = b, a % b
    return a


def is_prime(n):
    """True for prime numbers."""
    if n < 2:
        return False
    i = 2
    while i * i <= n:
        if n % i == 0:
            return False
        i += 1
    return True


def roman(n):
    """Roman numeral of 1 <= n <= 3999."""
    table = [(1000, "M"), (900, "CM"), (500, "D"), (400, "CD"), (100, "C"), (90, "XC"),
             (50, "L"), (40, "XL"), (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I")]
    out = []
    for value, sym in table:
        while n >= value:
            out.append(sym)
            n -= value
    return "".join(out)
''',
    "pyutils/seq.py": '''"""Sequence and container helpers."""

from collections import OrderedDict


def chunk(xs, n):
    """Consecutive chunks of ``n`` items; the last one may be shorter."""
    xs = list(xs)
    return [xs[i : i + n] for i in range(0, len(xs), n)]


def flatten(nested):
    """All leaves of nested lists/tuples, in order; strings are leaves."""
    out = []
    for x in nested:
        if isinstance(x, (list, tuple)):
            out.extend(flatten(x))
        else:
            out.append(x)
    return out


def dedupe(xs):
    """Items without repeats, in first-seen order."""
    seen = set()
    out = []
    for x in xs:
        if x not in seen:
            seen.add(x)
            out.append(x)
    return out


class Stack:
    def __init__(self):
        self._items = []

    def push(self, x):
        self._items.append(x)

    def pop(self):
        """The top item; IndexError when empty."""
        if not self._items:
            raise IndexError("pop from empty stack")
        return self._items.pop()

    def __len__(self):
        return len(self._items)


class LRUCache:
    """At most ``capacity`` items; the least recently used (read or written) goes first."""

    def __init__(self, capacity):
        self.capacity = capacity
        self._data = OrderedDict()

    def get(self, key, default=None):
        if key not in self._data:
            return default
        self._data.move_to_end(key)
        return self._data[key]

    def put(self, key, value):
        self._data[key] = value
        self._data.move_to_end(key)
        while len(self._data) > self.capacity:
            self._data.popitem(last=False)
''',
    "pyutils/parse.py": '''"""Parsers."""

import re


def parse_bool(s):
    """yes/no, true/false, on/off, 1/0 in any case; ValueError otherwise."""
    v = s.strip().lower()
    if v in ("yes", "true", "on", "1"):
        return True
    if v in ("no", "false", "off", "0"):
        return False
    raise ValueError(f"not a boolean: {s!r}")


def parse_duration(s):
    """Seconds in a duration like "1h30m", "45s" or "2h5m10s"."""
    units = {"h": 3600, "m": 60, "s": 1}
    parts = re.findall(r"(\\d+)([hms])", s)
    if not parts or "".join(n + u for n, u in parts) != s.replace(" ", ""):
        raise ValueError(f"not a duration: {s!r}")
    return sum(int(n) * units[u] for n, u in parts)


def parse_kv(s):
    """"a=1;b=2" -> {"a": "1", "b": "2"}; values may contain "="."""
    out = {}
    for item in s.split(";"):
        if item.strip():
            key, value = item.split("=", 1)
            out[key.strip()] = value.strip()
    return out


def is_leap_year(y):
    return y % 4 == 0 and (y % 100 != 0 or y % 400 == 0)


def days_in_month(y, m):
    if m == 2:
        return 29 if is_leap_year(y) else 28
    return 30 if m in (4, 6, 9, 11) else 31
''',
    "tests/__init__.py": "",
    "tests/test_text.py": '''from pyutils.text import capitalize_words, is_palindrome, slugify, truncate, word_count


def test_slugify():
    assert slugify("Hello World") == "hello-world"


def test_truncate():
    assert truncate("abcdefghij", 6) == "abc..."
    assert truncate("abc", 10) == "abc"


def test_word_count():
    assert word_count("one two three") == 3


def test_is_palindrome():
    assert is_palindrome("racecar")
    assert not is_palindrome("python")


def test_capitalize_words():
    assert capitalize_words("hello world") == "Hello World"
''',
    "tests/test_maths.py": '''import pytest

from pyutils.maths import clamp, gcd, is_prime, mean, median, roman


def test_mean():
    assert mean([1, 2, 3]) == 2


def test_median_odd():
    assert median([3, 1, 2]) == 2


def test_clamp_inside_and_below():
    assert clamp(5, 0, 10) == 5
    assert clamp(-3, 0, 10) == 0


def test_gcd():
    assert gcd(12, 18) == 6


def test_is_prime():
    assert [n for n in range(2, 20) if is_prime(n)] == [2, 3, 5, 7, 11, 13, 17, 19]


def test_roman():
    assert roman(1987) == "MCMLXXXVII"
''',
    "tests/test_seq.py": '''from pyutils.seq import LRUCache, Stack, chunk, dedupe, flatten


def test_chunk_even():
    assert chunk([1, 2, 3, 4], 2) == [[1, 2], [3, 4]]


def test_flatten():
    assert flatten([1, [2, [3, 4]], 5]) == [1, 2, 3, 4, 5]


def test_dedupe():
    assert sorted(dedupe([3, 1, 3, 2, 1])) == [1, 2, 3]


def test_stack():
    s = Stack()
    s.push(1)
    s.push(2)
    assert s.pop() == 2 and len(s) == 1


def test_lru_evicts_oldest_write():
    c = LRUCache(2)
    c.put("a", 1)
    c.put("b", 2)
    c.put("c", 3)
    assert c.get("a") is None and c.get("c") == 3
''',
    "tests/test_parse.py": '''from pyutils.parse import days_in_month, is_leap_year, parse_bool, parse_duration, parse_kv


def test_parse_bool():
    assert parse_bool("yes") is True and parse_bool("0") is False


def test_parse_duration():
    assert parse_duration("1h30m") == 5400


def test_parse_kv():
    assert parse_kv("a=1;b=2") == {"a": "1", "b": "2"}


def test_leap_years():
    assert is_leap_year(2024) and not is_leap_year(2023) and is_leap_year(2000)


def test_days_in_month():
    assert days_in_month(2023, 1) == 31 and days_in_month(2023, 4) == 30 and days_in_month(2023, 2) == 28
''',
    "pyproject.toml": '''[project]
name = "pyutils"
version = "0.1.0"

[tool.pytest.ini_options]
testpaths = ["tests"]
''',
}

# (id, file, correct code, buggy code, issue text, regression test)
BUGS: list[tuple[str, str, str, str, str, str]] = [
    ("slugify-dashes", "pyutils/text.py",
     's = re.sub(r"[^a-z0-9]+", "-", s.lower())', 's = re.sub(r"[^a-z0-9]", "-", s.lower())',
     'slugify("Hello,  World!") returns "hello---world"; runs of punctuation and spaces should become a '
     'single dash ("hello-world").',
     'from pyutils.text import slugify\n\n\ndef test_slugify_collapses_separators():\n'
     '    assert slugify("Hello,  World!") == "hello-world"\n'),
    ("truncate-exact-length", "pyutils/text.py", "if len(s) <= n:", "if len(s) < n:",
     'truncate("abcdef", 6) returns "abc..." although the text already fits in 6 characters.',
     'from pyutils.text import truncate\n\n\ndef test_truncate_keeps_text_of_exact_length():\n'
     '    assert truncate("abcdef", 6) == "abcdef"\n'),
    ("word-count-spaces", "pyutils/text.py", "return len(s.split())", 'return len(s.split(" "))',
     'word_count("a  b") is 3 and word_count("") is 1: repeated spaces and empty strings are miscounted.',
     'from pyutils.text import word_count\n\n\ndef test_word_count_ignores_extra_whitespace():\n'
     '    assert word_count("a  b") == 2\n    assert word_count("") == 0\n    assert word_count(" x\\ty\\n") == 2\n'),
    ("palindrome-case", "pyutils/text.py", "chars = [c.lower() for c in s if c.isalnum()]",
     "chars = [c for c in s if c.isalnum()]",
     'is_palindrome("A man, a plan, a canal: Panama") is False; case should not matter.',
     'from pyutils.text import is_palindrome\n\n\ndef test_palindrome_ignores_case():\n'
     '    assert is_palindrome("A man, a plan, a canal: Panama")\n'),
    ("capitalize-keeps-rest", "pyutils/text.py",
     'return " ".join(w[:1].upper() + w[1:] for w in s.split(" "))', "return s.title()",
     'capitalize_words("hello wORLD of iOS") gives "Hello World Of Ios"; only first letters should change.',
     'from pyutils.text import capitalize_words\n\n\ndef test_capitalize_leaves_other_letters():\n'
     '    assert capitalize_words("hello wORLD of iOS") == "Hello WORLD Of IOS"\n'),
    ("mean-empty", "pyutils/maths.py",
     '    if not xs:\n        raise ValueError("mean of an empty sequence")\n', "",
     "mean([]) raises ZeroDivisionError; it should raise ValueError like median([]).",
     'import pytest\n\nfrom pyutils.maths import mean\n\n\ndef test_mean_of_empty_is_value_error():\n'
     '    with pytest.raises(ValueError):\n        mean([])\n'),
    ("median-even", "pyutils/maths.py", "return (s[mid - 1] + s[mid]) / 2", "return s[mid]",
     "median([1, 2, 3, 4]) returns 3; for an even count it should be the mean of the two middle values, 2.5.",
     'from pyutils.maths import median\n\n\ndef test_median_even_count():\n    assert median([4, 1, 3, 2]) == 2.5\n'),
    ("clamp-above", "pyutils/maths.py", "    if x > hi:\n        return hi\n", "    if x > hi:\n        return lo\n",
     "clamp(15, 0, 10) returns 0 instead of 10.",
     'from pyutils.maths import clamp\n\n\ndef test_clamp_above():\n    assert clamp(15, 0, 10) == 10\n'),
    ("gcd-negative", "pyutils/maths.py", "a, b = abs(a), abs(b)", "a, b = a, b",
     "gcd(-4, 6) returns -2; the greatest common divisor is never negative.",
     'from pyutils.maths import gcd\n\n\ndef test_gcd_of_negatives():\n    assert gcd(-4, 6) == 2\n    assert gcd(4, -6) == 2\n'),
    ("prime-one", "pyutils/maths.py", "if n < 2:", "if n < 1:",
     "is_prime(1) returns True; 1 is not a prime number.",
     'from pyutils.maths import is_prime\n\n\ndef test_one_and_zero_are_not_prime():\n'
     '    assert not is_prime(1) and not is_prime(0)\n'),
    ("roman-subtractive", "pyutils/maths.py", '(5, "V"), (4, "IV"), (1, "I")]', '(5, "V"), (1, "I")]',
     'roman(4) returns "IIII" and roman(14) "XIIII"; they should be "IV" and "XIV".',
     'from pyutils.maths import roman\n\n\ndef test_roman_four():\n    assert roman(4) == "IV"\n    assert roman(14) == "XIV"\n'),
    ("chunk-partial", "pyutils/seq.py", "return [xs[i : i + n] for i in range(0, len(xs), n)]",
     "return [xs[i : i + n] for i in range(0, len(xs) - n + 1, n)]",
     "chunk([1, 2, 3, 4, 5], 2) drops the 5; the last chunk may be shorter but must be kept.",
     'from pyutils.seq import chunk\n\n\ndef test_chunk_keeps_partial_last_chunk():\n'
     '    assert chunk([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]\n'),
    ("flatten-strings", "pyutils/seq.py", "if isinstance(x, (list, tuple)):",
     'if isinstance(x, (list, tuple, str)) and not (isinstance(x, str) and len(x) == 1):',
     'flatten(["ab", ["cd"]]) returns ["a", "b", "c", "d"]; strings should stay whole.',
     'from pyutils.seq import flatten\n\n\ndef test_flatten_keeps_strings():\n'
     '    assert flatten(["ab", ["cd", ("e",)]]) == ["ab", "cd", "e"]\n'),
    ("dedupe-order", "pyutils/seq.py",
     "    seen = set()\n    out = []\n    for x in xs:\n        if x not in seen:\n            seen.add(x)\n"
     "            out.append(x)\n    return out\n",
     "    return list(set(xs))\n",
     "dedupe([3, 1, 3, 2]) returns [1, 2, 3]; the first-seen order [3, 1, 2] is lost.",
     'from pyutils.seq import dedupe\n\n\ndef test_dedupe_keeps_first_seen_order():\n'
     '    assert dedupe([3, 1, 3, 2, 1]) == [3, 1, 2]\n'),
    ("stack-empty-pop", "pyutils/seq.py",
     '        if not self._items:\n            raise IndexError("pop from empty stack")\n        return self._items.pop()',
     "        if not self._items:\n            return None\n        return self._items.pop()",
     "Stack().pop() returns None on an empty stack instead of raising IndexError, hiding bugs.",
     'import pytest\n\nfrom pyutils.seq import Stack\n\n\ndef test_pop_empty_raises():\n'
     '    with pytest.raises(IndexError):\n        Stack().pop()\n'),
    ("lru-read-refresh", "pyutils/seq.py",
     "            return default\n        self._data.move_to_end(key)\n        return self._data[key]",
     "            return default\n        return self._data[key]",
     "LRUCache evicts an item that was just read: get() should count as a use.",
     'from pyutils.seq import LRUCache\n\n\ndef test_get_refreshes_recency():\n    c = LRUCache(2)\n'
     '    c.put("a", 1)\n    c.put("b", 2)\n    c.get("a")\n    c.put("c", 3)\n'
     '    assert c.get("a") == 1 and c.get("b") is None\n'),
    ("parse-bool-case", "pyutils/parse.py", "v = s.strip().lower()", "v = s.strip()",
     'parse_bool("Yes") and parse_bool("TRUE") raise ValueError; the case should not matter.',
     'from pyutils.parse import parse_bool\n\n\ndef test_parse_bool_any_case():\n'
     '    assert parse_bool("Yes") is True and parse_bool("FALSE") is False\n'),
    ("duration-seconds", "pyutils/parse.py", 'units = {"h": 3600, "m": 60, "s": 1}', 'units = {"h": 3600, "m": 60, "s": 0}',
     'parse_duration("2h5m10s") returns 7500; the seconds are ignored (expected 7510).',
     'from pyutils.parse import parse_duration\n\n\ndef test_duration_counts_seconds():\n'
     '    assert parse_duration("2h5m10s") == 7510\n    assert parse_duration("45s") == 45\n'),
    ("kv-equals-in-value", "pyutils/parse.py", 'key, value = item.split("=", 1)', 'key, value = item.split("=")',
     'parse_kv("url=a=b") raises "too many values to unpack"; values may contain "=".',
     'from pyutils.parse import parse_kv\n\n\ndef test_value_with_equals():\n'
     '    assert parse_kv("url=a=b;x=1") == {"url": "a=b", "x": "1"}\n'),
    ("leap-century", "pyutils/parse.py", "return y % 4 == 0 and (y % 100 != 0 or y % 400 == 0)",
     "return y % 4 == 0",
     "is_leap_year(1900) returns True; century years are leap years only when divisible by 400.",
     'from pyutils.parse import is_leap_year\n\n\ndef test_century_years():\n'
     '    assert not is_leap_year(1900) and not is_leap_year(2100) and is_leap_year(2000)\n'),
    ("february-leap", "pyutils/parse.py", "return 29 if is_leap_year(y) else 28", "return 28",
     "days_in_month(2024, 2) returns 28; February has 29 days in leap years.",
     'from pyutils.parse import days_in_month\n\n\ndef test_february_in_leap_year():\n'
     '    assert days_in_month(2024, 2) == 29\n'),
]
