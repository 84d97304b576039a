"""Joining a group someone else started (ddplab/launchers/): torchrun, Slurm's srun and Open MPI's
mpirun read as torchrun's variables; real jobs on a one-machine Slurm (make test-slurm).
"""
