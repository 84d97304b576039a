"""The graders (ddplab/checks/): a learner's code on live ranks against torch DDP and one process;
every named mistake planted and named, correct spellings passed.
"""
