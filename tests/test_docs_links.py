"""Every link in README.md and docs/*.md points at a file of this repository that exists.

Links to other sites are refused too: the documentation must read the same offline and in a fresh clone. Code blocks
and inline code are not links (a command's output may quote an address).
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import REPO_ROOT

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")


def documents() -> list[Path]:
    return [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]


def link_targets(text: str) -> list[str]:
    """The targets of the Markdown links of ``text``, outside code."""
    return LINK.findall(INLINE_CODE.sub("", FENCE.sub("", text)))


def broken_links(document: Path) -> list[str]:
    """One line per link of ``document`` that leaves the repository or names no existing file."""
    problems = []
    for target in link_targets(document.read_text(encoding="utf-8")):
        where = f"{document.relative_to(REPO_ROOT)}: ({target})"
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith("//"):
            problems.append(f"{where} leaves the repository")
            continue
        path = target.split("#", 1)[0]
        if not path:
            continue  # an anchor in the same document
        resolved = (document.parent / path).resolve()
        if not resolved.is_relative_to(REPO_ROOT):
            problems.append(f"{where} points outside the repository")
        elif not resolved.exists():
            problems.append(f"{where} names a file that does not exist")
    return problems


def test_every_link_of_the_documentation_resolves_inside_the_repository():
    problems = [problem for document in documents() for problem in broken_links(document)]
    assert not problems, "\n".join(problems)


def test_the_readme_links_the_docs_and_the_license():
    targets = {target.split("#", 1)[0] for target in link_targets((REPO_ROOT / "README.md").read_text("utf-8"))}
    assert {"LICENSE", "docs/TRAINING.md", "docs/INFERENCE.md", "docs/RELIABILITY.md"} <= targets


def test_broken_outside_and_code_links_are_told_apart(tmp_path, monkeypatch):
    monkeypatch.setattr("tests.test_docs_links.REPO_ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "A.md").write_text("x\n")
    readme = tmp_path / "README.md"
    readme.write_text(
        "[a](docs/A.md#top) [b](docs/B.md) [c](https://example.org) [d](../outside.md) [e](#here)\n"
        "`[f](docs/F.md)`\n```\n[g](docs/G.md)\n```\n"
    )
    assert broken_links(readme) == [
        "README.md: (docs/B.md) names a file that does not exist",
        "README.md: (https://example.org) leaves the repository",
        "README.md: (../outside.md) points outside the repository",
    ]
