"""Settings of the test session's one Ray (``conftest.ray_session``) that tests also read."""

# Ray exports metrics every 10 s by default; the tests that wait for the export read it sooner.
METRICS_REPORT_INTERVAL_MS = 2000
