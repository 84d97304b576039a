"""Gradient synchronization (ddplab/sync/ and ddplab/sync/core/): equal to one process and to
torch DDP after every step, ranks starting from different weights; torch's bucket rule; ZeRO-1
and FSDP against torch's own.
"""
