"""Simulated links (clearly labelled) and the alpha-beta cost model fitted to real gloo."""
from ddplab.netsim.link import PRESETS, LinkModel, LinkQueue

__all__ = ["PRESETS", "LinkModel", "LinkQueue"]
