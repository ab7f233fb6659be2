"""`python -m apir ...` runs the `apir` command (apir.cli), with no PATH set-up needed."""

import sys

import apir

if not hasattr(apir, "__version__"):
    # `apir` resolved to a folder without __init__.py on sys.path, such as a clone named apir
    # in the current folder, which hides an editable install's package (the `apir` script
    # does not look in the current folder)
    where = ", ".join(getattr(apir, "__path__", [])) or "?"
    sys.exit(
        f"python -m apir: the folder {where} hides the apir package (run it from inside the clone, "
        "or use the `apir` command)"
    )

from apir.cli import entry  # noqa: E402  (after the check: it imports from the package)

sys.exit(entry())
