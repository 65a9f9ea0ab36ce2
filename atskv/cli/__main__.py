"""`python -m atskv.cli ...`: the `atskv` command without the installed script."""

from atskv.cli import main

main()
