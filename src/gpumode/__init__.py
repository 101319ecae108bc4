"""gpumode: move GPU hosts, and each GPU in them, between accel, vGPU and passthrough modes."""

__version__ = "0.2.0.dev0"
