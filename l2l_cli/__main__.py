"""``python -m l2l_cli`` is ``l2l``."""

from l2l_cli.cli import main

main()
