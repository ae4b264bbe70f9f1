"""pdserve.capacity: the measured cost model (profile), traffic, the cluster simulator and the
capacity plan. Pure computation: no Ray, Redis or engine at import time."""
