"""Launching ranks: a persistent Cluster for notebooks, launch() for one-shot runs."""
from ddplab.cluster.cluster import Cluster, launch
from ddplab.cluster.errors import ClusterError, CollectiveTimeout, JobTimeout, RankDied, RankError

__all__ = ["Cluster", "launch", "ClusterError", "CollectiveTimeout", "JobTimeout", "RankDied", "RankError"]
