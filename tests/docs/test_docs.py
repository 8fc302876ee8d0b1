"""The README and the docs/ pages say what is true: their code runs, their links resolve, the README stays short.

* Every fenced block marked ``python`` in README.md and docs/*.md runs as written: the blocks of one page run in
  order in one fresh namespace (as a reader pastes them into one session), in a temporary working folder.
  Fragments that need the reader's own model, data or several processes are marked ``py`` and are not run
  (docs/index.md states the convention).
* Every relative link (``[text](path#anchor)``) names a file that exists and, with an anchor, a heading of it.
* docs/index.md lists every page in docs/.
* The README is at most ~10 KB, and its test command is exactly the one ``.ci/run`` runs, which collects the
  docstring examples of functrain/ as doctests (pyproject.toml).
"""
from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_BYTES = 10_240

_FENCE = re.compile(r"^(?P<indent> *)```(?P<info>[^`\s]*)[^`]*$")
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\((?P<target>[^)\s]+)\)")


def blocks(text: str) -> list[tuple[str, int, str]]:
    """``(info string, first line number, code)`` of every fenced block of a markdown text."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        info, start, body = m.group("info"), i + 1, []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith("```"):
            body.append(lines[i])
            i += 1
        if i == len(lines):
            raise AssertionError(f"an unclosed ``` block starts at line {start}")
        out.append((info, start + 1, "\n".join(body) + "\n"))
        i += 1
    return out


def slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|__", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: pathlib.Path) -> set[str]:
    text = path.read_text(encoding="utf-8")
    inside = {line for _, start, code in blocks(text) for line in range(start, start + code.count("\n"))}
    return {slug(line.lstrip("#")) for n, line in enumerate(text.splitlines(), 1)
            if line.startswith("#") and n not in inside}


def runnable(path: pathlib.Path) -> list[tuple[int, str]]:
    return [(start, code) for info, start, code in blocks(path.read_text(encoding="utf-8")) if info == "python"]


@pytest.mark.parametrize("page", [p for p in PAGES if runnable(p)], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_python_blocks_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a block that writes files writes them here
    namespace: dict = {"__name__": "__docs__"}
    for start, code in runnable(page):
        try:
            exec(compile(code, f"{page.relative_to(ROOT)}:{start}", "exec"), namespace)
        except Exception as error:
            raise AssertionError(f"{page.relative_to(ROOT)}: the python block at line {start} raised "
                                 f"{type(error).__name__}: {error}") from error


def test_readme_has_a_runnable_step():
    code = "".join(code for _, code in runnable(ROOT / "README.md"))
    for name in ("ft.functionalize", "ft.train_step", "ft.compile", "ft.run"):
        assert name in code, f"README.md's python blocks do not use {name}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page):
    text = page.read_text(encoding="utf-8")
    code_lines = {line for _, start, code in blocks(text) for line in range(start, start + code.count("\n"))}
    bad = []
    for n, line in enumerate(text.splitlines(), 1):
        if n in code_lines:
            continue
        for m in _LINK.finditer(line):
            target = m.group("target")
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            where = (page.parent / file).resolve() if file else page
            if not where.exists():
                bad.append(f"line {n}: {target} (no file {where.relative_to(ROOT) if ROOT in where.parents else where})")
            elif anchor and where.suffix == ".md" and anchor not in anchors(where):
                bad.append(f"line {n}: {target} (no heading #{anchor} in {where.relative_to(ROOT)})")
    assert not bad, f"{page.relative_to(ROOT)} has broken links:\n" + "\n".join(bad)


def test_index_lists_every_page():
    index = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    linked = {m.group("target").partition("#")[0] for m in _LINK.finditer(index)}
    missing = sorted(p.name for p in (ROOT / "docs").glob("*.md") if p.name != "index.md" and p.name not in linked)
    assert not missing, f"docs/index.md does not link {missing}"


def test_readme_is_short():
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_MAX_BYTES, (f"README.md is {size} bytes; keep it under {README_MAX_BYTES} (a newcomer's "
                                      f"five minutes) and move reference text into docs/")


def test_readme_test_command_is_ci():
    # the suite's run on the README's python (the second half of .ci/run runs a subset in a venv of its own)
    runs = [line.strip() for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
            if line.strip().startswith("python3 -m pytest")]
    assert len(runs) == 1, runs
    ci = runs[0]
    readme_sh = [code for info, _, code in blocks((ROOT / "README.md").read_text(encoding="utf-8"))
                 if info in ("sh", "bash", "console")]
    assert any(line.strip() == ci for code in readme_sh for line in code.splitlines()), \
        f"README.md's shell blocks do not contain CI's test command {ci!r}"


def test_the_test_command_runs_the_doctests():
    import tomllib

    options = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["pytest"]["ini_options"]
    assert "functrain" in options["testpaths"] and "tests" in options["testpaths"], options["testpaths"]
    assert "--doctest-modules" in options.get("addopts", "").split(), options.get("addopts")
