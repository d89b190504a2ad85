"""Data: ShapeEval prompt sets (``shapes``) and their ground-truth renderer (``shape_render``)."""
