"""Launching ranks: a persistent Cluster for notebooks, launch() for one-shot runs."""
from .cluster import Cluster, launch
from .errors import ClusterError, CollectiveTimeout, JobTimeout, RankDied, RankError

__all__ = ["Cluster", "launch", "ClusterError", "CollectiveTimeout", "JobTimeout", "RankDied", "RankError"]
