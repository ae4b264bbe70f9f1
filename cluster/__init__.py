"""pdserve.cluster: the cluster on Ray and Redis, in rooms that import one way
(``tests/unit/test_layers.py``, ``ROOMS``):

base modules here (``config``, ``config_io``, ``redact``, ``pids``, ``status``) < ``state`` (Redis) and
``runtime`` (Ray, worker actors) < ``control`` (control loops) < ``head`` (the serving
processes) < ``cli`` (the operator's commands)."""
