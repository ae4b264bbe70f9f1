"""Request limits the cluster config names as its defaults: plain constants, importable without the
router's request parsing (and the gRPC it brings), so that loading a config stays light."""

from __future__ import annotations

# The default of router.max_choices_per_request: the sequences (n or best_of times the prompts,
# or beams) one request may run at once, each of which takes an admission slot.
DEFAULT_MAX_CHOICES = 16
