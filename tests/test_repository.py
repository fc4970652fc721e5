"""The repository holds the project's own files: text everywhere but docs/, nothing over 1 MB, no image no page
shows."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LARGEST = 1 << 20  # bytes


def tracked() -> list[Path]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [ROOT / name for name in out.decode().split("\0") if name and (ROOT / name).is_file()]


def is_binary(path: Path) -> bool:
    return b"\0" in path.read_bytes()[:8192]


def test_no_tracked_file_is_binary_outside_docs_or_over_a_megabyte():
    large = [f"{p.relative_to(ROOT)} ({p.stat().st_size:,} bytes)" for p in tracked() if p.stat().st_size > LARGEST]
    binary = [str(p.relative_to(ROOT)) for p in tracked() if is_binary(p) and p.parent != ROOT / "docs"]
    assert not large, f"tracked files over {LARGEST:,} bytes: {large}"
    assert not binary, f"tracked binary files outside docs/: {binary}"


def test_every_image_in_docs_is_shown_by_a_page():
    pages = "\n".join(p.read_text() for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
    shown = {Path(m).name for m in re.findall(r"\]\(([^)\s]+\.(?:png|svg|jpg))\)", pages)}
    images = [p.name for p in tracked() if p.parent == ROOT / "docs" and p.suffix in (".png", ".svg", ".jpg")]
    unshown = [name for name in images if name not in shown]
    assert not unshown, f"images in docs/ that no page links: {unshown}"


def test_the_checks_see_a_binary_and_a_large_file(tmp_path):
    """The two predicates themselves: a NUL byte is binary, text is not; the size check counts bytes."""
    (tmp_path / "a.whl").write_bytes(b"PK\x03\x04\0\0")
    (tmp_path / "a.py").write_text("print('x')\n")
    assert is_binary(tmp_path / "a.whl") and not is_binary(tmp_path / "a.py")
