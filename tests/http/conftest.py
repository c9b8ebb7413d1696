from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.http.harness import Stack, make_model_dir, stack


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def live(model_dir: Path) -> Iterator[Stack]:
    """One daemon + sim worker + front end shared by a module's tests (their counts are
    compared before and after, never absolute)."""
    with stack(model_dir, worker_args=("--served-model-name", "tiny")) as s:
        yield s
