"""Rules that describe a good design (``design_rules.py`` measures them; ``python tests/design_rules.py`` prints
them): no function over 60 lines, no class over 20 instance attributes, fewer than 10 pairs of files that share a
block of six lines of the same shape. A place that breaks a rule on purpose says why in a ``# design:`` comment.
"""

from __future__ import annotations

import rlhfless_test_helpers as H  # registered by conftest.py

rules = H.sibling("design_rules")  # ``tests`` is no package

#: Pairs of files sharing a block of six lines of the same shape: fewer than this.
MOST_REPEATED = 10


def _breaking(places: list[rules.Place], limit: int) -> set[str]:
    return {f"{p.path}:{p.name}" for p in places if p.size > limit and p.why is None}


def test_no_function_is_longer_than_60_lines():
    functions, _ = rules.measures()
    long = _breaking(functions, rules.LONGEST_FUNCTION)
    assert long == set(), "split by what it does, or say why in a '# design:' comment"


def test_no_class_holds_more_than_20_instance_attributes():
    _, classes = rules.measures()
    wide = _breaking(classes, rules.MOST_ATTRIBUTES)
    assert wide == set(), "split by what it holds, or say why in a '# design:' comment"


def test_fewer_than_10_pairs_of_files_repeat_a_block_of_code():
    pairs = rules.repeated_blocks()
    where = [f"{a}:{starts[0][0]} ~ {b}:{starts[0][1]}" for (a, b), starts in sorted(pairs.items())]
    assert len(pairs) < MOST_REPEATED, where


def test_the_measures_see_a_long_function_a_wide_class_and_a_repeated_block(tmp_path, monkeypatch):
    """The measures themselves, on a package made for it: a 61-line function, a class of 21 attributes (one of them
    marked as broken on purpose), and one block written twice with other names."""
    package = tmp_path / "pkg"
    package.mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(59))
    attrs = "".join(f"        self.a{i} = {i}\n" for i in range(21))
    block = "def {f}(a, b):\n    c = a + b\n    d = c * 2\n    e = d - a\n    f = e / b\n    g = f + c\n    return g\n"
    (package / "m.py").write_text(
        f"def long():\n{body}    return 0\n\n\nclass Wide:\n    def __init__(self):\n{attrs}\n\n"
        f"class Marked:  # design: a record of 21 fields\n    def __init__(self):\n{attrs}\n\n"
        + block.format(f="one")
        + "\n\n"
        + block.format(f="two").replace("a", "p").replace("b", "q")
    )
    monkeypatch.setattr(rules, "ROOT", tmp_path)
    monkeypatch.setattr(rules, "PACKAGES", ("pkg",))
    functions, classes = rules.measures()
    assert _breaking(functions, rules.LONGEST_FUNCTION) == {"pkg/m.py:long"}
    assert _breaking(classes, rules.MOST_ATTRIBUTES) == {"pkg/m.py:Wide"}
    assert [c.why for c in classes if c.name == "Marked"] == ["a record of 21 fields"]
    assert list(rules.repeated_blocks()) == [("pkg/m.py", "pkg/m.py")]
