"""The alpha-beta cost model and the simulated link (ddplab/netsim/).
"""
