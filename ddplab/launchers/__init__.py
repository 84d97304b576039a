"""Joining a group that someone else started: torchrun, Slurm's srun, Open MPI's mpirun.

One entry point: ``ddplab.init_from_env()`` (``ddplab.launchers.torchrun``), which reads
the launcher's variables (``schedulers`` maps Slurm's and Open MPI's onto torchrun's)
and joins the observing group as a Cluster's ranks do.
"""
