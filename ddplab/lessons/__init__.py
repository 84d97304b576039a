"""Each lab's rank programs: the code that runs on the live ranks to answer one question.

``common`` holds the toy nets and batches they share; ``training`` the questions of labs
01-04 (is a strategy the same as one process? when is the sync? what is the traffic?);
``ring`` and ``firstgroup`` lab 00; ``data`` and ``checkpoints`` lab 05; ``hangs`` lab 06;
``compression`` lab 07; ``pipeline`` lab 08; ``reducer_map`` lab 09; ``claims`` the
conditional claims of labs 02-04. The graders that mirror them live in ``ddplab.checks``.
"""
