"""The machine side of technique 5: what the devices and links can do, measured or from the data sheet.

- ``specs.py``: the ONE GPU data sheet (peaks, memory, links) for MFU and the planner;
- ``collectives.py``: nccl-tests' bus factors and the latency-bandwidth fit of measured collectives;
- ``bench_comm.py`` / ``bench_compute.py``: ``paratrain bench comm|compute`` (each JSON writer
  beside its reader);
- ``env.py``: ``paratrain env``, the check of every node's software and devices.

The communication *mechanisms* (gradient compression, buckets, the reduce dtype) live in
``distributed/`` and ``precision.py``.
"""
