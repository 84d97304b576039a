"""ddplab: a hands-on lab for PyTorch DistributedDataParallel.

Start ranks from a notebook (``Cluster``), synchronize gradients three ways
(``average_gradients``, ``OverlapDDP``, ``BucketedDDP``), and compare them with
torch's own DDP on recorded timelines. See README.md and labs/.
"""
from .cluster import (Cluster, ClusterError, CollectiveTimeout, JobTimeout, RankDied, RankError,
                      launch)

__version__ = "0.1.0"
__all__ = ["Cluster", "launch", "ClusterError", "CollectiveTimeout", "JobTimeout", "RankDied",
           "RankError"]
