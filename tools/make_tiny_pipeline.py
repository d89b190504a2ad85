"""Write a tiny, randomly initialised diffusers pipeline (SD3 or FLUX.1) to a directory, offline.

    python tools/make_tiny_pipeline.py --family sd3 --out runs/tiny-sd3 [--seed 0]
    python tools/make_tiny_pipeline.py --family flux --out runs/tiny-flux

The builder is megaflow.models.tiny_pipeline (so a run can make one); this file is its CLI.
"""
from megaflow.models.tiny_pipeline import *  # noqa: F401,F403
from megaflow.models.tiny_pipeline import build_flux, build_sd3, main, make_tiny_pipeline  # noqa: F401

if __name__ == "__main__":
    main()
