"""The ``gpumode`` command line."""
