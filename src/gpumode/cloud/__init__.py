"""gpumode.cloud"""
