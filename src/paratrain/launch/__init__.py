"""The process layer: the agent that starts and watches the workers, and the two entry points it starts.

- ``agent.py``: ``launch(spec, module, args)``: preflight already done by the caller, it runs
  torchrun's agent in this process, reports the first failure and preemption;
- ``worker.py``: ``-m paratrain.launch.worker CONFIG``, one training rank (``-m paratrain.train``
  is its public alias);
- ``eval_worker.py``: ``-m paratrain.launch.eval_worker``, one rank of ``paratrain eval``.

Nothing here is imported by the library below it: the trainer does not know how it was started.
"""
