"""The control loops of the leading router: the leader lease, the pool manager that acts on the
planner's decisions, the reaper of dead workers' requests and the ledger writer. Built on
``state`` and ``runtime``."""
