"""NVIDIA's vGPU type ids as published, written out by hand from the sources, independent of gpumode's tables.

- T4, Quadro RTX 6000, A16, A2: ``vgpuConfig.xml`` of the vGPU 14.0 KVM host driver (R510, 510.47.03), as a
  public transcription of that file lists them (id, name); real hosts show the same ``nvidia-<id>`` types.
- L40S: a real host's ``<VF>/nvidia/creatable_vgpu_types`` under vGPU 17 (R550), quoted in
  harvester/pcidevices ``pkg/util/gpuhelper``.

Keyed by (PCI device id, subsystem device id) of the board, vendor 10de for both.
"""

from __future__ import annotations


def _block(prefix: str, first: int, names: str) -> dict[str, int]:
    return {f"{prefix}-{name}": first + i for i, name in enumerate(names.split())}


def _ga107(prefix: str, first: int) -> dict[str, int]:
    return _block(prefix, first, "1B 2B 1Q 2Q 4Q 8Q 16Q 1A 2A 4A 8A 16A 4C 8C 16C")


PUBLISHED: dict[tuple[int, int], dict[str, int]] = {
    (0x1EB8, 0x12A2): {
        **_block("GRID T4", 222, "1B 2B 2B4 1A 2A 4A 8A 16A 1Q 2Q 4Q 8Q 16Q"),
        "GRID T4-1B4": 252,
        **_block("GRID T4", 319, "4C 8C 16C"),
    },
    (0x1E30, 0x12BA): {
        **_block("GRID RTX6000", 256, "1Q 2Q 3Q 4Q 6Q 8Q 12Q 24Q"),
        **_block("GRID RTX6000", 343, "4C 6C 8C 12C 24C"),
        **_block("GRID RTX6000", 435, "1B 2B 1A 2A 3A 4A 6A 8A 12A 24A"),
    },
    (0x25B6, 0x14A9): _ga107("NVIDIA A16", 709),
    (0x25B6, 0x157E): _ga107("NVIDIA A2", 742),
    (0x26B9, 0x1851): {
        **_block(
            "NVIDIA L40S", 1145, "1B 2B 1Q 2Q 3Q 4Q 6Q 8Q 12Q 16Q 24Q 48Q 1A 2A 3A 4A 6A 8A 12A 16A 24A 48A"
        ),
        "NVIDIA L40S-3B": 2164,
    },
}
