"""``python -m gpumode``: the same as the ``gpumode`` command."""

from gpumode.cli.main import main

main()
