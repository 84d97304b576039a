"""ddplab: a hands-on lab for PyTorch DistributedDataParallel.

Start ranks from a notebook (``Cluster``), synchronize gradients three ways
(``average_gradients``, ``OverlapDDP``, ``BucketedDDP``), and compare them with
torch's own DDP on recorded timelines. See README.md and labs/.
"""
from ddplab.cluster import Cluster, ClusterError, CollectiveTimeout, JobTimeout, RankDied, RankError, launch
from ddplab.course.labsetup import lab_world_size, runs_here
from ddplab.launchers.requeue import Resumable
from ddplab.launchers.torchrun import init_from_env
from ddplab.pg.backend import backend_name, device
from ddplab.sync.registry import build_strategy, register_strategy, strategy_names
from ddplab.sync.your_code import as_strategy

__version__ = "0.1.0"
__all__ = ["Cluster", "launch", "ClusterError", "CollectiveTimeout", "JobTimeout", "RankDied",
           "RankError", "average_gradients", "OverlapDDP", "BucketedDDP", "init_from_env", "Resumable",
           "register_strategy", "as_strategy", "build_strategy", "strategy_names", "device", "backend_name",
           "lab_world_size", "runs_here", "record", "view"]
__all__ += ["ShardedOptimizer", "FSDP"]


def load_ipython_extension(ipython):
    """``%load_ext ddplab``: the %ddp_* magics (ddplab.notebook.magics), imported only here
    so that ranks and torchrun scripts never import IPython."""
    from ddplab.notebook.magics import load_ipython_extension as load

    load(ipython)


def unload_ipython_extension(ipython):
    from ddplab.notebook.magics import unload_ipython_extension as unload

    unload(ipython)


_SYNC = ("average_gradients", "OverlapDDP", "BucketedDDP")


def record(model, steps=range(1, 6), out=None, process_group=None):
    """Record optimizer ``steps`` of your torch DDP training on every rank (ddplab.measure.recording);
    ``model``: the DDP wrapper, or what holds it (a Lightning or Hugging Face Trainer, a
    LightningModule: ddplab.integrations), or the root module torch's ``fully_shard`` was applied
    to (its all-gathers and reduce-scatters per unit: ddplab.measure.recording_fsdp). With
    ``out="run"`` rank 0 writes run.json, run.trace.json and run.html (the labs' figures) once the
    last step is over."""
    from ddplab.cli.view import runs_page
    from ddplab.integrations import record as attach

    return attach(model, steps, out, process_group, write_page=runs_page)


def view(*paths, out=None):
    """Saved runs side by side (ddplab.cli.view.view): ``ddplab.view("a.json", "b.json")``."""
    from ddplab.cli.view import view as draw

    return draw(*paths, out=out)


def __getattr__(name):
    # The sync names import torch (~1.5 s); load them on first use so that
    # `import ddplab` stays instant for the launcher and the magics.
    if name in _SYNC:
        from ddplab import sync

        return getattr(sync, name)
    if name == "ShardedOptimizer":  # one version only: the reference (ddplab.sync.core)
        from ddplab.sync.core.sharded_optimizer import ShardedOptimizer

        return ShardedOptimizer
    if name == "FSDP":  # fully sharded data parallel: the reference, ddplab.sync.core.fsdp
        from ddplab.sync.core.fsdp import FSDP

        return FSDP
    raise AttributeError(f"module 'ddplab' has no attribute {name!r}")
