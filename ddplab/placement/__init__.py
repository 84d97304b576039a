"""Where ranks run: which CPUs and threads, which GPUs, and who else holds them.

One entry point: ``ddplab.placement.gpus.place`` (which GPU each rank gets); the
CPUs and threads per rank come from ``ddplab.placement.resources``. ``gpu_facts`` reads
the GPUs (nvidia-smi, MIG, CUDA_VISIBLE_DEVICES) and ``gpu_locks`` keeps two
Clusters on one server from taking the same GPU.
"""
