"""Alias kept for the public contract: ``torchrun ... -m paratrain.train CONFIG`` runs paratrain.launch.worker.

Run it with ``-m`` only, never import it: a submodule named ``train``, once imported, would be
bound as the package attribute ``paratrain.train`` in place of the API function. ``-m`` runs
this file as ``__main__`` without binding it (runpy), so the function stays.
"""

import sys

from paratrain.launch.worker import main

if __name__ == "__main__":
    sys.exit(main())
