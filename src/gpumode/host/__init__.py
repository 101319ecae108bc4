"""One Linux host: the only code in gpumode that touches /sys, /proc, /etc or runs commands."""

from gpumode.host.root import CommandError, CommandResult, Host

__all__ = ["CommandError", "CommandResult", "Host"]
