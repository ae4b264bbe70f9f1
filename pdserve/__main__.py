"""``python -m pdserve``: the same as the ``pdserve`` command."""

from pdserve.cli import main

raise SystemExit(main())
