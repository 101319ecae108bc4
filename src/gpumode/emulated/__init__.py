"""The emulated host: a kernel-shaped sysfs tree with kernel write semantics, modules, packages, services and
VMs.

Test double and the demo's default host. See ``docs/emulation.md``.
"""
