"""The course layer (ddplab/course/): exercises and handouts in step with the labs, the classroom
on a real JupyterHub with nbgrader (make test-hub), on Slurm (make test-slurm-hub).
"""
