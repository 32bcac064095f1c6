"""The front page stays true: its Python snippets run, its links and the docs' links resolve, it stays short."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]


def python_blocks(text: str) -> list[str]:
    """Every fenced ``python`` block (a sketch that is not meant to run is fenced ``text`` or ``diff`` instead)."""
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def anchors(text: str) -> set[str]:
    """The heading anchors GitHub makes: lower case, punctuation dropped, spaces as hyphens."""
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.*)$", text, flags=re.M)}


@pytest.mark.parametrize("index", range(len(python_blocks(README.read_text()))))
def test_readme_snippet_runs(index, tmp_path):
    code = python_blocks(README.read_text())[index]
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, f"snippet {index}:\n{code}\n{result.stderr[-3000:]}"


def test_readme_is_a_front_page():
    text = README.read_text()
    assert len(text.splitlines()) <= 220
    assert len(python_blocks(text)) >= 2  # the one-line use in one's own loop and the built-in trainers
    assert "pip install" in text.split("## Use it in your own loop")[0]  # install comes before the usage


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_resolve(page):
    text = page.read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.exists(), f"{page.name}: {target}"
        if anchor and linked.suffix == ".md":
            assert anchor in anchors(linked.read_text()), f"{page.name}: {target}"
