"""Technique 4, batch-size adjustment, and the arithmetic behind accumulation.

- ``plan.py``: ``global_batch_size = micro_batch_size x accum_steps x dp`` (``BatchPlan``), the
  replan after a resize, and the one ``divisors``;
- ``search.py``, ``measure.py``, ``auto.py``: the largest micro-batch that fits in memory
  (``batch.micro_batch_size = "auto"`` and ``paratrain find-batch``, below);
- ``lr_scaling.py``: the lr for a batch tuned at another (linear, sqrt, AdaScale);
- ``adaptive.py``: the batch that grows with the gradient noise scale (``batch.adaptive``).

The samples of each step are data/sampler.py's. The modules are imported by name (this package
imports none of them, so the light arithmetic does not pull in the step).

Find the largest micro-batch that fits in memory: ``batch.micro_batch_size = "auto"`` and
``paratrain find-batch``.

Two ways to decide whether a micro-batch size fits, one search and one answer format:

* **trial** (a CUDA device): run short real training steps (forward, backward, optimiser step)
  at growing sizes, recover from ``torch.OutOfMemoryError`` and free everything after each
  (gc, ``empty_cache``, ``reset_peak_memory_stats``). Every rank tries the same size and the
  ranks agree through one ``all_reduce(MIN)`` of "it fitted", so they all take the same path
  through the search and no rank desynchronises.
* **estimate** (CPU, planning for a device you don't have, ``--memory-gib``): run the same
  step on fake tensors (``FakeTensorMode``) under ``torch.distributed._tools.mem_tracker.
  MemTracker``, which counts parameters, gradients, optimiser state and activations without
  allocating any of them, and compare the peak with the budget.

Both run the *real* step: the model from the config, ``parallelize`` (so FSDP, TP and
activation checkpointing, once enabled, are what is measured), the optimiser and ``train_step``,
twice (the first step creates the optimiser state; the second is the steady state), with
``min(2, accumulation)`` micro-batches (accumulated gradients live through later backwards).

Replicated data parallelism (DDP) does not change what one rank holds apart from its gradient
buckets, so trials and estimates run one replica (``dp_replicate`` = 1, no gradient all-reduce
inside the step: an out-of-memory error on one rank cannot leave the others waiting in a
collective) and add DDP's buckets (one gradient's worth, kept for the whole run when gradients
are bucket views) explicitly.

The search (:func:`search_micro_batch`) runs over the divisors of the per-rank batch, since
accumulation keeps ``batch.global_batch_size`` and so the micro-batch must divide the per-rank
batch: the whole per-rank batch first, then bisection over the divisors, so any divisor is
reachable within ``max_trials`` (12) trials. It assumes the peak grows with the size.
"""
