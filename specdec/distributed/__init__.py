"""Below the model: what tensor parallelism gives a model and its loader.

``comm.TPGroup`` is the communicator the model sees (rank, size, ``all_reduce`` in rank order,
``gather_logits``); ``shm`` is the shared-memory all-reduce of one host; ``shard`` plans which
heads, columns and vocabulary rows each rank holds; ``binding`` gives each rank its cores. The
worker processes and rank 0's driver that commands them live above, in ``specdec.worker.tp``.
"""
