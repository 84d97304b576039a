"""The notebook front door (ddplab/notebook/): %%ddp magics, per-rank output, export.
"""
