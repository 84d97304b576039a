"""The notebook front end: ``%%ddp`` cells on live ranks, their display, tab completion, and
export of a notebook's cells to a torchrun script. Loaded by ``%load_ext ddplab`` only, so
ranks and torchrun scripts never import IPython."""
