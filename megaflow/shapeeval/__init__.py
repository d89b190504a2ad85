"""ShapeEval, a GenEval-like compositional benchmark for tiny images: ``render`` (ground truth), ``checker`` (an
image against its prompt), ``score`` (folders of images, ground truth, corruptions) and ``evaluate`` (a model
through an engine). The prompt grammar is a prompt source: megaflow.data.shapes."""

SAMPLERS = ("sglang", "diffusers")
"""How ``evaluate.evaluate_pipeline`` samples: an SGLang engine, or diffusers' own pipeline call (an independent
sampler, megaflow.rollout.pipeline_sampler). Here, free of heavy imports, for the CLI's choices too."""
