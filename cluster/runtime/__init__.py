"""The Ray runtime: Ray's environment for pdserve, the worker actors (pinned to cores, metered)
and their metrics. Imports nothing of ``cluster`` beyond its base modules."""
