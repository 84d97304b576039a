"""The Cluster and its rank processes (ddplab/cluster/): jobs from any thread, a raising or dying
rank named, Interrupts at every named point, no process left behind, a private rendezvous.
"""
