"""ShapeEval, a GenEval-like compositional benchmark for tiny images: ``render`` (ground truth), ``checker`` (an
image against its prompt), ``score`` (folders of images, ground truth, corruptions) and ``evaluate`` (a model
through an engine). The prompt grammar is a prompt source: megaflow.data.shapes."""
