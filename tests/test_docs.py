"""The documentation: README's contract, the mkdocs site, and the paths and modules the docs name.

- README.md stays short (at most 15 KiB) and its first fenced code block is exactly the two
  commands `make run` and `make test` with their comments.
- docs/index.md, the site's home page, is README.md with its links into docs/ made relative
  (`](docs/cli.md)` -> `](cli.md)`), so the two never drift apart.
- `python -m mkdocs build --strict` (mkdocs.yml at the repository root, the API reference from
  the docstrings through mkdocstrings) builds without a warning.
- Every source path (`cnr/write/writer.py`, `readers/tier.py`, `tests/test_publish.py`, ...)
  and every backticked dotted name under `cnr.` (`cnr.format.catalog.resolve_chain`) that
  README.md or docs/*.md mention exists, checked on disk without importing anything, so a
  module moved or renamed without its docs fails here.
"""

import re
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOC_FILES = [README] + sorted((ROOT / "docs").glob("*.md"))

# Folders installed under the package name, besides cnr/ itself (pyproject.toml's package-dir).
PACKAGE_DIRS = {"cnr": ROOT / "cnr", "cnr.models": ROOT / "models", "cnr.readers": ROOT / "readers"}

PATH_RE = re.compile(r"(?<![\w./-])((?:cnr|readers|models|tests|examples|scripts)/[\w/.-]*\w\.(?:py|yaml|sh))\b")
DOTTED_RE = re.compile(r"`(cnr(?:\.\w+)+)")


def _first_fenced_block(text: str) -> str:
    match = re.search(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M)
    assert match, "README.md has no fenced code block"
    return match.group(1)


def test_the_site_home_page_is_the_readme():
    home = README.read_text().replace("](docs/", "](")
    assert (ROOT / "docs" / "index.md").read_text() == home, (
        "docs/index.md differs from README.md: regenerate it with sed 's/](docs\\//](/g' README.md > docs/index.md")


def test_readme_is_short_and_starts_with_the_two_commands():
    size = README.stat().st_size
    assert size <= 15 * 1024, f"README.md is {size} bytes, more than 15 KiB: move detail into docs/"
    lines = [line.strip() for line in _first_fenced_block(README.read_text()).splitlines() if line.strip()]
    assert len(lines) == 2, lines
    assert re.match(r"make run\s+# \S", lines[0]), lines[0]
    assert re.match(r"make test\s+# \S", lines[1]), lines[1]


def test_mkdocs_build_is_strict_clean(tmp_path):
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(site)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    assert "WARNING" not in proc.stderr, proc.stderr[-8000:]
    assert (site / "index.html").is_file()
    reference = (site / "reference" / "index.html").read_text()
    for name in ("cnr.api.Checkpointer", "cnr.options.CheckpointOptions", "cnr.restore.load.load_state_dict",
                 "cnr.publish.subscriber.Subscriber", "cnr.errors.CheckpointError", "cnr.types.CheckpointInfo"):
        assert f'id="{name}"' in reference, f"the API reference lacks {name}"


def _module_file(parts: list) -> tuple:
    """The longest prefix of `parts` that is a module or package on disk, and the rest."""
    base = None
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in PACKAGE_DIRS:
            base, used = PACKAGE_DIRS[prefix], n
            break
    assert base is not None, parts
    current = base / "__init__.py"
    folder = base
    for i in range(used, len(parts)):
        if (folder / parts[i]).is_dir() and (folder / parts[i] / "__init__.py").is_file():
            folder = folder / parts[i]
            current = folder / "__init__.py"
        elif (folder / f"{parts[i]}.py").is_file():
            return folder / f"{parts[i]}.py", parts[i + 1:]
        else:
            return current, parts[i:]
    return current, []


def _mentions():
    for doc in DOC_FILES:
        text = doc.read_text()
        for number, line in enumerate(text.splitlines(), 1):
            for match in PATH_RE.finditer(line):
                yield doc, number, "path", match.group(1)
            for match in DOTTED_RE.finditer(line):
                yield doc, number, "name", match.group(1)


def test_every_path_and_module_the_docs_name_exists():
    missing = []
    for doc, number, kind, name in _mentions():
        where = f"{doc.relative_to(ROOT)}:{number}: {name}"
        if kind == "path":
            if not (ROOT / name).is_file():
                missing.append(where)
            continue
        module, rest = _module_file(name.split("."))
        if rest:  # the first name after the module must be defined (or exported) there
            source = module.read_text()
            if not re.search(rf"\b{re.escape(rest[0])}\b", source):
                missing.append(f"{where} ({rest[0]!r} not in {module.relative_to(ROOT)})")
    assert not missing, "docs name paths or modules that do not exist:\n" + "\n".join(missing)


def test_the_path_check_catches_a_stale_name():
    assert not (ROOT / "cnr/upload.py").is_file()
    module, rest = _module_file("cnr.upload.Writer".split("."))
    assert module == ROOT / "cnr" / "__init__.py" and rest == ["upload", "Writer"]
    assert not re.search(r"\bupload\b", module.read_text())
    assert PATH_RE.search("see `cnr/write/writer.py`").group(1) == "cnr/write/writer.py"
    assert DOTTED_RE.search("`cnr.format.catalog.resolve_chain`").group(1) == "cnr.format.catalog.resolve_chain"
