"""Running one model over several processes or machines, on torch.distributed.

plan.py     how the model is cut: heads, MLP columns, vocabulary rows, layers
shard.py    a rank's view of the checkpoint (only its bytes of the file)
group.py    the collectives the model calls (all-reduce, gather, send/recv)
runtime.py  starting the ranks, driving each step from rank 0, watching and stopping them
build.py    rank 0's part for the engine: registered with engine/build.py on import
worker.py   `python -m tokenmill.distributed.worker`: a rank > 0 started by rank 0
"""
