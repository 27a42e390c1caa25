"""GPU suite setup: with pytest-xdist's workers sharing one GPU, each worker hands torch's cached blocks
back after every test, so memory one worker freed is there for the others (on an H200 ten workers that
kept their caches ran the GPU out of memory, and the fuzzer's process then saw sticky launch errors)."""

import gc
import os
import sys

import pytest


@pytest.fixture(autouse=True)
def _return_cached_gpu_memory():
    yield
    torch = sys.modules.get("torch")  # never imported here: the torch-blocked JAX tests must not see it
    if os.environ.get("PYTEST_XDIST_WORKER") and torch is not None and torch.cuda.is_initialized():
        gc.collect()
        torch.cuda.empty_cache()


# The longest tests (the fuzzer's shards, the JAX suite in a torch-blocked process) go out to the workers
# first, so the others fill in around them and the whole suite ends within one device call.
LONGEST_FIRST = ("test_fuzz_through_the_selection_on_cuda", "test_the_jax_gpu_suite_passes_with_torch_blocked")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: getattr(item, "originalname", item.name) not in LONGEST_FIRST)
