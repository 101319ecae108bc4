"""gpumode.server"""
