"""The docs as a user meets them: every python block of docs/*.md runs as written (the
README's run in tests/test_readme.py; which fences run: tests/doc_blocks.py), every
local link and anchor of the README, docs/, the benchmark reports and the changelog
resolves, and docs/api.md's tables match the functions' signatures and the fields of
``compshard.CompileOptions``: names, order, defaults, and the allowed values where the code
spells them (a ``Literal`` annotation, or a registry: :data:`CHOICES`)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import pathlib
import re
import typing
import unicodedata

import pytest

import compshard
from compshard.pipelining.runner import SCHEDULES
from compshard.predict.hardware import PRESETS
from compshard.sharding import STRATEGIES
from tests.doc_blocks import DOCS, README, ROOT, RUNS, SHOWN, blocks, run, runnable

API = ROOT / "docs" / "api.md"
PAGES = [README, *DOCS, ROOT / "CHANGELOG.md", *sorted((ROOT / "benchmarks" / "results").glob("*.md"))]

# Blocks another test runs and checks, by a text the block holds -> that test: the pipeline
# example inside tests/pipelining/test_pipeline.py's 2- and 4-rank spawn, the gradient accumulation
# example in tests/test_training_features.py's process.
RUN_ELSEWHERE = {
    "compshard.pipeline(": ROOT / "tests" / "pipelining" / "test_pipeline.py",
    "compshard.no_sync(model):  # no gradient communication here": ROOT / "tests" / "test_training_features.py",
}


def _elsewhere(code: str) -> pathlib.Path | None:
    return next((test for text, test in RUN_ELSEWHERE.items() if text in code), None)


CASES = [
    pytest.param(block, processes, id=f"{block.name}-{processes}")
    for block in runnable(DOCS)
    if _elsewhere(block.code) is None
    for processes in block.launches()
]


@pytest.mark.parametrize("block, processes", CASES)
def test_docs_examples_run(tmp_path, block, processes):
    done = run(block, tmp_path, processes)
    assert done.returncode == 0, f"{block.name}:\n{done.stderr[-3000:]}"


def test_examples_run_elsewhere_are_read_there():
    for block in runnable(DOCS):
        test = _elsewhere(block.code)
        if test is not None:
            assert str(block.path.relative_to(ROOT)) in test.read_text(), f"{test.name} does not read {block.name}"


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_fence_says_whether_it_runs(page):
    unknown = [f"{b.name}: ```{b.language}" for b in blocks(page) if b.language not in RUNS + SHOWN]
    assert not unknown, f"fences must be one of {RUNS + SHOWN}: {unknown}"


# ------------------------------------------------------------------------------ links


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip().lower())
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return kept.replace(" ", "-")


def anchors(page: pathlib.Path) -> set[str]:
    """The anchors of ``page``'s headings (repeated headings get -1, -2, ... as on GitHub)."""
    fenced = {line for b in blocks(page) for line in range(b.line, b.line + b.code.count("\n") + 2)}
    seen: dict[str, int] = {}
    found = set()
    for number, line in enumerate(page.read_text().split("\n"), 1):
        heading = re.match(r"#{1,6} (.+)", line)
        if heading and number not in fenced:
            base = slug(heading.group(1))
            found.add(f"{base}-{seen[base]}" if base in seen else base)
            seen[base] = seen.get(base, 0) + 1
    return found


def links(page: pathlib.Path) -> list[tuple[int, str]]:
    """(line, target) of every Markdown link outside code blocks and code spans."""
    fenced = {line for b in blocks(page) for line in range(b.line, b.line + b.code.count("\n") + 2)}
    found = []
    for number, line in enumerate(page.read_text().split("\n"), 1):
        if number in fenced:
            continue
        for target in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"`[^`]*`", "", line)):
            found.append((number, target))
    return found


@pytest.mark.parametrize("page", [p for p in PAGES if p.exists()], ids=lambda p: str(p.relative_to(ROOT)))
def test_local_links_and_anchors_resolve(page):
    broken = []
    for number, target in links(page):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"line {number}: {target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"line {number}: {target} (no heading with that anchor)")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_slug_matches_githubs_rule():
    assert slug("Checkpoints and gradient clipping") == "checkpoints-and-gradient-clipping"
    assert slug("`compshard.shard`") == "compshardshard"
    assert slug("Plan at scale (fake process group)") == "plan-at-scale-fake-process-group"


# ------------------------------------------------------------------- options and API

NOT_DOCUMENTED = {"compshard_backend"}  # what torch.compile(backend="compshard") calls; not called by users
DEPRECATED = {"plan"}  # old names that warn and forward; api.md names them in a sentence, not a table
FUNCTIONS = {
    **{
        f"compshard.{name}": getattr(compshard, name)
        for name in compshard.__all__
        if inspect.isfunction(getattr(compshard, name)) and name not in NOT_DOCUMENTED | DEPRECATED
    },
    **{
        f"compshard.checkpoint.{name}": getattr(compshard.checkpoint, name)
        for name in ("save", "load", "get_full_state_dict", "set_full_state_dict")
    },
    "compshard.AdaScale": compshard.AdaScale,  # a class: its constructor's parameters
}
REQUIRED = "required"


def api_rows() -> dict[str, list[tuple[str, str, str]]]:
    """docs/api.md's tables by the name in their header (`` `compshard.shard` parameter``):
    (name, default, meaning) per row, backticks removed from the name and the default."""
    tables: dict[str, list[tuple[str, str, str]]] = {}
    current = None
    for line in API.read_text().split("\n"):
        header = re.fullmatch(r"\| `([\w.]+)` (?:parameter|option) \| default \|.*", line)
        if header:
            current = tables.setdefault(header.group(1), [])
        elif current is not None and line.startswith("|"):
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            if not set(cells[0]) <= set("-"):
                current.append((cells[0].strip("`"), cells[1].strip("`"), "|".join(cells[2:])))
        else:
            current = None
    return tables


