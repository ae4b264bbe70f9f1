"""The router's retry rule for failures that belong to the request, not to the worker."""

from __future__ import annotations

from pdserve.engine.errors import EngineStepError, SamplingError, request_error
from pdserve.router.disagg_backend import _AttemptFailed, _repeated_failure
from pdserve.router.worker_pool import WorkerLost

STEP = EngineStepError.code
NAN = "engine step failed: probability tensor contains either `inf`, `nan` or element < 0"


def test_an_engine_step_failure_repeated_on_a_second_worker_ends_the_request() -> None:
    seen: dict[str, str] = {}
    assert _repeated_failure(_AttemptFailed("prefill-a", "prefill on prefill-a failed", code=STEP,
                                            reported=NAN), seen) is None
    err = _repeated_failure(_AttemptFailed("prefill-b", "prefill on prefill-b failed", code=STEP,
                                           reported=NAN), seen)
    assert isinstance(err, EngineStepError)
    assert "prefill-a" in str(err) and "prefill-b" in str(err) and NAN in str(err)


def test_other_failures_are_retried() -> None:
    seen: dict[str, str] = {}
    # The same worker failing twice says nothing about the request.
    for _ in range(2):
        assert _repeated_failure(_AttemptFailed("d1", "x", code=STEP, reported=NAN), seen) is None
    # Different failures, failures without the engine's code, lost workers: retried as before.
    assert _repeated_failure(_AttemptFailed("d2", "x", code=STEP, reported="engine step failed: other"), seen) is None
    for exc in (_AttemptFailed("d3", "KV transfer failed", reported="KV transfer failed"),
                _AttemptFailed("d4", "KV transfer failed", reported="KV transfer failed"),
                WorkerLost("d5", "died")):
        assert _repeated_failure(exc, seen) is None


def test_a_request_error_code_names_its_own_typed_error() -> None:
    assert isinstance(request_error(SamplingError.code, "m"), SamplingError)
    assert request_error("no-such-code", "m") is None
