"""Timelines (ddplab/timeline/): records, metrics, stamps on the device, rows drawn from the group.
"""
