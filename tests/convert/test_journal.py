"""The journal of an interrupted convert: appended a line per finished file, read back
whole, a write cut short ignored, anything else damaged reported."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from shardprep.convert.journal import Journal, parse_journal

DIGEST_A, DIGEST_B = "a" * 64, "b" * 64


def _journal(tmp_path: Path) -> Journal:
    journal = Journal(tmp_path / "journal", "plan-1")
    journal._save()
    return journal


def test_each_finished_file_appends_one_line(tmp_path: Path) -> None:
    journal = _journal(tmp_path)
    journal.record("shards/a.safetensors", DIGEST_A)
    before = journal.path.read_bytes()
    journal.record("shards/b.safetensors", DIGEST_B)
    after = journal.path.read_bytes()
    assert after.startswith(before) and after.count(b"\n") == before.count(b"\n") + 1
    assert parse_journal(after) == {
        "plan": "plan-1",
        "done": {"shards/a.safetensors": DIGEST_A, "shards/b.safetensors": DIGEST_B},
    }


def test_a_line_cut_short_is_ignored(tmp_path: Path) -> None:
    journal = _journal(tmp_path)
    journal.record("a", DIGEST_A)
    data = journal.path.read_bytes() + json.dumps({"path": "b", "sha256": DIGEST_B})[:-9].encode()
    assert parse_journal(data) == {"plan": "plan-1", "done": {"a": DIGEST_A}}


def test_a_resumed_journal_appends_after_whole_lines_of_its_own_plan(tmp_path: Path) -> None:
    journal = _journal(tmp_path)
    journal.record("a", DIGEST_A)
    with journal.path.open("ab") as handle:  # a write cut short by a crash
        handle.write(json.dumps({"path": "b", "sha256": DIGEST_B})[:-9].encode())
    resumed = Journal.resume(journal.path, tmp_path, "plan-1")
    resumed.record("b", DIGEST_B)
    done = {"a": DIGEST_A, "b": DIGEST_B}
    assert parse_journal(journal.path.read_bytes()) == {"plan": "plan-1", "done": done}
    other = Journal.resume(journal.path, tmp_path, "plan-2")
    other.record("c", DIGEST_A)
    assert parse_journal(journal.path.read_bytes()) == {"plan": "plan-2", "done": {"c": DIGEST_A}}


def test_a_damaged_line_is_reported(tmp_path: Path) -> None:
    journal = _journal(tmp_path)
    journal.record("a", DIGEST_A)
    data = journal.path.read_bytes()
    assert parse_journal(data.replace(b'"sha256"', b'"sha"')) is None
    assert parse_journal(data.replace(b'"plan-1"', b"1")) is None
    assert parse_journal(b"") is None


def test_the_single_object_of_earlier_versions_is_read() -> None:
    old = json.dumps({"plan": "p", "done": {"a": DIGEST_A}}, indent=1).encode() + b"\n"
    assert parse_journal(old) == {"plan": "p", "done": {"a": DIGEST_A}}


def test_a_link_planted_at_the_journal_is_replaced_not_followed(tmp_path: Path) -> None:
    journal = _journal(tmp_path)
    victim = tmp_path / "victim"
    victim.write_text("keep")
    journal.path.unlink()
    journal.path.symlink_to(victim)
    journal.record("a", DIGEST_A)
    assert victim.read_text() == "keep" and not journal.path.is_symlink()
    assert parse_journal(journal.path.read_bytes()) == {"plan": "plan-1", "done": {"a": DIGEST_A}}


@given(st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
def test_any_bytes_give_a_state_or_none(data: bytes) -> None:
    state = parse_journal(data)
    assert state is None or (isinstance(state["plan"], str) and isinstance(state["done"], dict))


@given(
    st.lists(
        st.one_of(
            st.dictionaries(st.sampled_from(["plan", "path", "sha256"]), st.text(max_size=5)),
            st.dictionaries(st.text(max_size=3), st.integers() | st.none() | st.text()),
            st.integers(),
            st.lists(st.text(max_size=3)),
        ),
        max_size=6,
    )
)
def test_any_json_lines_give_a_state_or_none(entries: list[object]) -> None:
    data = "".join(json.dumps(entry) + "\n" for entry in entries).encode()
    state = parse_journal(data)
    assert state is None or all(isinstance(v, str) for v in state["done"].values())
