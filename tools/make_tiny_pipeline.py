"""Write a tiny, randomly initialised diffusers pipeline (SD3, FLUX.1, Qwen-Image or Wan 2.1) to a directory, offline.

    python tools/make_tiny_pipeline.py --family sd3 --out runs/tiny-sd3 [--seed 0]
    python tools/make_tiny_pipeline.py --family flux --out runs/tiny-flux
    python tools/make_tiny_pipeline.py --family qwen_image --out runs/tiny-qwen-image
    python tools/make_tiny_pipeline.py --family wan --out runs/tiny-wan

The builder is megaflow.models.tiny_pipeline (so a run can make one); this file is its CLI.
"""
from megaflow.models.tiny_pipeline import *  # noqa: F401,F403
from megaflow.models.tiny_pipeline import (  # noqa: F401
    BUILDERS, build_flux, build_qwen_image, build_sd3, build_wan, main, make_tiny_pipeline)

if __name__ == "__main__":
    main()
