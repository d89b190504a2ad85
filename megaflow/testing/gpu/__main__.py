"""``python -m megaflow.testing.gpu``: see ``megaflow.testing.gpu.run``."""
import sys

if __name__ == "__main__":  # spawned children (CUDA IPC check) re-import this module as __mp_main__
    from megaflow.testing.gpu.run import main

    sys.exit(main())
