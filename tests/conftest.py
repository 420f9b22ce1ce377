"""Shared test set-up.

Fake CPU devices must be requested before JAX initializes, so this runs first. The
transformers reference lives in a separate Python 3.11 venv (.venv-ref, built by
launch/env.sh); `reference` runs scripts there.
"""

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pathlib  # noqa: E402

import pytest  # noqa: E402

from tests.reference_env import Reference  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def reference() -> Reference:
    ref = Reference.find(ROOT)
    if ref is None:
        msg = "transformers reference venv (.venv-ref) not found; run `AREAL_WITH_REFERENCE=1 source launch/env.sh`"
        if os.environ.get("AREAL_REQUIRE_REFERENCE") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    return ref


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs_after_each_module():
    """The default suite runs ~1,700 tests in one process, each module compiling its own programs;
    dropping a finished module's executables keeps the process's memory flat instead of growing to
    the end (a late XLA compile crashed once in a long CI run)."""
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()
