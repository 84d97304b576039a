"""Measuring (ddplab/measure/): compare(), sweeps, the what-if, recordings of a user's own run,
memory per rank and what fits, predicted and measured.
"""
