"""Each lab's rank programs (ddplab/lessons/), run on live ranks.
"""
