"""Suite-wide hooks: tests marked ``cuda`` are skipped where torch sees no CUDA GPU, and the
``accelerate_state`` fixture for tests that build an Accelerator with settings of their own."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from accelerate.state import AcceleratorState


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip every ``@pytest.mark.cuda`` test when CUDA is not available (the CPU machines of CI)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture
def accelerate_state() -> Iterator[None]:
    """A fresh accelerate state before the test and after it.

    accelerate keeps one process-wide state: an ``Accelerator(mixed_precision="bf16")`` after another
    test's ``Accelerator()`` raises, and every later ``Accelerator()`` would silently inherit bf16.
    """
    AcceleratorState._reset_state()
    yield
    AcceleratorState._reset_state()
