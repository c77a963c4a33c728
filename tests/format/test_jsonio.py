"""Strict JSON: a key given twice is named, and a lone surrogate is refused where an
escape makes one (UTF-8 cannot), whatever the document."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardprep.format import headers, jsonio

KEYS = st.sampled_from(["a", "b", 'q":', "\\", "dtype", " x", "é", "\u2028", "a\nb"])
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.text(max_size=4), KEYS)


def _documents(depth: int = 2) -> st.SearchStrategy[str]:
    """JSON text of objects whose keys may repeat (as pairs), with spacing and escapes."""
    value = SCALARS.map(json.dumps) if depth == 0 else st.one_of(
        SCALARS.map(json.dumps), _documents(depth - 1)
    )  # fmt: skip
    pair = st.tuples(KEYS, value, st.sampled_from([":", ": ", " :", ":\n"]), st.booleans())

    def write(pairs: list[tuple[str, str, str, bool]]) -> str:
        return "{" + ",".join(
            json.dumps(k, ensure_ascii=escape) + colon + v for k, v, colon, escape in pairs
        ) + "}"  # fmt: skip

    objects = st.lists(pair, max_size=5).map(write)
    return objects | st.lists(objects, max_size=3).map(lambda items: f"[{','.join(items)}]")


def _all_pairs(value: object) -> int:
    """Every key-value pair of every object of a parsed document."""
    if isinstance(value, dict):
        return len(value) + sum(map(_all_pairs, value.values()))
    if isinstance(value, list):
        return sum(map(_all_pairs, value))
    return 0


def _top_pairs(value: object) -> int:
    """Only the outer object's pairs: a count that misses any inner object's."""
    return len(value) if isinstance(value, dict) else -1


COUNTS = [None, _all_pairs, _top_pairs, headers._pairs]


@settings(max_examples=300, deadline=None)
@given(_documents(), st.sampled_from(COUNTS))
def test_any_document_reads_as_json_does_or_names_its_repeated_key(text: str, count) -> None:
    """Also when the caller counts the pairs of the document's objects (the colons then
    vouch that no key repeats), whether the count sees every object or not."""
    pairs: list[list[tuple[str, object]]] = []
    plain = json.loads(text, object_pairs_hook=lambda p: pairs.append(p) or dict(p))
    try:
        assert jsonio.parse(text, limit=10**6, pairs=count) == plain
        assert all(len({k for k, _ in p}) == len(p) for p in pairs)
    except jsonio.JSONProblem as exc:
        assert "twice" in str(exc)
        assert any(len({k for k, _ in p}) < len(p) for p in pairs)


@pytest.mark.parametrize(
    "text",
    [
        '{"a": 1, "a": 2}',
        '{"x": {"dtype": "F32", "dtype": "F16"}}',
        '{"a\\u0022": 1, "a\\"": 2}',
        '{"k" : 1, "k": 2}',
        '{"a": "\\":", "a": 1}',
    ],
)
@pytest.mark.parametrize("count", COUNTS)
def test_a_key_given_twice_is_named(text: str, count) -> None:
    with pytest.raises(jsonio.JSONProblem, match="twice in one object"):
        jsonio.parse(text, limit=10**6, pairs=count)


def test_a_lone_surrogate_is_refused_only_where_escaped() -> None:
    with pytest.raises(jsonio.JSONProblem, match="lone surrogate"):
        jsonio.parse('{"\\ud800": 1}', limit=100)
    assert jsonio.parse('{"\\u00e9": "\\ud83d\\ude00"}', limit=100) == {"é": "\U0001f600"}
