"""Every Python snippet of README.md and docs/*.md runs, so that none goes stale.

A page's snippets run in order, as one script in a fresh process, after the
hidden set-up the page gives in HTML comments (not rendered)::

    <!-- doctest: setup
    model = ...            (run before the snippets that follow it)
    -->

``<!-- doctest: fresh -->`` starts a new process (frameworks keep process-wide
state), which runs the set-up that came before the page's first snippet again.
A snippet preceded by ``<!-- doctest: ranks=N ... -->`` runs on its own under
``torchrun --nproc-per-node N`` (gloo on the CPU), after the code in that
comment; ``<!-- doctest: skip REASON -->`` marks one that cannot run here
(the reason is required).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DIRECTIVE = re.compile(r"<!--\s*doctest:\s*(setup|fresh|ranks=(\d+)|skip)(.*?)-->", re.S)
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
EPILOGUE = """
import torch.distributed as _dist
if _dist.is_initialized():
    _dist.barrier()
    _dist.destroy_process_group()
from accumkernels.testing import exit_skipping_teardown
exit_skipping_teardown(0)
"""


@dataclass
class Snippet:
    code: str
    ranks: int = 1  # > 1: a torchrun script of its own
    setup: str = ""  # the code of its ranks= comment
    skip: str | None = None
    line: int = 0


def parse(page: Path) -> tuple[list[str], list[Snippet]]:
    """(the page's single-process scripts, its multi-rank snippets); every
    Python block is accounted for: run, or skipped with a reason."""
    text = page.read_text()
    events = sorted(
        [(m.start(), "directive", m) for m in DIRECTIVE.finditer(text)]
        + [(m.start(), "code", m) for m in FENCE.finditer(text)],
        key=lambda e: e[0],
    )
    prelude, scripts, multi, pending, seen_code = [], [[]], [], None, False
    for start, kind, m in events:
        line = text.count("\n", 0, start) + 1
        if kind == "directive":
            if m.group(1) == "setup":
                piece = f"# {page.name}:{line} (set-up)\n{m.group(3).strip()}\n"
                (scripts[-1] if seen_code else prelude).append(piece)
            elif m.group(1) == "fresh":
                scripts.append([])
            else:
                pending = m
            continue
        seen_code = True
        snippet = Snippet(m.group(1), line=line)
        if pending is not None:
            if pending.group(1) == "skip":
                snippet.skip = pending.group(3).strip()
                assert snippet.skip, f"{page.name}:{line}: doctest: skip needs a reason"
            else:
                snippet.ranks, snippet.setup = int(pending.group(2)), pending.group(3).strip()
            pending = None
        if snippet.skip is None and snippet.ranks == 1:
            scripts[-1].append(f"# {page.name}:{line}\n{snippet.code}")
        elif snippet.skip is None:
            multi.append(snippet)
    return ["\n".join(prelude + s) for s in scripts if s], multi


CASES = []
for page in PAGES:
    singles, multi = parse(page)
    name = page.relative_to(ROOT).as_posix()
    CASES += [pytest.param(page, ("single", i), id=f"{name}" + (f"#{i + 1}" if i else "")) for i in range(len(singles))]
    # torchrun snippets start several processes each: with the slow tests.
    CASES += [
        pytest.param(page, ("ranks", i), id=f"{name}:{s.line}", marks=pytest.mark.slow) for i, s in enumerate(multi)
    ]


def _env() -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    for key in ("TRITON_INTERPRET", "PYTEST_XDIST_WORKER"):
        env.pop(key, None)
    return env


@pytest.mark.parametrize("page,index", CASES)
def test_snippets_run(tmp_path, page, index):
    singles, multi = parse(page)
    kind, i = index
    if kind == "single":
        script, command = singles[i], [sys.executable]
    else:
        snippet = multi[i]
        script = f"{snippet.setup}\n# {page.name}:{snippet.line}\n{snippet.code}{EPILOGUE}"
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={snippet.ranks}", "--standalone"]
    path = tmp_path / "snippets.py"
    path.write_text(script)
    out = subprocess.run([*command, str(path)], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"{page.name}: the snippets failed\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"


def test_every_page_has_run_snippets():
    """A page of docs whose Python snippets are all skipped (or has none) is named here."""
    for page in PAGES:
        text = page.read_text()
        if FENCE.search(text):
            singles, multi = parse(page)
            assert singles or multi, f"{page.name}: no snippet runs"


LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_relative_link_resolves():
    """Every link of the README and the docs to a file of the repository names a file
    that exists, and its #anchor a heading of that page."""
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and file.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", file.read_text(), re.M)
                if anchor not in {_anchor(h) for h in headings}:
                    broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)
