"""gpumode.agent"""
