"""Evaluations. ``shapes``: ShapeEval, a GenEval-like compositional benchmark for tiny images."""
