"""The README and docs/ as a reader meets them: short, sentences a reader can hold, every results table made by a
command the page shows, and nothing that only exists on the machine that wrote it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
LONGEST = 40  # words: no sentence reaches it


def prose(text: str) -> str:
    """The text a reader reads as sentences: fenced code and HTML comments gone."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return re.sub(r"<!--.*?-->", "", text, flags=re.S)


def sentences(text: str) -> list[str]:
    """Every sentence: paragraphs, list items and table cells are units; each splits after . ! or ? and a space."""
    units: list[str] = []
    paragraph: list[str] = []
    for line in [*prose(text).splitlines(), ""]:
        stripped = line.strip()
        item = re.match(r"^(?:[-*]|\d+\.)\s+", stripped)
        if not stripped or stripped.startswith(("#", "|")) or item:
            if paragraph:
                units.append(" ".join(paragraph))
                paragraph = []
            if stripped.startswith("|"):
                units += [cell for cell in stripped.strip("|").split("|") if not set(cell.strip()) <= set("-: ")]
            elif stripped.startswith("#"):
                units.append(stripped.lstrip("#"))
            elif item:
                paragraph = [stripped[item.end() :]]
            continue
        paragraph.append(stripped)
    out = []
    for unit in units:
        out += [s for s in re.split(r"(?<=[.!?])\s+(?=[A-Z`(\"'*\[0-9])", unit) if s.strip()]
    return out


def words(sentence: str) -> int:
    return len(sentence.split())


def test_the_sentence_splitter_counts_what_a_reader_reads():
    text = (
        "# Title\n\nOne two three. Four five.\n\n- an item that\n  wraps. Next one.\n\n"
        "| a b | c |\n|---|---|\n\n```\nx y z\n```\n"
    )
    assert [words(s) for s in sentences(text)] == [1, 3, 2, 4, 2, 2, 1]


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: p.name)
def test_no_sentence_reaches_forty_words(path):
    long = [s for s in sentences(path.read_text()) if words(s) >= LONGEST]
    assert not long, f"{path.name}: {len(long)} sentence(s) of {LONGEST}+ words, e.g. {long[0][:300]!r}"


def test_the_readme_is_read_in_five_minutes_and_opens_on_the_launch():
    text = README.read_text()
    assert len(text.split()) < 2000, len(text.split())
    head = "\n".join(text.splitlines()[:150])
    assert "--scheduler rlhfless" in head and "train_ppo_ray" in head  # the OpenRLHF launch
    assert re.search(r"^\| preset \|", head, flags=re.M)  # and the preset table


def test_the_docs_hold_no_machine_local_path():
    """No absolute path and nothing outside the repository, but the project's shared data beside it."""
    for path in [README, *DOCS]:
        text = path.read_text()
        local = re.findall(r"(?<![\w.:/])(?:/(?:tmp|root|home|work|Users|var|opt)\b\S*|~/\S+)", text)
        outside = [m for m in re.findall(r"\.\./\S+", text) if not re.match(r"\.\./shared/data(/|\W|$)", m)]
        assert not local and not outside, f"{path.name}: {local + outside}"


def test_every_link_in_the_docs_reaches_a_file_of_the_repository():
    for path in [README, *DOCS]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            assert (path.parent / target).exists(), f"{path.name} links to {target}, which is not there"
