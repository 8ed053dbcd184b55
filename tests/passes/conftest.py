"""The fake process group the per-pass tests run in (``graphs.fake_world``): one per
test module that asks for it with ``pytestmark = pytest.mark.usefixtures("world")``, so
no process group outlives the module (other test modules make their own)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.passes.graphs import fake_world


@pytest.fixture(scope="module")
def world() -> Iterator[str]:
    """The name of the fake world's process group."""
    with fake_world() as group_name:
        yield group_name
