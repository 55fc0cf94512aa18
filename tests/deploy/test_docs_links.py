"""Every link of the README and of docs/*.md stays inside the repository and points at something there.

A markdown link or image target that is not a web address (http, https) or an anchor (#...) must
name an existing file or folder of the checkout, relative to the document, without leaving the
repository root (the docs ship with the code: a link to a sibling checkout or a local path works on
one machine only).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# [text](target "title") and ![alt](target); reference definitions [label]: target
INLINE = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")


def documents() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def link_targets(text: str) -> list[str]:
    text = INLINE_CODE.sub("", FENCE.sub("", text))  # links inside code are not links
    return INLINE.findall(text) + REFERENCE.findall(text)


def escaping_code_paths(text: str) -> list[str]:
    """Paths quoted as code that climb out of the document's folder (`../...`): they are references too."""
    spans = INLINE_CODE.findall(FENCE.sub("", text))
    return [span.strip("`") for span in spans if re.fullmatch(r"`(\.\./)+[^`\s]+`", span)]


def bad_links(text: str, base: Path) -> list[str]:
    """The link targets of a document in folder ``base`` that do not resolve inside the repository, and the
    ``../`` paths it quotes as code that leave it."""
    bad = [
        f"{p} (leaves the repository)"
        for p in escaping_code_paths(text)
        if not (base / p).resolve().is_relative_to(REPO)
    ]
    for target in link_targets(text):
        if re.match(r"(?i)https?://", target) or target.startswith("#"):
            continue
        if re.match(r"(?i)[a-z][a-z0-9+.-]*:", target):  # mailto:, file:, ...: not a repository path
            bad.append(f"{target} (not a path in the repository)")
            continue
        path = target.split("#", 1)[0].split("?", 1)[0]
        if path.startswith("/"):
            bad.append(f"{target} (absolute path)")
            continue
        resolved = (base / path).resolve()
        if not resolved.is_relative_to(REPO):
            bad.append(f"{target} (leaves the repository)")
        elif not resolved.exists():
            bad.append(f"{target} (no such file)")
    return bad


@pytest.mark.parametrize("doc", documents(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_resolves_inside_the_repository(doc: Path) -> None:
    bad = bad_links(doc.read_text(encoding="utf-8"), doc.parent)
    assert not bad, f"{doc.relative_to(REPO)} has links that do not resolve inside the repository:\n  " + "\n  ".join(
        bad
    )


def test_the_docs_exist_and_are_linked_from_the_readme() -> None:
    names = {p.name for p in documents()[1:]}
    assert {
        "architecture.md",
        "exactness.md",
        "configuration.md",
        "deployment.md",
        "gguf-and-kernels.md",
        "performance.md",
    } <= names
    readme_targets = set(link_targets((REPO / "README.md").read_text(encoding="utf-8")))
    missing = sorted(f"docs/{n}" for n in names if f"docs/{n}" not in readme_targets)
    assert not missing, f"README.md does not link {missing}"


def test_the_check_catches_links_that_leave_or_miss() -> None:
    text = (
        "The rules are in [spec-math](../../spec-math.md) and [gone](nothing.md);\n"
        "[ok](#anchor), [web](https://example.com), [here](architecture.md#layers), `[code](x.md)`,\n"
        "![figure](figures/default-throughput.png), [abs](/etc/passwd).\n\n```\n[fenced](../../x.md)\n```\n"
    )
    assert bad_links(text, REPO / "docs") == [
        "../../spec-math.md (leaves the repository)",
        "nothing.md (no such file)",
        "/etc/passwd (absolute path)",
    ]


def test_the_old_readme_fails() -> None:
    """The README once sent readers to the correctness contract in a sibling checkout: that link fails."""
    old = (
        "Documentation: [docs/architecture.md](docs/architecture.md) and [docs/spec-math.md](docs/spec-math.md).\n"
        "The rules are in `../shared/docs/spec-math.md` (from the project's seed documents).\n"
    )
    assert bad_links(old, REPO) == [
        "../shared/docs/spec-math.md (leaves the repository)",
        "docs/spec-math.md (no such file)",
    ]
