"""The fenced code blocks of the README and docs/, and how the tests run them.

A block's language says whether it runs:

- ```python blocks run (``RUNS``): in one process, as ``python example.py`` in a fresh
  folder, against this checkout's compshard. A block whose first line is the comment
  ``# torchrun --standalone --nproc-per-node N example.py`` runs under torchrun with N
  processes instead; one that joins the job when launched by torchrun
  (``if "RANK" in os.environ:``) runs both in one process and under torchrun with 2.
  Blocks run with torch's caches on, as a user's do, in a cache folder of their own.
- ```text (output, diagrams) and ```bash (shell commands) blocks are shown, not run
  (``SHOWN``); the README's two commands run in CI (``.ci/run``, checked by
  tests/test_readme.py).

A fence without a language, or with another one, is an error (tests/test_docs.py).

A block that imports transformers or lightning runs after ``tests.real_models``, whose
import lets them load where the installed torchvision's compiled ops do not match torch
(transformers imports torchvision, lightning through torchmetrics; as the real-model and
integration tests do); elsewhere that import changes nothing.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
RUNS = ("python",)
SHOWN = ("text", "bash")
TORCHRUN = re.compile(r"# torchrun --standalone --nproc-per-node (\d+) example\.py")
JOINS_A_JOB = '"RANK" in os.environ'
NEEDS_TORCHVISION_FIX = ("transformers", "lightning")  # libraries that import torchvision


@dataclass(frozen=True)
class Block:
    """One fenced block: where it starts (1-based line of its opening fence), its language
    (the word after the fence, "" for none) and its text."""

    path: pathlib.Path
    line: int
    language: str
    code: str

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    def launches(self) -> list[int]:
        """The process counts this block runs with: 1 means ``python``, more torchrun."""
        marker = TORCHRUN.fullmatch(self.code.split("\n", 1)[0])
        if marker:
            return [int(marker.group(1))]
        return [1, 2] if JOINS_A_JOB in self.code else [1]


def blocks(path: pathlib.Path) -> list[Block]:
    """Every fenced block of the Markdown file ``path``, in order."""
    found, lines = [], path.read_text().split("\n")
    index = 0
    while index < len(lines):
        opening = re.fullmatch(r"```(\S*)\s*", lines[index])
        if opening is None:
            index += 1
            continue
        end = next((i for i in range(index + 1, len(lines)) if lines[i].strip() == "```"), None)
        if end is None:
            raise ValueError(f"{path.relative_to(ROOT)}:{index + 1}: fence never closed")
        found.append(Block(path, index + 1, opening.group(1), "\n".join(lines[index + 1 : end]) + "\n"))
        index = end + 1
    return found


def runnable(paths: list[pathlib.Path]) -> list[Block]:
    return [block for path in paths for block in blocks(path) if block.language in RUNS]


def env(folder: pathlib.Path) -> dict[str, str]:
    """A user's environment: this checkout importable, and torch's caches on as by default
    (the suite turns the AOTAutograd cache off), in a cache folder of the block's own."""
    outer = {key: value for key, value in os.environ.items() if key != "TORCHINDUCTOR_AUTOGRAD_CACHE"}
    return {
        **outer,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "TORCHINDUCTOR_CACHE_DIR": str(folder / "torch_cache"),
    }


def run(block: Block, folder: pathlib.Path, processes: int = 1) -> subprocess.CompletedProcess:
    """Run ``block`` as ``example.py`` in ``folder``: with python, or torchrun with
    ``processes`` processes."""
    script = folder / "example.py"
    fix = any(name in block.code for name in NEEDS_TORCHVISION_FIX)
    script.write_text(("import tests.real_models  # noqa: F401\n" if fix else "") + block.code)
    launcher = (
        [sys.executable]
        if processes == 1
        else [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes)]
    )
    command = [*launcher, str(script)]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=folder, env=env(folder))
