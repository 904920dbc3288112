"""Alias kept for the public contract: ``torchrun ... -m paratrain.train CONFIG`` runs paratrain.launch.worker.

Run it with ``-m`` only, never import it: a submodule named ``train``, once imported, would be
bound as the package attribute ``paratrain.train`` in place of the API function. ``-m`` runs
this file as ``__main__`` without binding it (runpy), so the function stays.
"""

from paratrain.distributed.process_group import run_then_exit
from paratrain.launch.worker import main

if __name__ == "__main__":
    run_then_exit(main)
