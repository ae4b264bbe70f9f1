"""The cluster's state in Redis: the embedded server and its supervisor, the outage guard, the
request ledger, the batch store, the request log and the worker registry. Imports nothing of
``cluster`` beyond its base modules (config, pids)."""
