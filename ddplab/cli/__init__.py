"""The shell front door (``python -m ddplab ...``): ``compare`` (the measuring engine) and
``doctor`` (what this machine gives a data-parallel job)."""
