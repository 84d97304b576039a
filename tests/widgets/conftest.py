"""Figures and panels (ddplab/widgets/): they read results and never import torch.
"""
