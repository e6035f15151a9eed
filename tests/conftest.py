import os
import warnings

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", derandomize=True, deadline=None, max_examples=25,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", deadline=None, max_examples=100, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    """Each failure's traceback as it happens, appended to $SAGE_TEST_FAILURES where set (bench/gpu_run.sh: a run
    cut by a device call's time limit keeps them; pytest prints them only at its end). Under xdist the controller
    writes them (a worker's reports reach it too)."""
    path = os.environ.get("SAGE_TEST_FAILURES")
    if path and report.failed and "PYTEST_XDIST_WORKER" not in os.environ:
        with open(path, "a") as f:
            f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    from sage_compile.numerics import notices

    notices._warned.clear()  # each test sees its own once-per-reason warnings
    from sage_compile.kernels import dispatch

    dispatch._plans.clear()  # and chooses its kernels afresh (a test may monkeypatch a family)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*slow pure-PyTorch reference kernel.*")
        yield
    torch._dynamo.reset()
