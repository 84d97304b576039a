"""Where ranks run (ddplab/placement/): which GPUs each Cluster gets, never another's; the device
helpers on fake GPUs.
"""