def api_tables() -> dict[str, list[tuple[str, str]]]:
    """(name, default) per row of each of docs/api.md's tables."""
    return {table: [(name, default) for name, default, _ in rows] for table, rows in api_rows().items()}


def documented(default: object) -> str:
    """How the page writes a default: ``required`` where there is none."""
    return REQUIRED if default is inspect.Parameter.empty else repr(default)


def same_default(written: str, default: object) -> bool:
    if default is inspect.Parameter.empty:
        return written == REQUIRED
    try:
        return ast.literal_eval(written) == default
    except (ValueError, SyntaxError):
        return False


def signature_rows(function) -> list[tuple[str, object]]:
    rows = []
    for parameter in inspect.signature(function).parameters.values():
        star = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}.get(parameter.kind, "")
        rows.append((star + parameter.name, None if star else parameter.default))
    return rows


def test_api_documents_every_public_function():
    assert "compshard.shard" in FUNCTIONS and "compshard.checkpoint.save" in FUNCTIONS
    assert set(api_tables()) == {*FUNCTIONS, "compshard.CompileOptions"}


@pytest.mark.parametrize("name", sorted(DEPRECATED))
def test_api_names_each_deprecated_function(name):
    deprecated = API.read_text().split("Deprecated names", 1)[1].split("\n- ", 1)[0]
    assert f"`compshard.{name}`" in deprecated


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_api_table_matches_the_signature(name):
    written = api_tables()[name]
    expected = signature_rows(FUNCTIONS[name])
    assert [n for n, _ in written] == [n for n, _ in expected], f"{name}: parameters in docs/api.md"
    for (parameter, text), (_, default) in zip(written, expected):
        if default is None and parameter.startswith("*"):
            assert text == "", f"{name}: {parameter} has no default"
        else:
            assert same_default(text, default), f"{name}: {parameter} default is {documented(default)}, docs say {text}"


def test_api_options_table_matches_compile_options():
    written = api_tables()["compshard.CompileOptions"]
    fields = dataclasses.fields(compshard.CompileOptions)
    assert [n for n, _ in written] == [f.name for f in fields], "options in docs/api.md"
    for (option, text), field in zip(written, fields):
        assert same_default(text, field.default), f"option {option}: default is {field.default!r}, docs say {text}"


# Allowed values the code keeps outside the annotation (a plain ``str`` there), or in a
# tuple the function checks against: (table, row) -> the values.
CHOICES: dict[tuple[str, str], tuple[str, ...]] = {
    ("compshard.shard", "strategy"): STRATEGIES,
    ("compshard.pipeline", "schedule"): tuple(SCHEDULES),
    ("compshard.forecast", "hardware"): (*PRESETS, "measured"),
}


def literal_strings(annotation: object) -> tuple[str, ...]:
    """The strings of every ``Literal`` in ``annotation`` (through unions), in order."""
    if typing.get_origin(annotation) is typing.Literal:
        return tuple(arg for arg in typing.get_args(annotation) if isinstance(arg, str))
    return tuple(value for arg in typing.get_args(annotation) for value in literal_strings(arg))


def code_choices() -> dict[tuple[str, str], tuple[str, ...]]:
    """(table, row) -> the string values the code allows there, for every row that has some."""
    annotated = {name: typing.get_type_hints(function) for name, function in FUNCTIONS.items()}
    annotated["compshard.CompileOptions"] = typing.get_type_hints(compshard.CompileOptions)
    found = {
        (table, row): literal_strings(annotation)
        for table, hints in annotated.items()
        for row, annotation in hints.items()
        if literal_strings(annotation)
    }
    return found | CHOICES


def quoted_values(meaning: str) -> list[str]:
    """The string values a meaning cell writes (`` `"fx"` ``; not lists, dicts or patterns)."""
    return re.findall(r'`"([^"`]*)"`', meaning)


def choice_errors(meaning: str, allowed: tuple[str, ...]) -> list[str]:
    """What a row's meaning gets wrong about the ``allowed`` values: one it leaves out, or
    one it lists that the code does not allow."""
    written = quoted_values(meaning)
    missing = [f"{value!r} not listed" for value in allowed if value not in written]
    return missing + [f"{value!r} listed, not allowed" for value in written if value not in allowed]


def test_api_tables_list_the_allowed_values():
    rows = {(table, name): meaning for table, table_rows in api_rows().items() for name, _, meaning in table_rows}
    choices = code_choices()
    assert ("compshard.forecast", "depth") in choices and ("compshard.CompileOptions", "codegen") in choices
    for key, allowed in choices.items():
        assert key in rows, f"{key}: no row in docs/api.md"
        assert not choice_errors(rows[key], allowed), f"{key}: {choice_errors(rows[key], allowed)}"


def test_the_api_checks_can_fail():
    assert not same_default('"fx"', "auto") and not same_default("required", None)
    assert same_default("32", 32.0) and same_default("required", inspect.Parameter.empty)
    assert choice_errors('`"auto"` or `"exact"`', ("auto", "exact", "extrapolate")) == ["'extrapolate' not listed"]
    assert choice_errors('`"auto"`, `"bogus"` (`["a", "b"]`)', ("auto",)) == ["'bogus' listed, not allowed"]
    assert not choice_errors('`"fx"` (Python) or `"auto"`', ("auto", "fx"))
    assert literal_strings(typing.Literal["a", "b"] | int | None) == ("a", "b")
