"""The observing process group (ddplab/pg/): every op seen however it is called, counted as the group's
sequence number, waits capped; NCCL's contract kept over a fake ProcessGroupNCCL on CPU ranks.
"""
