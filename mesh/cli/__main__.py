"""``python -m mesh.cli``: the ``mesh`` command."""

from mesh.cli import main

raise SystemExit(main())
