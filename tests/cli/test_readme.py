"""The README's usage lines are checked against the argparse definitions, so they cannot
drift: every command, every flag, every choice and every default, nothing more.

A usage line is any README code line that starts with `shardprep COMMAND` and names an
optional flag in brackets, with the more-indented lines under it; a code line without
brackets is an example, which the parser must accept as it is. Positionals and required
options are written bare, with their metavar; optional flags in brackets: `[--flag]` for a
switch, `[--flag VALUE]` where VALUE is the choices joined by `|`, else the default, else
the metavar; `[--a X | --b]` for mutually exclusive flags.
"""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from shardprep.cli import build_parser

README = Path(__file__).resolve().parents[2] / "README.md"


def usage_lines(text: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    lines = text.splitlines()
    for index, line in enumerate(lines):
        match = re.match(r"^( {4,})shardprep ([a-z]+)\b(.*)$", line)
        if not match:
            continue
        indent, command, rest = match.groups()
        if "[" not in rest:
            continue  # an example (example_lines)
        parts = [rest]
        for following in lines[index + 1 :]:
            if not following.startswith(indent + " ") or not following.strip().startswith("["):
                break
            parts.append(following)
        found.setdefault(command, []).append(" ".join(p.split("#")[0] for p in parts))
    return found


def example_lines(text: str) -> list[str]:
    """The arguments of each README code line that runs `shardprep` with no bracket."""
    found = re.findall(r"^ {4,}shardprep ([a-z]+\b[^[\n]*)$", text, re.M)
    return [line.split("#")[0].strip() for line in found]


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def value_of(action: argparse.Action) -> str | None:
    if action.nargs == 0:
        return None
    if action.choices:
        return "|".join(action.choices)
    if action.default is not None:
        return str(action.default)
    return action.metavar


Usage = tuple[list[str], set[str], set[frozenset[str]]]


def described(parser: argparse.ArgumentParser) -> Usage:
    """What a usage line must say: positionals, bare options, bracketed option groups."""
    positionals, bare, bracketed = [], set(), set()
    groups = {
        id(a): group for group in parser._mutually_exclusive_groups for a in group._group_actions
    }
    done: set[int] = set()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or id(action) in done:
            continue
        if not action.option_strings:
            positionals.append(action.metavar)
            continue
        members = groups[id(action)]._group_actions if id(action) in groups else [action]
        done |= {id(a) for a in members}
        items = frozenset(_item(a) for a in members)
        if action.required:
            bare |= items
        else:
            bracketed.add(items)
    return positionals, bare, bracketed


def _item(action: argparse.Action) -> str:
    value = value_of(action)
    return action.option_strings[-1] + (f" {value}" if value else "")


def parse_usage(parser: argparse.ArgumentParser, line: str) -> Usage:
    """The same three things, as a README usage line writes them (`-o` = `--output`)."""
    aliases = {s: a.option_strings[-1] for a in parser._actions for s in a.option_strings}

    def canonical(item: str) -> str:
        flag, *value = item.split(maxsplit=1)
        return " ".join([aliases.get(flag, flag), *value])

    bracketed = {
        frozenset(canonical(alt.strip()) for alt in group.split(" | "))
        for group in re.findall(r"\[([^]]*)]", line)
    }
    tokens = re.sub(r"\[[^]]*]", " ", line).split()
    positionals, bare = [], set()
    while tokens:
        token = tokens.pop(0)
        if token.startswith("-"):
            bare.add(canonical(f"{token} {tokens.pop(0)}"))
        else:
            positionals.append(token)
    return positionals, bare, bracketed


def test_every_command_has_a_usage_line() -> None:
    assert sorted(usage_lines(README.read_text())) == sorted(subcommands())


@pytest.mark.parametrize("command", sorted(subcommands()))
def test_usage_lines_match_the_parser(command: str) -> None:
    parser = subcommands()[command]
    for line in usage_lines(README.read_text())[command]:
        assert parse_usage(parser, line) == described(parser), line


def test_examples_parse() -> None:
    examples = example_lines(README.read_text())
    assert {line.split()[0] for line in examples} >= {"convert", "publish"}
    for line in examples:
        try:
            build_parser().parse_args(shlex.split(line))
        except SystemExit:
            pytest.fail(f"the README's example does not parse: shardprep {line}")


@pytest.mark.parametrize("command", sorted(subcommands()))
def test_help_states_every_default(command: str) -> None:
    for action in subcommands()[command]._actions:
        if action.default not in (None, False, argparse.SUPPRESS) and action.option_strings:
            assert action.help
            assert f"default: {action.default}" in action.help, action.option_strings


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (" [--revision REV]", ""),  # a flag left out
        ("5GiB", "4GiB"),  # a wrong default
        ("[--json]", "[--json] [--verbose]"),  # a flag that does not exist
        ("eagle|eagle3", "eagle"),  # choices that differ
        ("-o OUT", "[-o OUT]"),  # a required option shown as optional
    ],
)
def test_drift_is_caught(old: str, new: str) -> None:
    parser = subcommands()["convert"]
    line = usage_lines(README.read_text())["convert"][0]
    assert old in line
    assert parse_usage(parser, line.replace(old, new)) != described(parser)


def supported_table(text: str) -> tuple[dict[str, set[str]], set[str]]:
    """The README's table of supported architectures ({architecture: its internal draft
    methods}; an architecture may link to its reference) and the drafts it says any target
    takes with --draft."""
    section = text.split("### Supported architectures and drafts", 1)[1]
    section = re.split(r"\n#{1,6} ", section, maxsplit=1)[0]
    table: dict[str, set[str]] = {}
    for row in re.findall(r"^\| (\[?`.*) \|$", section, re.M):
        architectures, drafts = row.split(" | ")
        for name in re.findall(r"`(\w+)`", architectures):
            table[name] = set(re.findall(r"`(\w+)`", drafts))
    line = re.search(r"Drafts given with `--draft`, for any of them: (.*)\.", section)
    assert line, "the README no longer says which drafts every target takes"
    return table, set(re.findall(r"`(\w+)`", line.group(1)))


def test_the_supported_table_is_the_registry() -> None:
    from shardprep.demo.tiny import tiny_config
    from shardprep.plan import archs

    table, any_target = supported_table(README.read_text())
    assert sorted(table) == list(archs.supported()[0])
    assert any_target == set(archs.standalone_methods())
    for architecture, drafts in table.items():
        config = tiny_config(architecture, num_nextn_predict_layers=1)
        own = archs.target_family_of(architecture).internal_draft(config)
        assert drafts == ({own} if own else set()), architecture
