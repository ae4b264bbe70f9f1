"""The operator's subcommands (``up``, ``router``, ``status``, ``down``, ``config``, ``requests``,
``demo``, ``prepare-model``, ``batch``): argument parsing and printing over ``head``."""
