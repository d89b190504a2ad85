"""ShapeEval, a GenEval-like compositional benchmark for tiny images: ``render`` (ground truth), ``checker`` (an
image against its prompt), ``score`` (folders of images, ground truth, corruptions) and ``evaluate`` (a model
through an engine). The prompt grammar is a prompt source: megaflow.data.shapes. Video ShapeEval (clips with a
motion or colour-change clause, megaflow.data.video_shapes) has the ``video_`` modules beside them."""

SAMPLERS = ("sglang", "diffusers")
"""How ``evaluate.evaluate_pipeline`` samples: an SGLang engine, or diffusers' own pipeline call (an independent
sampler, megaflow.rollout.pipeline_sampler). Here, free of heavy imports, for the CLI's choices too."""
CLIP_CORRUPTIONS = ("reverse", "color", "drop", "replace", "static")
"""How ``video_render.corrupt_clip`` spoils a clip: reverse: played backwards; color: one group in another colour;
drop: a frame dropped (the rest moves up, the last frame repeats); replace: a frame replaced by an empty one;
static: the first frame held throughout. Here for the CLI's choices too."""
