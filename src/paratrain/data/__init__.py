"""Data: datasets and their builder (datasets.py), the sampler and loader, packing, and
``paratrain prepare`` (prepare.py, chat.py).

Nothing is imported here, so ``paratrain prepare`` (which needs neither torch nor the trainer)
starts without loading torch: import the module you need, e.g. ``paratrain.data.datasets``.
"""
