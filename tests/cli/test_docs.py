"""The documentation is checked against itself and the code: every relative link of the
README, BENCHMARKS.md and docs/ reaches a file and, where it names one, a heading there;
docs/quantization.md's table of every family against every scheme is the families'
declarations, the README's scheme table names every scheme of the layout contract, and
docs/families.md's table of derived architectures is what the real-vLLM test proves.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from derived_models import PROVEN

from shardprep.format.vllm_layout import RANGES
from shardprep.plan import archs
from shardprep.plan.checks import UNPROVEN
from shardprep.plan.derived import DERIVED

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
QUANTIZATION = ROOT / "docs" / "quantization.md"
FAMILIES = ROOT / "docs" / "families.md"
PAGES = [README, ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^]]*]\(([^)\s]+)\)")
TABLE_HEADING = "## Every family against every scheme"


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as `-`."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"^ {4}.*$", "", page.read_text(), flags=re.M)  # code lines are no headings
    return {slug(h) for h in re.findall(r"^#{1,6} (.*)$", text, re.M)}


def links(page: Path) -> list[str]:
    return [t for t in LINK.findall(page.read_text()) if not re.match(r"[a-z]+:", t)]


def test_slug_is_githubs() -> None:
    assert slug("What `verify --full` replays") == "what-verify---full-replays"
    assert slug("GLM-4.5, 4.6, 4.7 and its MTP draft") == "glm-45-46-47-and-its-mtp-draft"
    assert slug("DeepSeek-V2/V3 (MLA)") == "deepseek-v2v3-mla"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_reaches_its_file_and_heading(page: Path) -> None:
    assert links(README), "the README links to nothing"
    for target in links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        assert file.exists(), f"{page.name}: {target} names no file"
        if anchor:
            assert anchor in anchors(file), f"{page.name}: {target} names no heading"


def test_a_broken_link_is_caught(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## A section\n\n[ok](#a-section) [gone](#no-section)\n")
    assert [t.partition("#")[2] in anchors(page) for t in links(page)] == [True, False]


def contract_schemes() -> set[str]:
    """Every quantization scheme the layout contract keys a revision by."""
    families = {family.name for family in archs.all_families()} | {DERIVED}
    return set(RANGES[-1].revisions) - families


def table_rows(text: str, heading: str) -> list[list[str]]:
    """The cells of the first table under `heading`, header row first."""
    section = text.split(heading, 1)[1]
    section = re.split(r"\n#{1,6} ", section, maxsplit=1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    assert rows, f"no table under {heading!r}"
    return [[c.strip() for c in row.strip("|").split(" | ")] for row in rows if "---" not in row]


def names(cell: str) -> list[str]:
    return re.findall(r"`(\w+)`", cell)


def quantization_table() -> tuple[list[str], dict[str, dict[str, str]], dict[str, str]]:
    """docs/quantization.md's table: its scheme columns, {family: {scheme: cell}} and each
    family's reason for the schemes it refuses."""
    header, *rows = table_rows(QUANTIZATION.read_text(), TABLE_HEADING)
    assert header[0] == "family" and header[-1] == "refused because", header
    schemes = [names(cell)[0] for cell in header[1:-1]]
    cells, reasons = {}, {}
    for row in rows:
        family = names(row[0])[0]
        cells[family] = dict(zip(schemes, row[1:-1], strict=True))
        reasons[family] = row[-1]
    return schemes, cells, reasons


def test_the_quantization_table_has_every_target_family_and_scheme() -> None:
    schemes, cells, _ = quantization_table()
    families = {archs.target_family_of(a).name for a in archs.supported()[0]}
    assert sorted(cells) == sorted(families)
    named = set(schemes) | {n for row in cells.values() for c in row.values() for n in names(c)}
    assert set(schemes) <= contract_schemes()
    assert named & contract_schemes() == contract_schemes()


def test_the_quantization_table_is_what_each_family_declares() -> None:
    _, cells, reasons = quantization_table()
    for architecture in archs.supported()[0]:
        family = archs.target_family_of(architecture)
        for scheme, cell in cells[family.name].items():
            if scheme in family.quant_schemes:
                assert cell.startswith("yes"), (family.name, scheme, cell)
                continue
            assert cell == "refused", (family.name, scheme, cell)
            why = family.quant_refusals.get(scheme) or family.quant_refusals.get("*")
            assert reasons[family.name] == (why or UNPROVEN), family.name


def test_the_readme_names_every_scheme() -> None:
    header, *rows = table_rows(README.read_text(), "### Quantization schemes")
    assert header[0] == "scheme"
    assert sorted(names(row[0])[0] for row in rows) == sorted(contract_schemes())


def test_the_derived_table_names_what_the_vllm_test_proves() -> None:
    """docs/families.md lists as proven exactly the architectures that
    tests/vllm/test_vllm_derived.py proves byte for byte, none of them a family's."""
    header, *rows = table_rows(FAMILIES.read_text(), "Proven against a real vLLM")
    assert header == ["architecture", "what it exercises"]
    documented = sorted(n for row in rows for n in names(row[0]))
    assert documented == sorted({architecture for architecture, _ in PROVEN.values()})
    assert not set(documented) & set(archs.supported()[0])
