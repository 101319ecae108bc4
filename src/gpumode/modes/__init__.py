"""gpumode.modes"""
