"""The processes that serve: the head (``launcher``: state files, ``serve``, ``up``/``down``),
the router service each router runs (routing plus, on the leader, the control loops), the extra
routers as Ray actors or as ``pdserve router`` processes, and what a dead head left running."""
